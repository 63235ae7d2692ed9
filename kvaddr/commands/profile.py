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
    Abort,
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
    parse_int,
    profile_option,
    write_json,
)
from kvaddr.errors import ProfileConfigError
from kvaddr.measure.profile_run import ENGINE_ONLY, ENGINES, VLLM_DEFAULT_CONTEXT, ProfileConfig, Progress
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES, parse_shape
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
run on the CPU (eager only, host wall time): their timings are NumPy code's,
not the GPU kernels', and --mode graph exits 3. Each row gives median, IQR
and sample count; on a GPU the floor row is one empty launch per step in the
same mode.
A difference whose interquartile ranges overlap the per-layer baseline's is
reported as "within noise", never as a saving.

--engine vllm profiles vLLM's step instead, on a GPU only (on the CPU it
exits 3): kvaddr's one-launch step (kvaddr.engines.vllm) against a faithful
reimplementation of vLLM Model Runner V2's three launches (positions and
seq_lens; the block-table gather; the slot mappings). Both are checked
against the NumPy reference first, then timed in the same modes; the table
gives the saving per step. In eager mode two more rows give the host time of
the one launch bound to the request state and the batch buffers (two ints a
step) and of compute() on fresh slices of the batch buffers every step.
--num-blocks-mem uva keeps num_blocks in pinned host memory read through UVA
(vLLM's layout). Shapes: --batch N is decode:N (N requests of one
token); --shape adds decode:N or mixed:N:T (N requests carrying about T
tokens, a sixteenth of them prefill chunks); by default decode:64,
decode:1024, decode:4096 and mixed:256:16384. Only with --engine vllm:
--groups (a block size per KV-cache group), --dcp, --dummy-fraction,
--sliding-window, --num-blocks-mem. --spec-tokens K with --engine vllm adds
the draft forwards of each verify step: vLLM's per-draft-step design against
kvaddr's one launch, checked equal, GPU time per cycle under CUDA graphs.
Only with the core engine: --prefill,
--block-size, --layers, --caches, --model, --step-ms, --save, --profile.
Either kind given with the other engine exits 2. --json writes the
kvaddr.profile.vllm report (docs/json-schema.md).

