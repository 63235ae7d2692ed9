"""``kvaddr profile``: check every strategy against the reference, then time it; and
``kvaddr info``: the GPU, CUDA and kernel-compile status.

``profile`` builds a :class:`~kvaddr.measure.profile_run.ProfileConfig` from its
options and calls :func:`~kvaddr.measure.profile_run.run`; :func:`profile_and_report`
(also used by ``kvaddr sweep``) prints the tables and saves the baseline.
"""

from __future__ import annotations

import json
import time

import click

from kvaddr.commands.common import (
    EXIT_CODES_HELP,
    EXIT_ENV,
    FloatBounds,
    IntBounds,
    IntList,
    IntRangeSpec,
    PrefillSpec,
    block_size_option,
    caches_option,
    check_output_path,
    device_option,
    err_console,
    examples,
    finite,
    guarded,
    json_option,
    layers_option,
    mode_option,
    out_console,
    profile_option,
    write_json,
)
from kvaddr.errors import ProfileConfigError
from kvaddr.measure.profile_run import ProfileConfig, Progress
from kvaddr.measure.workload import DEFAULT_CONTEXT, DEFAULT_MODEL, PRESETS

PROFILE_HELP = f"""Replay decode batches and report what each addressing strategy costs per step.

Correctness first: every strategy runs on every input set (and every
captured CUDA graph is replayed once) and each output is compared element
for element with the NumPy reference; on any difference the command names
the strategy, output, token and both values, exits 1 and reports no time.
one-block (FastDeploy's one-block kernel, one thread per request) runs at
most 1024 requests: for a larger BATCH its row says "not run".

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


#: ``kvaddr profile``'s option of each ProfileConfig field whose flag is not ``--`` + the name with ``-``.
FLAGS = {"batches": "--batch", "block_sizes": "--block-size", "json_path": "--json", "save_path": "--save"}


def flag(name: str) -> str:
    """The ``kvaddr profile`` option that sets ProfileConfig field ``name``."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def option_hint(fields) -> str:
    """``("context", "block_sizes")`` -> ``"'--context' / '--block-size'"``."""
    return " / ".join(f"'{flag(f)}'" for f in fields)


def validated(config: ProfileConfig) -> ProfileConfig:
    """``config``, checked; an invalid setting is a usage error naming its option."""
    try:
        config.validate()
    except ProfileConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=option_hint(exc.fields) or None) from None
    return config


class ConsoleProgress(Progress):
    """A profile run's status lines on stderr (``kvaddr profile: ...``) and, when asked, a rich progress bar."""

    def __init__(self, err, show_bar: bool, prefix: str = "kvaddr profile"):
        self.err, self.show_bar, self.prefix = err, show_bar, prefix
        self.bar = self.task = None

    def note(self, message: str) -> None:
        self.err.print(f"{self.prefix}: {message}")

    def begin(self, total: int) -> None:
        if not self.show_bar:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.err,
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("checking", total=total)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=label)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def profile_and_report(config: ProfileConfig, *, stdout_json: bool, tables: bool = True) -> dict:
    """Run ``config`` and report it as ``kvaddr profile`` does; return the report.

    Status lines and the progress bar go to stderr (no bar with ``stdout_json``);
    the JSON document goes to stdout with ``stdout_json``, else the tables (when
    ``tables``) and, with ``config.json_path``, the JSON file; ``config.save_path``
    saves the run as a baseline.
    """
    from kvaddr.measure.profile_run import run
    from kvaddr.measure.report import render_report

    err = err_console()
    doc = run(config, ConsoleProgress(err, show_bar=err.is_terminal and not stdout_json))
    if stdout_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        if tables:
            render_report(out_console(), doc)
        if config.json_path is not None:
            write_json(doc, config.json_path, "profile")
    if config.save_path is not None:
        from kvaddr.gate.baseline_file import save_runs

        for action in save_runs(config.save_path, [doc]):
            err.print(f"kvaddr profile: baseline {config.save_path}: {action}")
    return doc


