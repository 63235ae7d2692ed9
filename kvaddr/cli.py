"""The ``kvaddr`` command: ``kvaddr profile`` and ``kvaddr info``.

Data (tables, JSON) goes to stdout, status and errors to stderr. Exit status:
0 ok, 1 a check failed (or kvaddr hit an internal error), 2 usage error,
3 environment problem (no GPU for ``--device cuda``, no CuPy, kernels.cu does
not compile). User errors never print a Python traceback; set
``KVADDR_DEBUG=1`` to get one for internal errors.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import click

from kvaddr.measure.profiles import profile_option
from kvaddr.measure.workload import DEFAULT_CONTEXT, DEFAULT_MODEL, PRESETS, Workload

EXIT_OK, EXIT_CHECK, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3
#: Caches one step may address (kernels.cu's KV_MAX_CACHES).
MAX_CACHES = 4
#: Limits that keep a profile run within memory (checked as usage errors).
MAX_CONTEXT = 1 << 30
MAX_TOKENS_PER_STEP = 1 << 24
MAX_TABLE_ENTRIES = 1 << 26

EXIT_CODES_HELP = """\b
Exit status:
  0  ok
  1  a check failed: a strategy's output differs from the reference
     (or kvaddr hit an internal error)
  2  usage error (a bad option value)
  3  environment problem: --device cuda without a CUDA device, CuPy
     missing, kernels.cu does not compile for this GPU
"""


def _max_caches() -> int:
    try:
        from kvaddr import kernel_loader

        return int(kernel_loader.constants().get("KV_MAX_CACHES", MAX_CACHES))
    except Exception:
        return MAX_CACHES


# ----------------------------------------------------------------------------- consoles


def _err_console():
    from rich.console import Console

    return Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def _out_console():
    from rich.console import Console

    wide = None if sys.stdout.isatty() else 240
    return Console(markup=False, highlight=False, width=wide)


class _Abort(Exception):
    """Stop with an exit status after printing a message on stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def write_json(doc: dict, json_path: str, command: str) -> None:
    """Write a command's JSON document to ``json_path`` (``-``, stdout, is the caller's)."""
    try:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise _Abort(EXIT_ENV, f"cannot write --json {json_path!r}: {exc.strerror or exc}") from None
    _err_console().print(f"kvaddr {command}: JSON report written to {json_path}")


def use_cuda_for(device: str, command: str, verb: str) -> bool:
    """Resolve ``--device auto|cuda|cpu``: True for the GPU. ``--device cuda`` without a
    usable GPU exits 3; ``auto`` without one says so on stderr (``<verb> the NumPy
    strategies on the CPU``)."""
    if device == "cpu":
        return False
    from kvaddr.measure.environment import probe_cuda

    probe = probe_cuda()
    if device == "cuda" and not probe.available:
        raise _Abort(EXIT_ENV, f"--device cuda: no CUDA device found: {probe.reason}")
    if not probe.available:
        _err_console().print(
            f"kvaddr {command}: no CUDA device found ({probe.reason}); {verb} the NumPy strategies on the CPU"
        )
    return probe.available


