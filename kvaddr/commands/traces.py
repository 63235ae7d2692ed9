"""``kvaddr trace generate``, ``kvaddr replay``, ``kvaddr sweep`` and ``kvaddr profiles``.

Same conventions as ``kvaddr profile`` (:mod:`kvaddr.commands.common`): data on
stdout, status and errors on stderr, a progress bar only on a terminal, exit
status 0 ok, 1 a check failed, 2 usage, 3 environment, and no traceback for a
user's mistake. ``sweep`` takes every option of ``kvaddr profile`` and runs it
through :func:`kvaddr.commands.profile.profile_and_report`.
"""

from __future__ import annotations

import copy
import json
import time

import click

from kvaddr.commands import profile as profile_command
from kvaddr.commands.common import (
    CONTEXT_SETTINGS,
    EXIT_CHECK,
    EXIT_CODES_HELP,
    EXIT_ENV,
    EXIT_PIPE_HELP,
    EXIT_USAGE,
    PLOT_FORMATS,
    Abort,
    FloatBounds,
    IntBounds,
    IntList,
    bar_progress,
    check_output_path,
    device_option,
    err_console,
    examples,
    exit_quietly_on_closed_pipe,
    finite,
    guarded,
    is_broken_pipe,
    json_option,
    load_report,
    mode_option,
    out_console,
    profile_option,
    resolve_block_sizes,
    resolve_modes,
    use_cuda_for,
    write_json,
)
from kvaddr.constants import MAX_CACHES
from kvaddr.errors import BaselineError
from kvaddr.measure.profile_run import ENGINE_ONLY, ProfileConfig
from kvaddr.measure.workload import DEFAULT_MODEL, PRESETS

#: Batch sizes a sweep profiles unless told otherwise.
SWEEP_BATCHES = "1,4,16,64,256,1024"
#: Seconds of sampling per strategy and mode in a sweep unless told otherwise.
SWEEP_BUDGET = 0.5
#: Bad lines printed on stderr as they are found (all are counted).
BAD_LINES_SHOWN = 20


class DistributionType(click.ParamType):
    """A length distribution: fixed:N, uniform:LO:HI, loguniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX]."""

    name = "DIST"

    def convert(self, value, param, ctx):
        from kvaddr.traces.generator import Distribution

        if isinstance(value, Distribution):
            return value
        try:
            return Distribution.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# ----------------------------------------------------------------------------- trace generate


GENERATE_HELP = f"""Simulate a serving run and write it as a trace (JSON Lines, one line per step).

Reproducible by --seed: the same options give the same file, byte for byte.
Each engine step, a Poisson number of requests arrive (mean --arrival-rate
per step) with prompt and output lengths drawn from --prompt-len and
--output-len; running requests are scheduled first (decode: 1 + K tokens
with K = --spec-tokens, each draft token accepted with probability
--acceptance until the first rejection; prefill: the next chunk), then
waiting ones are admitted while fewer than --max-running run, all within
--max-batched-tokens tokens per step (chunked prefill). KV blocks come from a
paged allocator of --kv-tokens / B blocks per block table with a FIFO free
list: blocks freed by finished requests are reused, so block tables fragment
as on a long-running server; when blocks run out the newest request is
preempted and later recomputed (vLLM's policy). Steps that run nothing are
not written.

\b
Length distributions (DIST):
  N or fixed:N                   always N tokens
  uniform:LO:HI                  uniform integers in [LO, HI]
  loguniform:LO:HI               log-uniform in [LO, HI]
  lognormal:MEDIAN:SIGMA[:MAX]   MEDIAN * exp(SIGMA * normal), in [1, MAX]

The trace goes to stdout unless -o names a file (.gz: gzip-compressed); a
summary of the run goes to stderr.

\b
Exit status:
    0  the trace was written
    1  kvaddr hit an internal error
    2  usage error: a bad option value, or an -o PATH that cannot be
       written (found before the run)
    3  the trace could not be written to its end (a full disk)
{EXIT_PIPE_HELP}
"""