def check_save_path(save_path: str | None, option: str = "--save") -> None:
    """Usage error when ``save_path`` exists and is not a baseline this run may join."""
    if save_path is not None:
        from kvaddr.gate.baseline_file import save_target_problem

        check_output_path(save_path, option, regular=True)

        problem = save_target_problem(save_path)
        if problem:
            raise click.BadParameter(problem, param_hint=f"'{option}'")


def attention_groups(ctx, param, value):
    """``--attention``'s text as a tuple of groups (click callback)."""
    from kvaddr.attention_reference import normalize_attention

    try:
        return normalize_attention(value or None)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(
    "profile",
    help=PROFILE_HELP,
    epilog=examples(
        "kvaddr profile --batch 64",
        "kvaddr profile --batch 1,8,64,256 --spec-tokens 1 --step-ms 12",
        "kvaddr profile --model glm-5 --prefill 2:512 --json report.json --save base.json",
    ),
)
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
    type=IntBounds(0, 64),
    default=0,
    show_default=True,
    help="Speculative (MTP) tokens per decode request: each runs 1 + N tokens.",
)
@click.option(
    "--prefill",
    type=PrefillSpec(),
    default=None,
    help="N of the batch's requests are chunked-prefill requests of LEN tokens.",
)
@block_size_option()
@layers_option()
@caches_option()
@click.option(
    "--model",
    type=click.Choice(sorted(PRESETS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset (layers, caches, block size).",
)
@mode_option()
@click.option(
    "--step-ms",
    type=FloatBounds(0, min_open=True),
    default=None,
    metavar="MS",
    callback=finite,
    help="Also express each saving as a share of a step of MS milliseconds.",
)
@json_option()
@click.option(
    "--save",
    "save_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="Also save the run, every raw sample included, as a baseline for kvaddr compare / check; a run "
    "of the same workload in PATH is replaced, another added (docs/baseline-format.md).",
)
@device_option()
@click.option(
    "--seed", type=IntBounds(0, 2**63 - 1), default=0, show_default=True, help="Seed of the generated batches."
)
@click.option(
    "--budget",
    type=FloatBounds(0, 600),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    callback=finite,
    help="Time spent sampling each strategy in each mode (at least 10 samples, at most 2000).",
)
@click.option(
    "--input-sets",
    type=IntBounds(1, 64),
    default=4,
    show_default=True,
    help="Distinct batches per batch size, rotated while timing.",
)
@click.option(
    "--attention",
    default="",
    callback=attention_groups,
    metavar="NAME[,NAME...]",
    help="Attention outputs every strategy also produces, comma-separated: flashinfer, varlen, page_table "
    "(docs/attention.md). The fused step writes them in its one launch; the baselines build them the way "
    "engines do (separate launches), so the saving includes them.",
)
@click.option(
    "--kv-indices-capacity",
    type=IntBounds(1, 2**31 - 1),
    default=None,
    metavar="N",
    help="Entries of flashinfer's kv_indices per cache [default: the workload's bound, the most pages any "
    "input set needs: every call writes all N entries].",
)
@profile_option("profile")
@click.pass_context
@guarded("profile")
def profile(ctx, **options):
    started = time.perf_counter()
    config = validated(ProfileConfig(**options, option_order=tuple(ctx.params)))
    check_output_path(config.json_path, "--json")
    check_save_path(config.save_path)
    profile_and_report(config, stdout_json=config.json_path == "-")
    err_console().print(f"kvaddr profile: done in {time.perf_counter() - started:.1f} s")


# ----------------------------------------------------------------------------- info


INFO_HELP = """Report the GPUs, driver, CUDA runtime, CuPy, NVRTC, whether kernels.cu compiles for
this GPU, and CuPy's kernel cache folder.

\b
Exit status: 0 when the report was printed, with or without CuPy or a GPU
(it is informational); 3 when a GPU is present but kernels.cu does not
compile for it (the NVRTC log goes to stderr); 141 stdout was closed early
(| head): kvaddr stops quietly.
"""


@click.command("info", help=INFO_HELP, epilog=examples("kvaddr info", "kvaddr info --json"))
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@guarded("info")
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
        out_console().print(table)
    if compile_ok is False:
        err_console().print(f"kvaddr info: {compile_msg}")
        raise SystemExit(EXIT_ENV)