def _guarded(command_name: str):
    """Map every failure of a command to a message on stderr and an exit status."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            from kvaddr.measure.correctness import CheckFailed
            from kvaddr.measure.profile_run import EnvironmentProblem

            err = _err_console()
            try:
                return fn(*args, **kwargs)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise
            except _Abort as exc:
                err.print(f"kvaddr {command_name}: {exc}")
                code = exc.code
            except CheckFailed as exc:
                err.print(f"kvaddr {command_name}: check failed: {exc}")
                err.print("no timing is reported until every strategy matches the reference")
                code = EXIT_CHECK
            except EnvironmentProblem as exc:
                err.print(f"kvaddr {command_name}: {exc}")
                code = EXIT_ENV
            except KeyboardInterrupt:
                err.print(f"kvaddr {command_name}: interrupted")
                code = 130
            except Exception as exc:
                if os.environ.get("KVADDR_DEBUG"):
                    raise
                err.print(
                    f"kvaddr {command_name}: internal error: {type(exc).__name__}: {exc} "
                    f"(set KVADDR_DEBUG=1 for a traceback)"
                )
                code = EXIT_CHECK
            raise SystemExit(code)

        return run

    return wrap


# ----------------------------------------------------------------------------- option types


def _parse_int(text: str, what: str, lo: int, hi: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text.strip()!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


class IntList(click.ParamType):
    """One integer or a comma-separated list of them."""

    name = "N[,N...]"

    def __init__(self, lo: int, hi: int, what: str):
        self.lo, self.hi, self.what = lo, hi, what

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            out = tuple(_parse_int(p, self.what, self.lo, self.hi) for p in parts)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return out


class IntRangeSpec(click.ParamType):
    """``N`` or ``LO:HI`` (inclusive)."""

    name = "N|LO:HI"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value)
        try:
            if ":" in text:
                lo_text, hi_text = text.split(":", 1)
                lo = _parse_int(lo_text, "LO", 0, MAX_CONTEXT)
                hi = _parse_int(hi_text, "HI", 0, MAX_CONTEXT)
            else:
                lo = hi = _parse_int(text, "N", 0, MAX_CONTEXT)
        except ValueError as exc:
            self.fail(f"{exc} (expected N or LO:HI context tokens)", param, ctx)
        if lo > hi:
            self.fail(f"LO must be <= HI, got {lo}:{hi}", param, ctx)
        return lo, hi


class PrefillSpec(click.ParamType):
    """``N:LEN``: N chunked-prefill requests of LEN tokens."""

    name = "N:LEN"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value)
        if ":" not in text:
            self.fail(f"expected N:LEN (requests:tokens), got {text!r}", param, ctx)
        n_text, len_text = text.split(":", 1)
        try:
            n = _parse_int(n_text, "N", 0, 1 << 20)
            length = _parse_int(len_text, "LEN", 1, MAX_TOKENS_PER_STEP)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return n, length


# ----------------------------------------------------------------------------- the group


def _print_version(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    from kvaddr.measure.environment import kvaddr_version

    click.echo(f"kvaddr {kvaddr_version()}")
    ctx.exit(0)


@click.group(name="kvaddr", context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli():
    """kvaddr: KV-cache step addressing for LLM serving, in one kernel launch per step.

    `kvaddr profile` measures what per-layer slot mapping costs a decode step
    and what hoisting it, or fusing the whole step's addressing into one
    launch, saves; `kvaddr info` reports the GPU, CUDA and kernel-compile
    status.
    """


# ----------------------------------------------------------------------------- profile


PROFILE_HELP = f"""Replay decode batches and report what each addressing strategy costs per step.

Correctness first: every strategy runs on every input set (and every
captured CUDA graph is replayed once) and each output is compared element
for element with the NumPy reference; on any difference the command names
the strategy, output, token and both values, exits 1 and reports no time.

Workload (default: the DeepSeek-V3.2 decode preset, 61 layers, 2 caches per
layer sharing one block table, B = 64): BATCH requests per step, each a
decode request of 1 + K tokens whose context (tokens already cached) is
drawn log-uniformly from --context (default {DEFAULT_CONTEXT[0]}:{DEFAULT_CONTEXT[1]}),
seeded by --seed. --prefill N:LEN makes N of the BATCH requests
chunked-prefill requests of LEN tokens (about half of them continuation
chunks). Block tables come from a shuffled block pool, fragmented like a
long-running server's. Several input sets per batch size are rotated so
repeats do not just hit L2.

Timing: compile and first launches happen before measuring. On a GPU, on a
non-default CUDA stream, eager mode reports host wall time per step (what a
Python serving loop pays, synchronised at the end of each block) and GPU
time (CUDA events); graph mode captures whole steps per strategy into a CUDA
graph (as many as make about 200 us, cycling through the input sets) and
times replays (GPU time per step). Without a GPU the NumPy strategies
run on the CPU (eager only, host wall time). Each row gives median, IQR and
sample count; the floor row is one empty launch per step in the same mode.
A difference whose interquartile ranges overlap the per-layer baseline's is
reported as "within noise", never as a saving.