def _generate(
    steps,
    warmup_steps,
    arrival_rate,
    prompt_len,
    output_len,
    max_running,
    max_batched_tokens,
    spec_tokens,
    acceptance,
    model,
    block_sizes,
    caches,
    kv_tokens,
    max_waiting,
    seed,
    output,
    workload_profile=None,
):
    from kvaddr.traces.generator import GeneratorConfig, write_trace

    err = err_console()
    preset = PRESETS[model]
    num_caches = (
        caches
        if caches is not None
        else (len(block_sizes) if block_sizes and len(block_sizes) > 1 else preset.num_caches)
    )
    sizes = resolve_block_sizes(block_sizes or (preset.block_size,), num_caches)
    if max_batched_tokens < 1 + spec_tokens:
        raise click.BadParameter(
            f"{max_batched_tokens} tokens per step cannot hold one decode request of 1 + {spec_tokens} tokens",
            param_hint="'--max-batched-tokens'",
        )
    too_small = [b for b in dict.fromkeys(sizes) if kv_tokens // b < 1]
    if too_small:
        raise click.BadParameter(
            f"{kv_tokens} tokens do not hold one block of {too_small[0]}", param_hint="'--kv-tokens'"
        )
    check_output_path(output, "-o / --output")
    config = GeneratorConfig(
        steps=steps,
        warmup_steps=warmup_steps,
        arrival_rate=arrival_rate,
        prompt_len=prompt_len,
        output_len=output_len,
        max_running=max_running,
        max_batched_tokens=max_batched_tokens,
        spec_tokens=spec_tokens,
        acceptance=acceptance,
        block_sizes=sizes,
        kv_tokens=kv_tokens,
        max_waiting=max_waiting,
        seed=seed,
        model=model,
    )
    started = time.perf_counter()
    bar = bar_progress(err, steps) if output != "-" else None
    try:
        if bar is not None:
            with bar:
                task = bar.add_task(f"generating {steps} steps", total=steps)
                stats = write_trace(config, output, lambda n: bar.update(task, completed=n))
        else:
            stats = write_trace(config, output)
    except OSError as exc:
        if is_broken_pipe(exc):  # the reader of stdout went away (`| head`): quietly, 141
            exit_quietly_on_closed_pipe()
        raise Abort(EXIT_ENV, f"cannot write the trace {output!r}: {exc.strerror or exc}") from exc
    d = stats.as_dict()
    where = "stdout" if output == "-" else output
    frac = d["contiguous_block_fraction"]
    reuse = d["block_reuses"] / d["block_allocations"] if d["block_allocations"] else 0.0
    err.print(
        f"kvaddr trace generate: wrote {stats.steps} steps to {where} in {time.perf_counter() - started:.1f} s "
        f"(seed {seed}{f', after {stats.warmup_steps} warm-up steps' if stats.warmup_steps else ''}): "
        f"{stats.arrived} requests arrived, {stats.admitted} admitted, {stats.finished} finished, "
        f"{stats.preempted} preemptions, {stats.rejected_queue_full + stats.rejected_too_long} rejected; "
        f"requests per step mean {d['mean_batch']:.1f}, max {stats.max_batch}; tokens per step max "
        f"{stats.max_tokens}; {100 * reuse:.0f}% of block allocations reused a freed block; "
        + (
            f"{100 * frac:.0f}% of adjacent logical blocks are physically adjacent"
            if frac is not None
            else "no request spans two blocks"
        )
    )
    if stats.stopped_early:
        err.print(f"kvaddr trace generate: stopped early: {stats.stopped_early}")


# ----------------------------------------------------------------------------- replay


REPLAY_HELP = f"""Replay a trace step by step: check every strategy, then report what each saves.

TRACE is a JSON Lines trace (docs/trace-format.md; '-' reads stdin; gzip
files are recognised), from `kvaddr trace generate` or dumped from an
engine. It is streamed: memory does not grow with its length.

Each step is padded to a captured shape as an engine pads to its CUDA-graph
sizes (requests and capacity to powers of two, idle rows added), checked
against the NumPy reference, run by every strategy and compared element for
element (every --check-every steps; a difference stops the replay, exit 1,
no report), and timed: one sample per strategy and step. On a GPU, graph
mode replays each strategy's CUDA graph for the step's shape (captured once
per shape), and eager mode (every --eager-every steps) times host wall time
and GPU time of one eager call; on the CPU the NumPy strategies run eagerly.

The report gives, per mode, each strategy's time per step and its saving
against per-layer on the same step (mean, p50, p99, min, total over the
trace), and the saving against batch size (active requests per step, in
power-of-two bins).

A bad line (not JSON, missing or inconsistent fields, or addresses that do
not fit the request's blocks) is reported on stderr with its line number and
skipped; every good line still replays, and the command then exits 1. A
trace that cannot be read to its end (a truncated or corrupt .gz) is
replayed up to the break, reported, and the command exits 1.

Block sizes come from the trace's header line, else from --block-size (or
the model's). The model (layers) comes from --model / --layers, else the
header's model, else {DEFAULT_MODEL}.
"""

REPLAY_EXIT_CODES_HELP = f"""\b
Exit status:
    0  every line replayed and every check passed
    1  a check failed (a strategy's output differs from the reference:
       no report); or the trace has bad lines, or cannot be read to its
       end (a truncated or corrupt .gz): the steps that could be read were
       replayed and reported; or no step to replay (or kvaddr hit an
       internal error)
    2  usage error: a bad option value, a TRACE that cannot be opened or
       whose first line cannot be read, or an output PATH (--json) that
       cannot be written, found before any work
    3  environment problem: --device cuda without a CUDA device, --mode
       graph without one, CuPy missing, kernels.cu does not compile for
       this GPU, or an output file whose write fails at the end
{EXIT_PIPE_HELP}
"""


def _replay(
    ctx,
    trace_path,
    model,
    layers,
    caches,
    block_sizes,
    mode,
    device,
    check_every,
    eager_every,
    max_steps,
    json_path,
    workload_profile=None,
):
    from click.core import ParameterSource

    from kvaddr.measure.environment import environment_record
    from kvaddr.traces.format import DAMAGED, TraceReader
    from kvaddr.traces.replay import CpuReplayer, CudaReplayer, replay_trace
    from kvaddr.traces.report import render, replay_document

    started = time.perf_counter()
    err = err_console()
    check_output_path(json_path, "--json")

    def explicit(name):
        return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)

    reader = TraceReader(trace_path)  # TraceError: exit 2
    with reader:
        # Precedence: the command line, then --profile, then the trace's header, then the defaults; but the
        # block sizes describe the trace's data, so the header's beat a profile's.
        header = reader.header
        header_sizes = header.block_sizes if header is not None else None
        if model is None:
            model = header.model if header is not None and header.model in PRESETS else DEFAULT_MODEL
        preset = PRESETS[model]
        num_layers = layers if layers is not None else preset.num_layers
        if block_sizes and (explicit("block_sizes") or header_sizes is None):
            n = (
                caches
                if caches is not None
                else (
                    len(block_sizes)
                    if len(block_sizes) > 1
                    else len(header_sizes)
                    if header_sizes
                    else preset.num_caches
                )
            )
            sizes = resolve_block_sizes(block_sizes, n)
        elif header_sizes is not None:
            sizes = header_sizes
            if caches is not None and caches != len(sizes) and explicit("caches"):
                raise click.BadParameter(
                    f"the trace's header gives {len(sizes)} caches (block_sizes {list(sizes)}), not {caches}",
                    param_hint="'--caches'",
                )
        else:
            n = caches if caches is not None else preset.num_caches
            sizes = (preset.block_size,) * n
            err.print(
                f"kvaddr replay: the trace has no header line with block_sizes; assuming B = "
                f"{preset.block_size} for {n} caches (the {model} preset's); give --block-size if that is "
                f"wrong"
            )

        if len(sizes) > MAX_CACHES:
            raise Abort(
                EXIT_USAGE,
                f"{trace_path}: {len(sizes)} caches (block_sizes {list(sizes)}); kvaddr "
                f"addresses at most {MAX_CACHES} per step",
            )
        use_cuda = use_cuda_for(device, "replay", "replaying")
        modes = resolve_modes(mode, use_cuda, "replay")
        replayer = CudaReplayer(num_layers, sizes, modes, 0) if use_cuda else CpuReplayer(num_layers, sizes)

        to_stdout_json = json_path == "-"
        shown = [0]

        def report_bad(stats):
            while shown[0] < min(len(stats.bad_examples), BAD_LINES_SHOWN):
                line, reason = stats.bad_examples[shown[0]]
                if reason.startswith(DAMAGED):  # reading stopped: nothing after it, the steps before it replayed
                    err.print(f"kvaddr replay: {trace_path}: line {line}: {reason}; the steps before it were replayed")
                else:
                    err.print(f"kvaddr replay: {trace_path}: line {line}: {reason} (skipped)")
                shown[0] += 1

        err.print(
            f"kvaddr replay: {trace_path}: {model}, {num_layers} layers, block sizes {list(sizes)}, on the "
            f"{'GPU' if use_cuda else 'CPU'} ({', '.join(modes)}) ..."
        )
        bar = bar_progress(err, reader.size) if not to_stdout_json else None
        if bar is not None:
            with bar:
                task = bar.add_task("replaying", total=reader.size or None)

                def progress(stats):
                    report_bad(stats)
                    if stats.lines % 16 == 0:
                        bar.update(task, completed=reader.bytes_read, description=f"replaying: {stats.steps} steps")

                stats = replay_trace(
                    reader,
                    replayer,
                    sizes,
                    check_every=check_every,
                    eager_every=eager_every,
                    max_steps=max_steps,
                    progress=progress,
                )
        else:
            stats = replay_trace(
                reader,
                replayer,
                sizes,
                check_every=check_every,
                eager_every=eager_every,
                max_steps=max_steps,
                progress=report_bad,
            )
        report_bad(stats)

    wall = time.perf_counter() - started
    if stats.bad_lines > shown[0]:
        err.print(
            f"kvaddr replay: ... {stats.bad_lines - shown[0]} more bad lines (the JSON report lists the first 100)"
        )
    if stats.steps == 0:
        raise Abort(
            EXIT_CHECK,
            f"{trace_path}: no step to replay ({stats.lines} lines, {stats.bad_lines} bad, {stats.idle_steps} idle)",
        )
    environment = environment_record("cuda" if use_cuda else "cpu", 0 if use_cuda else None)
    info = {
        "device": environment["device"],
        "trace": trace_path,
        "header": None if header is None else header.meta,
        "workload": {
            "model": model,
            "model_source": preset.source,
            "num_layers": num_layers,
            "num_caches": len(sizes),
            "block_sizes": list(sizes),
            "shared_table": len(set(sizes)) == 1,
        },
    }
    settings = {
        "device": environment["device"],
        "modes": list(modes),
        "check_every": check_every,
        "eager_every": eager_every,
        "max_steps": max_steps,
        "padding": "requests and capacity to the next power of two, table width to the widest row so far "
        "(a power of two)",
        "captured_shapes": getattr(replayer, "captures", None),
        "shapes_kept": replayer.shapes(),
    }
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ctx.params.items()}
    doc = replay_document(stats, info, environment, settings, options)
    doc["wall_s"] = round(wall, 3)
    if to_stdout_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        render(out_console(), stats, info)
        if json_path is not None:
            write_json(doc, json_path, "replay")
    err.print(f"kvaddr replay: {stats.steps} steps in {wall:.1f} s")
    if stats.bad_lines:
        damaged = [line for line, reason in stats.bad_examples if reason.startswith(DAMAGED)]
        skipped = stats.bad_lines - len(damaged)
        what = []
        if skipped:
            what.append(f"{skipped} bad line(s) in {trace_path} were skipped")
        if damaged:
            what.append(f"{trace_path} could not be read past line {damaged[0] - 1}")
        raise Abort(
            EXIT_CHECK,
            "; ".join(what) + f"; the {stats.steps} good steps before that were replayed and reported"
            if damaged
            else f"{what[0]} (first: line {stats.bad_examples[0][0]}); every good line was replayed",
        )