{EXIT_CODES_HELP}"""


#: ``kvaddr profile``'s option of each ProfileConfig field whose flag is not ``--`` + the name with ``-``.
FLAGS = {
    "batches": "--batch",
    "shapes": "--shape",
    "block_sizes": "--block-size",
    "json_path": "--json",
    "save_path": "--save",
    "workload_profile": "--profile",
}


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
        fields = exc.fields
        if config.engine == "vllm" and "shapes" in fields:  # the shapes come from --batch and --shape
            fields = tuple(f for name in fields for f in (("batches", "shapes") if name == "shapes" else (name,)))
        raise click.BadParameter(str(exc), param_hint=option_hint(fields) or None) from None
    return config


class ShapeList(click.ParamType):
    """``--shape``: a vLLM batch shape, ``decode:N`` or ``mixed:N:T`` (or a comma list of them)."""

    name = "decode:N|mixed:N:T"

    def get_metavar(self, param, ctx=None):
        return self.name

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return tuple(parse_shape(part).name for part in str(value).split(","))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class DcpSpec(click.ParamType):
    """``--dcp SIZE[:RANK[:INTERLEAVE]]``: decode context parallelism (RANK 0 and INTERLEAVE 1 unless given)."""

    name = "SIZE[:RANK[:INTERLEAVE]]"

    def get_metavar(self, param, ctx=None):
        return self.name

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(":")
        if len(parts) > 3:
            self.fail(f"expected SIZE[:RANK[:INTERLEAVE]], got {value!r}", param, ctx)
        try:
            size = parse_int(parts[0], "SIZE", 1, 1024)
            rank = parse_int(parts[1], "RANK", 0, size - 1) if len(parts) > 1 else 0
            interleave = parse_int(parts[2], "INTERLEAVE", 1, 1 << 20) if len(parts) > 2 else 1
        except ValueError as exc:
            self.fail(f"{exc} (expected SIZE[:RANK[:INTERLEAVE]])", param, ctx)
        return size, rank, interleave


#: Why an option of the core engine does not apply with ``--engine vllm``, where a word helps.
VLLM_INSTEAD = {
    "block_sizes": "--groups gives each vLLM KV-cache group's block size",
    "prefill": "--shape mixed:N:T mixes prefill chunks into a batch",
    "save_path": "a vLLM engine report is no baseline for kvaddr compare / check; write it with --json PATH",
}


def engine_settings(ctx, options: dict) -> dict:
    """``options`` of ``kvaddr profile`` (or ``sweep``) as ProfileConfig settings for their engine.

    An option given on the command line that applies to the other engine only
    (:data:`~kvaddr.measure.profile_run.ENGINE_ONLY`) is a usage error naming
    it. With ``--engine vllm``, ``--batch N`` becomes the shape ``decode:N``
    (before the ``--shape`` ones; duplicates dropped).
    """
    from click.core import ParameterSource

    options = dict(options)
    engine = options.get("engine", "core")
    # given on the command line; a --profile file's values count as --profile (refused with --engine vllm)
    given = [
        n
        for n in ctx.params
        if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    other = [e for e in ENGINES if e != engine]
    off = [n for e in other for n in ENGINE_ONLY[e] if n in given and not (engine == "vllm" and n == "batches")]
    if off:
        whose = " / ".join(f"--engine {e}" for e in other)
        why = [VLLM_INSTEAD[n] for n in off if engine == "vllm" and n in VLLM_INSTEAD]
        raise click.BadParameter(
            f"{'applies' if len(off) == 1 else 'apply'} to {whose} only, not --engine {engine}"
            + "".join(f"; {w}" for w in why),
            param_hint=option_hint(off),
        )
    shapes = tuple(s for group in options.get("shapes") or () for s in group)
    if engine == "vllm":
        if "batches" in given:
            shapes = tuple(f"decode:{b}" for b in options["batches"]) + shapes
        options["batches"] = ProfileConfig.batches  # --batch became decode shapes
    options["shapes"] = tuple(dict.fromkeys(shapes))
    return options


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


def refuse_graph_mode_without_gpu(config: ProfileConfig, command: str = "profile") -> None:
    """``--mode graph`` on the core engine without a GPU: exit 3 (``--device cpu``: a usage error), not a run
    that quietly measures eager mode only."""
    from kvaddr.measure.environment import use_gpu

    if config.mode != "graph" or config.engine != "core" or config.device == "cuda":
        return  # --device cuda without a GPU exits 3 on its own
    if config.device == "cpu":
        raise click.BadParameter(
            "CUDA graphs need a GPU, and --device cpu runs the NumPy strategies, eager only; "
            "leave out --mode or give --mode eager",
            param_hint="'--mode'",
        )
    use_cuda, reason = use_gpu(config.device)
    if not use_cuda:
        raise Abort(
            EXIT_ENV,
            f"--mode graph: CUDA graphs need a GPU, and no CUDA device was found ({reason}); without one "
            f"kvaddr {command} times the NumPy strategies on the CPU, eager only: leave out --mode or give --mode eager",
        )


def profile_and_report(
    config: ProfileConfig, *, stdout_json: bool, tables: bool = True, command: str = "profile"
) -> dict:
    """Run ``config`` and report it as ``kvaddr profile`` does; return the report.

    Status lines and the progress bar go to stderr (no bar with ``stdout_json``);
    the JSON document goes to stdout with ``stdout_json``, else the tables (when
    ``tables``) and, with ``config.json_path``, the JSON file; ``config.save_path``
    saves the run as a baseline. Status lines start ``kvaddr COMMAND:``.
    """
    from kvaddr.measure.profile_run import run
    from kvaddr.measure.report import render_report
    from kvaddr.measure.vllm_profile import VLLM_KIND, render_vllm_report

    err = err_console()
    doc = run(config, ConsoleProgress(err, show_bar=err.is_terminal and not stdout_json, prefix=f"kvaddr {command}"))
    if stdout_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        if tables:
            (render_vllm_report if doc["kind"] == VLLM_KIND else render_report)(out_console(), doc)
        if config.json_path is not None:
            write_json(doc, config.json_path, "profile")
    if config.save_path is not None:
        from kvaddr.gate.baseline_file import save_runs

        for action in save_runs(config.save_path, [doc]):
            err.print(f"kvaddr {command}: baseline {config.save_path}: {action}")
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
        "kvaddr profile --batch 1,8,64,256 --spec-tokens 1 --step-ms 12",
        "kvaddr profile --model glm-5 --prefill 2:512 --json report.json --save base.json",
        "kvaddr profile --engine vllm --batch 64,1024 --shape mixed:256:16384 --groups 16,64",
    ),
)
@click.option(
    "--engine",
    type=click.Choice(list(ENGINES)),
    default="core",
    show_default=True,
    help="core: kvaddr's step strategies; vllm: the one-launch vLLM step against vLLM's three launches (GPU only).",
)
@click.option(
    "--batch",
    "batches",
    type=IntList(1, 1 << 20, "batch size"),
    default="64",
    show_default=True,
    help="Requests per step: one size or a comma list (e.g. 1,8,64,256). With --engine vllm: the shapes decode:N.",
)
@click.option(
    "--shape",
    "shapes",
    type=ShapeList(),
    multiple=True,
    help="[--engine vllm] A batch shape: decode:N (N one-token requests) or mixed:N:T (N requests, about T "
    "tokens); repeatable. [default: " + " ".join(DEFAULT_SHAPES) + ", unless --batch is given]",
)
@click.option(
    "--context",
    type=IntRangeSpec(),
    default=None,
    help="Tokens already in the KV cache of each decode request, drawn log-uniformly from LO:HI (or N). "
    f"[default: {DEFAULT_CONTEXT[0]}:{DEFAULT_CONTEXT[1]}; --engine vllm: "
    f"{VLLM_DEFAULT_CONTEXT[0]}:{VLLM_DEFAULT_CONTEXT[1]}]",
)
@click.option(
    "--spec-tokens",
    type=IntBounds(0, 64),
    default=0,
    show_default=True,
    help="Speculative (MTP) tokens per decode request: each runs 1 + N tokens. On a GPU the report adds "
    "the MTP draft model's N substeps per cycle: FastDeploy's per-substep design against one launch. "
    "With --engine vllm: the draft forwards' addressing per verify+drafts cycle, vLLM's per-draft-step "
    "design against one launch (the step's timings are unchanged).",
)
@click.option(
    "--prefill",
    type=PrefillSpec(),
    default=None,
    help="N of the batch's requests are chunked-prefill requests of LEN tokens.",
)
@block_size_option()
@click.option(
    "--groups",
    type=IntList(1, 1 << 20, "block size"),
    default="16",
    show_default=True,
    help="[--engine vllm] KV-cache groups: the block size of each (1 to 4 groups, e.g. 16,64).",
)
@layers_option()
@caches_option()
@click.option(
    "--model",
    type=click.Choice(sorted(PRESETS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset (layers, caches, block size).",
)
@click.option(
    "--dcp",
    type=DcpSpec(),
    default="1",
    show_default=True,
    help="[--engine vllm] Decode context parallelism: SIZE ranks, this RANK, INTERLEAVE tokens per run "
    "(dividing the first group's block size); the first group is sharded. 1: off.",
)
@click.option(
    "--dummy-fraction",
    type=FloatBounds(0, 8),
    default=0.0,
    show_default=True,
    callback=finite,
    help="[--engine vllm] Dummy (CUDA-graph padding) requests added per real request.",
)
@click.option(
    "--sliding-window",
    type=IntBounds(0, 1 << 31),  # the setting's own bound (MAX_CONTEXT) is checked by ProfileConfig
    default=0,
    show_default=True,
    help="[--engine vllm] Sliding-window reach R of the last group (two or more groups). 0: none.",
)
@click.option(
    "--num-blocks-mem",
    type=click.Choice(["device", "uva"]),
    default="device",
    show_default=True,
    help="[--engine vllm] Where num_blocks lives: device memory, or pinned host memory read through UVA "
    "(vLLM's layout), for every implementation.",
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
    help="Distinct batches per batch size (--engine vllm: per shape), rotated while timing.",
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
@click.option(
    "--dsa",
    is_flag=True,
    help="DeepSeek-V3.2 sparse attention instead (docs/dsa.md): per decode step (each --batch), the indexer "
    "metadata and every layer's top-k -> slots conversion (K = 2048), the per-layer design against kvaddr's "
    "(the metadata in the step's launch), every output checked first. Needs a GPU.",
)
@profile_option("profile")
@click.pass_context
@guarded("profile")
def profile(ctx, **options):
    started = time.perf_counter()
    if options.pop("dsa"):
        dsa_report(ctx, options)
        err_console().print(f"kvaddr profile: done in {time.perf_counter() - started:.1f} s")
        return
    options = engine_settings(ctx, options)
    order = tuple("shapes" if n == "batches" and options["engine"] == "vllm" else n for n in ctx.params)
    config = validated(ProfileConfig(**options, option_order=order))
    check_output_path(config.json_path, "--json")
    check_save_path(config.save_path)
    refuse_graph_mode_without_gpu(config)
    profile_and_report(config, stdout_json=config.json_path == "-")
    err_console().print(f"kvaddr profile: done in {time.perf_counter() - started:.1f} s")


def dsa_report(ctx, options: dict) -> None:
    """``kvaddr profile --dsa``: DSA addressing per decode step (kvaddr.measure.dsa_profile)."""

    from kvaddr.measure import dsa_profile
    from kvaddr.measure.workload import PRESETS

    if options.get("engine", "core") != "core":
        raise click.BadParameter("--dsa profiles the core step", param_hint="'--engine'")
    preset = PRESETS[options["model"]]
    layers = options["layers"] if options.get("layers") is not None else preset.num_layers
    sizes = options.get("block_sizes") or (preset.block_size,)
    from kvaddr.measure.environment import use_gpu

    if options.get("device") == "cpu":
        raise click.BadParameter("--dsa times CUDA kernels: leave out --device cpu", param_hint="'--device'")
    use_cuda, reason = use_gpu(options.get("device"))
    if not use_cuda:
        raise Abort(
            EXIT_ENV, f"--dsa: the conversions and the step run on a GPU, and no CUDA device was found ({reason})"
        )
    rows = dsa_profile.run_dsa_profile(tuple(options["batches"]), layers=layers, block_size=sizes[-1])
    click.echo(dsa_profile.format_rows(rows))
    if options.get("json_path"):
        text = json.dumps({"dsa": [r.as_dict() for r in rows]}, indent=1)
        if options["json_path"] == "-":
            click.echo(text)
        else:
            with open(options["json_path"], "w") as f:
                f.write(text + "\n")


# ----------------------------------------------------------------------------- info


INFO_HELP = """Report the GPUs, driver, CUDA runtime, CuPy, NVRTC, whether kernels.cu compiles for
this GPU, and CuPy's kernel cache (the folder and what it holds: the first planner on a machine
compiles the kernels it needs, a few seconds; later processes load them from the cache).

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
        kernel_cache_summary,
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
    report["kernel_cache"] = kernel_cache_summary()

    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from rich.table import Table

        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True)
        table.add_column()
        # Driver, runtime and NVRTC are asked of CuPy: without it they were not looked for.
        missing = "not found" if report["cupy"] else "not checked: CuPy is not installed"
        table.add_row("kvaddr", report["kvaddr"])
        table.add_row("Python", report["python"])
        table.add_row("NumPy", report["numpy"])
        table.add_row("CuPy", report["cupy"] or "not installed")
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
        table.add_row("kernel cache", report["kernel_cache"])
        out_console().print(table)
    if compile_ok is False:
        err_console().print(f"kvaddr info: {compile_msg}")
        raise SystemExit(EXIT_ENV)