{EXIT_CODES_HELP}"""


def _validate_workload(batches, context, spec_tokens, prefill, block_sizes, num_caches):
    """Cross-option checks; raise click.BadParameter naming the option."""
    if prefill is not None:
        n, _ = prefill
        too_small = [b for b in batches if n > b]
        if too_small:
            raise click.BadParameter(
                f"N = {n} prefill requests do not fit in batch {too_small[0]} (N must be <= every --batch size)",
                param_hint="'--prefill'",
            )
    if len(block_sizes) > 1 and len(block_sizes) != num_caches:
        raise click.BadParameter(
            f"got {len(block_sizes)} block sizes for {num_caches} caches (give one size, or one per cache)",
            param_hint="'--block-size'",
        )
    probe = Workload(
        model="",
        num_layers=1,
        num_caches=num_caches,
        block_sizes=tuple(block_sizes) if len(block_sizes) > 1 else tuple(block_sizes) * num_caches,
        context=context,
        spec_tokens=spec_tokens,
        prefill=prefill,
    )
    for b in batches:
        if probe.capacity(b) > MAX_TOKENS_PER_STEP:
            hint = "'--prefill'" if prefill else "'--batch' / '--spec-tokens'"
            raise click.BadParameter(
                f"batch {b} carries {probe.capacity(b)} tokens per step, more than the "
                f"{MAX_TOKENS_PER_STEP} kvaddr profile allows",
                param_hint=hint,
            )
        for B in set(probe.block_sizes):
            entries = b * probe.max_blocks(B)
            if entries > MAX_TABLE_ENTRIES:
                raise click.BadParameter(
                    f"a block table of batch {b} x {probe.max_blocks(B)} blocks (B = {B}, longest sequence "
                    f"{probe.longest_sequence()} tokens) exceeds {MAX_TABLE_ENTRIES} entries; lower the context "
                    f"or raise the block size",
                    param_hint="'--context' / '--block-size'",
                )


def _finite(ctx, param, value):
    """Reject nan and inf, which click's FloatRange lets through."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}", ctx=ctx, param=param)
    return value


class _RichProgress:
    """Adapts :class:`kvaddr.measure.profile_run.Progress` to a rich progress bar."""

    def __init__(self, bar, task):
        self.bar, self.task = bar, task

    def start(self, label: str) -> None:
        self.bar.update(self.task, description=label)

    def advance(self) -> None:
        self.bar.advance(self.task)