# ----------------------------------------------------------------------------- sweep


_PLOT_EXTENSIONS = ", ".join("." + e for e in PLOT_FORMATS)

SWEEP_HELP = f"""Profile a list of batch sizes and chart what each strategy saves per step.

Runs `kvaddr profile` over --batch (default {SWEEP_BATCHES}; every option of
`kvaddr profile` applies, --profile included, but --engine and the vLLM
engine's options: a sweep profiles the core engine), printing its tables, then a
terminal chart of the time saved per step against the per-layer baseline
(difference of medians), against batch size, one bar per strategy: eager
mode (host wall time) and graph mode (GPU time). --plot also draws it as an
image with matplotlib (an optional extra: pip install 'kvaddr[plot]'; without
it --plot exits 3 before profiling; the format follows the file's extension:
{_PLOT_EXTENSIONS}).

--from PATH charts a recorded run instead of profiling: a `kvaddr profile
--json` report, or a baseline file (`kvaddr profile --save`, as `kvaddr
compare` and `check` read). A baseline holding several runs needs --run LABEL
(the labels `kvaddr compare` prints: the --profile name or the model).

Output paths (--json, --plot, --save) are checked before profiling: a
file that cannot be written, or a --plot name without a known extension,
exits 2 naming the option.
"""

#: Options of `kvaddr profile` that sweep does not take: it has its own --json, and it sweeps the core
#: engine's batch sizes (not --engine vllm's shapes).
_NOT_SHARED = ("json_path", "engine", "dsa", *ENGINE_ONLY["vllm"])  # --dsa is profile's own report


def _sweep_params(profile_command) -> list:
    """`kvaddr profile`'s options (copies where sweep's default differs) plus sweep's own."""
    params = []
    for p in profile_command.params:
        if p.name in _NOT_SHARED:
            continue
        if p.name == "batches":
            p = copy.copy(p)
            p.default = SWEEP_BATCHES
        elif p.name == "budget":
            p = copy.copy(p)
            p.default = SWEEP_BUDGET
        params.append(p)
    params += [
        click.Option(
            ["--plot", "plot_path"],
            type=click.Path(dir_okay=False),
            default=None,
            metavar="PATH",
            help="Also draw the chart to PATH, a .png, .pdf or .svg file (or another extension listed above; "
            "needs matplotlib: pip install 'kvaddr[plot]').",
        ),
        click.Option(
            ["--json", "sweep_json_path"],
            type=click.Path(dir_okay=False, allow_dash=True),
            default=None,
            metavar="PATH",
            help="Write the profile's JSON report plus a 'sweep' object to PATH ('-': stdout, and nothing else there).",
        ),
        click.Option(
            ["--from", "from_path"],
            type=click.Path(dir_okay=False, exists=True),
            default=None,
            metavar="PATH",
            help="Chart a recorded run, from a kvaddr profile --json report or a baseline file "
            "(kvaddr profile --save); profile nothing.",
        ),
        click.Option(
            ["--run", "run_label"],
            default=None,
            metavar="LABEL",
            help="With --from: the run of a baseline holding several (its --profile name or model, as "
            "kvaddr compare labels it). [default: the only run]",
        ),
        click.Option(
            ["--chart/--no-chart", "chart"], default=True, show_default=True, help="Print the terminal chart."
        ),
    ]
    return params