@cli.command("profile", help=PROFILE_HELP, epilog=None)
@click.option(
    "--batch",
    "batches",
    type=IntList(1, 1 << 20, "batch size"),
    default="64",
    show_default=True,
    help="Requests per step: one size or a comma list (e.g. 1,8,64,256).",
)
@click.option(
    "--context",
    type=IntRangeSpec(),
    default=f"{DEFAULT_CONTEXT[0]}:{DEFAULT_CONTEXT[1]}",
    show_default=True,
    help="Context of decode requests (tokens already in the KV cache): N, or LO:HI drawn log-uniformly.",
)
@click.option(
    "--spec-tokens",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    metavar="K",
    help="Speculative (MTP) tokens per decode request: each runs 1 + K tokens.",
)
@click.option(
    "--prefill",
    type=PrefillSpec(),
    default=None,
    help="N of the batch's requests are chunked-prefill requests of LEN tokens.",
)
@click.option(
    "--block-size",
    "block_sizes",
    type=IntList(1, 1 << 20, "block size"),
    default=None,
    help="Tokens per block: one for every cache, or one per cache. [default: the model's, 64]",
)
@click.option("--layers", type=click.IntRange(1, 4096), default=None, help="Transformer layers. [default: the model's]")
@click.option(
    "--caches",
    type=click.IntRange(1, _max_caches()),
    default=None,
    help="Paged caches per layer. [default: the model's, 2]",
)
@click.option(
    "--model",
    type=click.Choice(sorted(PRESETS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset (layers, caches, block size).",
)
@click.option(
    "--mode",
    type=click.Choice(["eager", "graph", "both"]),
    default=None,
    help="GPU launch mode. [default: both on a GPU; the CPU path has eager only]",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(0, min_open=True),
    default=None,
    metavar="MS",
    callback=_finite,
    help="Also express each saving as a share of a step of MS milliseconds.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    metavar="PATH",
    help="Write the JSON report to PATH ('-': stdout, and nothing else there).",
)
@click.option(
    "--save",
    "save_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also save the run, every raw sample included, as a baseline for kvaddr compare / check; a run "
    "of the same workload in FILE is replaced, another added (docs/baseline-format.md).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="Where to run the strategies: auto = the GPU if CuPy finds one, else the CPU.",
)
@click.option(
    "--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="Seed of the generated batches."
)
@click.option(
    "--budget",
    type=click.FloatRange(0, 600),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    callback=_finite,
    help="Time spent sampling each strategy in each mode (at least 10 samples, at most 2000).",
)
@click.option(
    "--input-sets",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Distinct batches per batch size, rotated while timing.",
)
@profile_option("profile")
@click.pass_context
@_guarded("profile")
def profile(
    ctx,
    batches,
    context,
    spec_tokens,
    prefill,
    block_sizes,
    layers,
    caches,
    model,
    mode,
    step_ms,
    json_path,
    device,
    seed,
    budget,
    input_sets,
    save_path=None,
    workload_profile=None,
):
    from kvaddr.measure.environment import describe
    from kvaddr.measure.profile_run import CpuBackend, CudaBackend, run_profile
    from kvaddr.measure.report import document, render_shape
    from kvaddr.measure.timing import MAX_SAMPLES, MIN_SAMPLES, TARGET_BLOCK_S, Budget

    started = time.perf_counter()
    err = _err_console()
    preset = PRESETS[model]
    num_layers = layers if layers is not None else preset.num_layers
    num_caches = (
        caches
        if caches is not None
        else (len(block_sizes) if block_sizes and len(block_sizes) > 1 else preset.num_caches)
    )
    sizes = block_sizes if block_sizes else (preset.block_size,)
    _validate_workload(batches, context, spec_tokens, prefill, sizes, num_caches)
    if json_path not in (None, "-"):
        parent = os.path.dirname(os.path.abspath(json_path))
        if not os.path.isdir(parent):
            raise click.BadParameter(f"the folder {parent!r} does not exist", param_hint="'--json'")
        if not os.access(parent, os.W_OK):
            raise click.BadParameter(f"the folder {parent!r} is not writable", param_hint="'--json'")
    if save_path is not None:
        from kvaddr.gate.baseline_file import save_target_problem

        if save_target_problem(save_path):
            raise click.BadParameter(save_target_problem(save_path), param_hint="'--save'")
    workload = Workload(
        model=model,
        num_layers=num_layers,
        num_caches=num_caches,
        block_sizes=tuple(sizes) if len(sizes) > 1 else tuple(sizes) * num_caches,
        context=context,
        spec_tokens=spec_tokens,
        prefill=prefill,
        seed=seed,
        input_sets=input_sets,
    )

    use_cuda = use_cuda_for(device, "profile", "profiling")
    if use_cuda:
        modes = {"eager": ("eager",), "graph": ("graph",)}.get(mode, ("eager", "graph"))
    else:
        modes = ("eager",)
        if mode in ("graph", "both"):
            err.print("kvaddr profile: graph mode needs a CUDA device; the CPU path measures eager mode only")

    backend = CudaBackend(0) if use_cuda else CpuBackend()
    budget_cfg = Budget(seconds=budget)
    to_stdout_json = json_path == "-"
    show_bar = err.is_terminal and not to_stdout_json
    err.print(
        f"kvaddr profile: checking {len(batches)} batch size(s) x {input_sets} input sets against the "
        f"reference on the {'GPU' if use_cuda else 'CPU'} ..."
    )

    def checked():
        err.print(
            f"kvaddr profile: all strategies match the reference ({time.perf_counter() - started:.1f} s); "
            f"timing, {budget:g} s per strategy and mode ..."
        )

    num_strategies = 4
    if show_bar:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as bar:
            task = bar.add_task("checking", total=len(batches) * backend.units(num_strategies, modes))
            shapes = run_profile(backend, workload, batches, modes, budget_cfg, _RichProgress(bar, task), checked)
    else:
        shapes = run_profile(backend, workload, batches, modes, budget_cfg, None, checked)

    environment = describe("cuda" if use_cuda else "cpu", 0 if use_cuda else None)
    settings = {
        "device": environment["device"],
        "modes": list(modes),
        "budget_s": budget,
        "min_samples": MIN_SAMPLES,
        "max_samples": MAX_SAMPLES,
        "target_block_s": TARGET_BLOCK_S,
        "input_sets": input_sets,
        "step_ms": step_ms,
        "batches": list(batches),
    }
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ctx.params.items()}
    doc = document(shapes, workload, environment, settings, options)
    wall = time.perf_counter() - started
    doc["wall_s"] = round(wall, 3)
    from kvaddr.gate.baseline_file import PROFILE_DOCUMENT_META

    ctx.meta[PROFILE_DOCUMENT_META] = doc  # for kvaddr check, which runs this command in-process

    if to_stdout_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        out = _out_console()
        for shape in shapes:
            render_shape(out, shape, workload, environment["device"], step_ms)
        if json_path is not None:
            write_json(doc, json_path, "profile")
    if save_path is not None:
        from kvaddr.gate.baseline_file import BaselineError, save_runs

        try:
            for action in save_runs(save_path, [doc]):
                err.print(f"kvaddr profile: baseline {save_path}: {action}")
        except BaselineError as exc:
            raise _Abort(exc.code, str(exc)) from None
    err.print(f"kvaddr profile: done in {wall:.1f} s")


# ----------------------------------------------------------------------------- info


INFO_HELP = """Report the GPUs, driver, CUDA runtime, CuPy, NVRTC, whether kernels.cu compiles for
this GPU, and CuPy's kernel cache folder.

\b
Exit status: 0 when the report was printed, with or without CuPy or a GPU
(it is informational); 3 when a GPU is present but kernels.cu does not
compile for it (the NVRTC log goes to stderr).
"""


@cli.command("info", help=INFO_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@_guarded("info")
def info(as_json):
    from kvaddr.measure.environment import (
        compile_check,
        cuda_versions,
        gpu_list,
        kernel_cache_dir,
        probe_cuda,
        python_info,
    )

    report = {**python_info(), **cuda_versions()}
    probe = probe_cuda()
    report["cuda_available"] = probe.available
    report["cuda_status"] = probe.reason
    report["gpus"] = gpu_list() if probe.available else []
    compile_ok, compile_msg = None, "not tried: no CUDA device"
    if probe.available:
        compile_ok, compile_msg = compile_check(0)
    report["kernels_compile"] = compile_ok
    report["kernels_compile_message"] = compile_msg if compile_ok is not False else compile_msg.splitlines()[0]
    report["kernel_cache_dir"] = kernel_cache_dir()

    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from rich.table import Table

        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True)
        table.add_column()
        missing = "not found"
        table.add_row("kvaddr", report["kvaddr"])
        table.add_row("Python", report["python"])
        table.add_row("NumPy", report["numpy"])
        table.add_row("CuPy", report["cupy"] or missing)
        table.add_row("CUDA driver", report["cuda_driver"] or ("none" if report["cupy"] else missing))
        table.add_row("CUDA runtime", report["cuda_runtime"] or missing)
        table.add_row("NVRTC", report["nvrtc"] or missing)
        table.add_row("CUDA devices", probe.reason)
        for g in report["gpus"]:
            if "error" in g:
                table.add_row(f"GPU {g['index']}", g["error"])
            else:
                table.add_row(
                    f"GPU {g['index']}",
                    f"{g['name']} (compute capability {g['compute_capability']}, "
                    f"{g['total_memory_bytes'] / 2**30:.0f} GiB, "
                    f"{g['multiprocessors']} SMs)",
                )
        status = {True: "yes, for GPU 0: ", False: "NO: ", None: ""}[compile_ok]
        table.add_row("kernels.cu compiles", status + report["kernels_compile_message"])
        table.add_row("kernel cache", report["kernel_cache_dir"])
        _out_console().print(table)
    if compile_ok is False:
        _err_console().print(f"kvaddr info: {compile_msg}")
        raise SystemExit(EXIT_ENV)


# kvaddr compare / kvaddr check (issue 5): the regression gate on saved baselines.
from kvaddr.commands import gate as _cli_compare  # noqa: E402

cli.add_command(_cli_compare.compare)
cli.add_command(_cli_compare.check)

# kvaddr trace generate / replay / sweep / profiles (issue 4): traces, workload profiles and plots.
from kvaddr.commands import traces as _cli_trace  # noqa: E402

_cli_trace.register(sys.modules[__name__])

#: The group under the name the issue gives it.
kvaddr = cli


def main() -> None:
    """Console entry point (``kvaddr = kvaddr.cli:main``)."""
    cli(prog_name="kvaddr")


if __name__ == "__main__":  # pragma: no cover
    main()