def _load_run(path: str, run_label: str | None) -> dict:
    """The profile report ``sweep --from PATH`` charts: the report itself, or one run of a baseline file.

    A baseline of one run gives that run; of several, the one ``--run`` names (its label as
    ``kvaddr compare`` prints it), else a usage error listing the labels.
    """
    try:
        baseline = load_report(path)
    except BaselineError as exc:
        raise click.BadParameter(str(exc), param_hint="'--from'") from None
    labels = list(baseline.labels)
    if run_label is not None:
        if run_label not in labels:
            raise click.BadParameter(
                f"{path!r} holds no run {run_label!r} (its runs: {', '.join(labels)})", param_hint="'--run'"
            )
        return baseline.runs[labels.index(run_label)]
    if len(labels) > 1:
        raise click.BadParameter(
            f"{path!r} holds {len(labels)} runs; name one with --run: {', '.join(labels)}", param_hint="'--from'"
        )
    return baseline.runs[0]


def _sweep(option_order, plot_path=None, sweep_json_path=None, from_path=None, run_label=None, chart=True, **options):
    from kvaddr.measure.plot import matplotlib_version, plot_sweep
    from kvaddr.measure.sweep import render_chart, sweep_json

    started = time.perf_counter()
    err = err_console()
    if run_label is not None and from_path is None:
        raise click.BadParameter("--run picks a run of --from's baseline; give --from PATH", param_hint="'--run'")
    check_output_path(plot_path, "--plot", extensions=PLOT_FORMATS)
    check_output_path(sweep_json_path, "--json")
    if plot_path is not None and matplotlib_version() is None:
        raise Abort(
            EXIT_ENV,
            "--plot needs matplotlib, which is not installed; install it with: "
            "pip install 'kvaddr[plot]' (or leave --plot out for the terminal chart)",
        )
    if from_path is not None:
        doc = _load_run(from_path, run_label)
    else:
        config = profile_command.validated(ProfileConfig(**options, option_order=tuple(option_order)))
        profile_command.check_save_path(config.save_path)
        profile_command.refuse_graph_mode_without_gpu(config, "sweep")
        doc = profile_command.profile_and_report(
            config, stdout_json=False, tables=sweep_json_path != "-", command="sweep"
        )
        err.print(f"kvaddr sweep: profiled in {time.perf_counter() - started:.1f} s")
    doc = dict(doc)
    doc["sweep"] = sweep_json(doc)
    if sweep_json_path == "-":
        click.echo(json.dumps(doc, indent=2))
    else:
        if chart:
            render_chart(out_console(), doc)
        if sweep_json_path is not None:
            write_json(doc, sweep_json_path, "sweep")
    if plot_path is not None:
        try:
            plot_sweep(doc, plot_path)
        except ValueError as exc:
            raise Abort(EXIT_USAGE, str(exc)) from None
        except OSError as exc:
            raise Abort(EXIT_ENV, f"cannot write --plot {plot_path!r}: {exc.strerror or exc}") from exc
        err.print(f"kvaddr sweep: plot written to {plot_path}")


# ----------------------------------------------------------------------------- profiles


PROFILES_HELP = """List the workload profiles (name and description), or show one with where its
numbers come from: `kvaddr profiles NAME`.

Profiles are TOML files (docs/profiles.md) found in $KVADDR_PROFILE_PATH's
folders, then among the profiles kvaddr ships. Use one with
`kvaddr profile --profile NAME` (also sweep, replay, trace generate).

\b
Exit status: 0 ok; 1 a profile on the search path does not load (named on
stderr); 2 an unknown NAME or a malformed profile given by path; 141 stdout
was closed early (| head): kvaddr stops quietly.
"""


def _profiles(name, as_json):
    from kvaddr.measure.profiles import ProfileError, available, load_profile

    err = err_console()
    if name is not None:
        try:
            prof = load_profile(name)
        except ProfileError as exc:
            raise Abort(EXIT_USAGE, str(exc)) from None
        if as_json:
            click.echo(json.dumps(prof.as_dict(), indent=2))
            return
        out = out_console()
        out.print(f"{prof.name} ({prof.path})", style="bold")
        out.print(f"description: {prof.description or '-'}", soft_wrap=True)
        out.print(f"source: {prof.source or '-'}", soft_wrap=True)
        for section, table in prof.tables.items():
            out.print(f"[{section}]", style="bold")
            for key, value in table.items():
                out.print(f"  {key} = {json.dumps(value)}")
        return
    loaded, failed = [], []
    for pname, path in available().items():
        try:
            loaded.append(load_profile(path))
        except ProfileError as exc:
            failed.append((pname, str(exc)))
    if as_json:
        click.echo(
            json.dumps(
                {"profiles": [p.as_dict() for p in loaded], "errors": [{"name": n, "error": e} for n, e in failed]},
                indent=2,
            )
        )
    else:
        from rich.table import Table

        # Name and description only: a source is a paragraph, shown by `kvaddr profiles NAME`.
        table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
        table.add_column("name", no_wrap=True)
        table.add_column("description", overflow="fold")
        for p in loaded:
            table.add_row(p.name, p.description or "-")
        out_console().print(table)
        if loaded:
            err.print("kvaddr profiles: where a profile's numbers come from: kvaddr profiles NAME")
        if not loaded and not failed:
            err.print("kvaddr profiles: no profile found (searched $KVADDR_PROFILE_PATH and kvaddr's own)")
    for _name, msg in failed:
        err.print(f"kvaddr profiles: {msg}")
    if failed:
        raise SystemExit(EXIT_CHECK)


# ----------------------------------------------------------------------------- the commands


@click.group(
    "trace",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "kvaddr trace generate --steps 10000 -o run.jsonl.gz",
        "kvaddr trace generate --help",
    ),
)
def trace_group():
    """Make serving traces (docs/trace-format.md) for `kvaddr replay`."""


@trace_group.command(
    "generate",
    help=GENERATE_HELP,
    epilog=examples(
        "kvaddr trace generate --steps 10000 --seed 0 -o run.jsonl.gz",
        "kvaddr trace generate --profile deepseek-v3.2-mtp --warmup-steps 500 -o mtp.jsonl",
        "kvaddr trace generate --arrival-rate 2 --prompt-len loguniform:128:8192 | kvaddr replay -",
    ),
)
@click.option(
    "--steps",
    type=IntBounds(1, 100_000_000),
    default=1000,
    show_default=True,
    help="Steps to write (engine steps that run at least one token).",
)
@click.option(
    "--warmup-steps",
    type=IntBounds(0, 100_000_000),
    default=0,
    show_default=True,
    help="Steps simulated but not written first, so the trace starts on a busy, fragmented server.",
)
@click.option(
    "--arrival-rate",
    type=FloatBounds(0, 1e6),
    default=0.5,
    show_default=True,
    callback=finite,
    help="Mean new requests per engine step (Poisson).",
)
@click.option(
    "--prompt-len",
    type=DistributionType(),
    default="lognormal:1024:1.0:32768",
    show_default=True,
    help="Prompt length distribution, in tokens.",
)
@click.option(
    "--output-len",
    type=DistributionType(),
    default="lognormal:256:0.8:4096",
    show_default=True,
    help="Output length distribution, in tokens.",
)
@click.option(
    "--max-running",
    type=IntBounds(1, 1 << 20),
    default=256,
    show_default=True,
    help="Most requests running at once (vLLM's max_num_seqs).",
)
@click.option(
    "--max-batched-tokens",
    type=IntBounds(1, 1 << 24),
    default=8192,
    show_default=True,
    help="Token budget per step, shared by decodes and prefill chunks (vLLM's max_num_batched_tokens).",
)
@click.option(
    "--spec-tokens",
    type=IntBounds(0, 64),
    default=0,
    show_default=True,
    help="Speculative (MTP) draft tokens per decode request: each runs 1 + N tokens.",
)
@click.option(
    "--acceptance",
    type=FloatBounds(0, 1),
    default=0.8,
    show_default=True,
    callback=finite,
    help="Probability that each draft token is accepted (in order, until the first rejection).",
)
@click.option(
    "--model",
    type=click.Choice(sorted(PRESETS)),
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset: the default block size and cache count, and the trace header's model.",
)
@click.option(
    "--block-size",
    "block_sizes",
    type=IntList(1, 1 << 20, "block size"),
    default=None,
    help="Tokens per block: one for every cache, or one per cache. [default: the model's, 64]",
)
@click.option(
    "--caches",
    type=IntBounds(1, MAX_CACHES),
    default=None,
    help="Paged caches per layer. [default: the model's, 2]",
)
@click.option(
    "--kv-tokens",
    type=IntBounds(1, 1 << 34),
    default=1 << 19,
    show_default=True,
    help="KV-cache capacity per block table, in tokens (kv-tokens / B blocks).",
)
@click.option(
    "--max-waiting",
    type=IntBounds(0, 1 << 24),
    default=1024,
    show_default=True,
    help="Longest waiting queue; requests arriving beyond it are rejected.",
)
@click.option("--seed", type=IntBounds(0, 2**63 - 1), default=0, show_default=True, help="Seed of the run.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    show_default=True,
    metavar="PATH",
    help="Where to write the trace ('-': stdout; a .gz name compresses).",
)
@profile_option("trace")
@guarded("trace generate")
def generate(**options):
    _generate(**options)


@click.command(
    "replay",
    help=REPLAY_HELP + "\n" + REPLAY_EXIT_CODES_HELP,
    epilog=examples(
        "kvaddr replay run.jsonl.gz",
        "kvaddr replay run.jsonl.gz --mode graph --eager-every 10 --json replay.json",
        "kvaddr trace generate --steps 500 | kvaddr replay - --device cpu",
    ),
)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--model",
    type=click.Choice(sorted(PRESETS)),
    default=None,
    help=f"Model preset (layers). [default: the trace header's, else {DEFAULT_MODEL}]",
)
@click.option("--layers", type=IntBounds(1, 4096), default=None, help="Transformer layers. [default: the model's]")
@click.option(
    "--caches",
    type=IntBounds(1, MAX_CACHES),
    default=None,
    help="Paged caches per layer. [default: the trace header's, else the model's]",
)
@click.option(
    "--block-size",
    "block_sizes",
    type=IntList(1, 1 << 20, "block size"),
    default=None,
    help="Tokens per block, one or one per cache. [default: the trace header's, else the model's]",
)
@mode_option()
@device_option()
@click.option(
    "--check-every",
    type=IntBounds(1, 1 << 30),
    default=1,
    show_default=True,
    metavar="N",
    help="Compare the outputs with the reference on every N-th step.",
)
@click.option(
    "--eager-every",
    type=IntBounds(1, 1 << 30),
    default=1,
    show_default=True,
    metavar="N",
    help="GPU, both modes: run and time eager mode on every N-th step only (graph mode runs every step).",
)
@click.option("--max-steps", type=IntBounds(1, 1 << 40), default=None, metavar="N", help="Stop after N replayed steps.")
@json_option()
@profile_option("profile")
@click.pass_context
@guarded("replay")
def replay(ctx, **options):
    _replay(ctx, **options)


@click.pass_context
@guarded("sweep")
def _sweep_command(ctx, **options):
    _sweep(list(ctx.params), **options)


sweep = click.Command(
    "sweep",
    callback=_sweep_command,
    params=_sweep_params(profile_command.profile),
    help=SWEEP_HELP + "\n" + EXIT_CODES_HELP,
    epilog=examples(
        "kvaddr sweep --plot sweep.png",
        "kvaddr sweep --batch 1,16,256 --mode graph --budget 1 --json sweep.json",
        "kvaddr sweep --from base.json --run glm-5 --plot sweep.svg",
    ),
    context_settings=CONTEXT_SETTINGS,
)


@click.command(
    "profiles",
    help=PROFILES_HELP,
    epilog=examples("kvaddr profiles", "kvaddr profiles deepseek-v3.2-mtp", "kvaddr profiles --json"),
)
@click.argument("name", required=False, metavar="[NAME|PATH]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@guarded("profiles")
def profiles(**options):
    _profiles(**options)
