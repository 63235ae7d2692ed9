"""``kvaddr compare BASE NEW`` and ``kvaddr check --baseline FILE``: the regression gate.

Both print one verdict per run, batch size, strategy, mode and clock (a table
on stdout, or one JSON document with ``--json -``), the environment check and
the slower verdicts on stderr, and exit 0 (nothing slower), 1 (something
slower), 2 (usage: a bad option or baseline file) or 3 (the GPU, driver or
workload does not match). The rule is :func:`kvaddr.gate.comparison.decide`.
"""

from __future__ import annotations

import datetime as _dt
import json

import click

from kvaddr.commands.common import (
    EXIT_ENV,
    EXIT_PIPE_HELP,
    EXIT_USAGE,
    Abort,
    FloatBounds,
    check_output_path,
    err_console,
    examples,
    finite,
    guarded,
    out_console,
    write_json,
)
from kvaddr.commands.profile import ConsoleProgress
from kvaddr.errors import ProfileConfigError
from kvaddr.gate.comparison import DEFAULT_ALPHA, DEFAULT_FACTOR, RULE, fmt_p
from kvaddr.measure.profile_run import RECORDED_ONLY, ProfileConfig

EXIT_SLOWER = 1
COMPARISON_KIND = "kvaddr.comparison"
COMPARISON_SCHEMA = 1
#: Recorded profile options a replay never takes over: outputs; the device (it comes from the run's environment);
#: the workload profile (``--profile``: its values are recorded as the options they set, and its path may not
#: exist on this machine).
NOT_REPLAYED = (*RECORDED_ONLY, "device")

EXIT_HELP = f"""\b
Exit status:
    0  nothing gated is slower (faster, same and ambiguous all pass)
    1  something gated is slower (each named on stderr: run, batch size,
       strategy, mode, clock); check: also a failed correctness check
    2  usage error: a bad option value, a missing or invalid baseline
       file, an output PATH (--json, --save) that cannot be written
    3  the baseline's GPU, driver or workload does not match the new run
       (the GPU and driver may differ with --relative; any mismatch
       passes with --allow-env-mismatch), or an output file whose write
       fails at the end (a full disk)
{EXIT_PIPE_HELP}
"""

RULE_HELP = """Per run, batch size, strategy, mode (eager, graph) and clock (host,
GPU): ratio = median(new) / median(base), p = the two-sided Mann-Whitney U
p-value of the two sample sets, [lo, hi] = the ratio's interval from each
median's distribution-free (1 - alpha) interval.

\b
  slower     ratio > factor and p < alpha
  faster     ratio < 1/factor and p < alpha
  ambiguous  ratio beyond the factor but p >= alpha, or ratio within
             the factor but [lo, hi] is not (too noisy to tell)
  same       ratio and [lo, hi] within [1/factor, factor]

--relative compares ratios that carry across GPUs instead of times: every
strategy / floor and every strategy / per-layer, sample i of one over
sample i of the other (same run, mode and clock). Only the workload must
then match, not the GPU or driver.

--gate picks the measures whose slower verdict fails the command; the
default, auto, is graph mode's GPU clock, and nothing for a run without
graph mode (the CPU path, --mode eager: eager timings move with the Python
host between runs; --gate eager:host or all gates them). The floor (an
empty launch) is reported, never gated, except in its ratios."""

COMPARE_HELP = f"""Compare the timing samples of two profile runs: BASE and NEW are baseline files
(`kvaddr profile --save`) or `kvaddr profile --json` reports.

{RULE_HELP}

{EXIT_HELP}"""

CHECK_HELP = f"""Profile this machine with a baseline's workload and options, then compare with it.

Each run of the baseline is replayed: `kvaddr profile` with the options
recorded in it (the device it ran on; --budget may be changed), checked
against the reference as always; then every verdict is printed as by
`kvaddr compare`. The baseline's GPU, driver and workload must match this
machine (see --relative and --allow-env-mismatch).

{RULE_HELP}

{EXIT_HELP}"""


# ----------------------------------------------------------------------------- options


def _compare_options(fn):
    decorators = [
        click.option(
            "--factor",
            type=FloatBounds(1, min_open=True),
            default=DEFAULT_FACTOR,
            show_default=True,
            callback=finite,
            help="Smallest median ratio that counts as slower (its inverse: faster).",
        ),
        click.option(
            "--alpha",
            type=FloatBounds(0, 1, min_open=True, max_open=True),
            default=DEFAULT_ALPHA,
            show_default=True,
            callback=finite,
            help="Significance level of the Mann-Whitney test (and 1 - confidence of the intervals).",
        ),
        click.option(
            "--relative",
            is_flag=True,
            help="Compare strategy / floor and strategy / per-layer ratios (machine independent): the GPU "
            "and driver may differ, the workload may not.",
        ),
        click.option(
            "--gate",
            "gate_text",
            default="auto",
            show_default=True,
            metavar="auto|all|MODE:CLOCK,...",
            help="Measures whose slower verdict fails the command: auto (graph:gpu when measured, else "
            "nothing), all, or a list of graph:gpu, eager:host, eager:gpu.",
        ),
        click.option(
            "--allow-env-mismatch",
            is_flag=True,
            help="Compare even when the GPU, driver or workload differ (reported on stderr).",
        ),
        click.option(
            "--json",
            "json_path",
            type=click.Path(dir_okay=False, allow_dash=True),
            default=None,
            metavar="PATH",
            help="Write the verdicts as one JSON document to PATH ('-': stdout, and nothing else there).",
        ),
    ]
    for d in reversed(decorators):
        fn = d(fn)
    return fn


def _gate(text: str):
    from kvaddr.gate.comparison import parse_gate

    try:
        return parse_gate(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--gate'") from None


def _check_json_path(json_path):
    check_output_path(json_path, "--json")


def _load(path: str):
    from kvaddr.gate.baseline_file import load

    return load(path)  # BaselineError: exit 2


# ----------------------------------------------------------------------------- output


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.0f}"


def _measure_label(mode: str, clock: str) -> str:
    return f"{mode}: {'GPU' if clock == 'gpu' else clock}"


def render_table(console, outcome, base_name: str, new_name: str, factor: float, alpha: float, relative: bool) -> None:
    """Every verdict, one section per run and batch size."""
    from rich.table import Table

    what = "ratios (median of sample-wise ratios)" if relative else "us per step (median)"
    console.print(
        f"{base_name} -> {new_name}: {what}; factor {factor:g}, alpha {alpha:g}", style="italic", soft_wrap=True
    )
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    headers = [
        "strategy" if not relative else "ratio of",
        "measure",
        "base",
        "new",
        "new/base",
        "p",
        "verdict",
        "gated",
    ]
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i in (0, 1, 6) else "right", overflow="fold")
    section = None
    for r in outcome.rows:
        if (r.run, r.batch) != section:
            section = (r.run, r.batch)
            table.add_row(f"{r.run}, batch {r.batch}", style="bold")
        d = r.decision
        cells = [r.quantity, _measure_label(r.mode, r.clock)]
        if d is None:
            cells += ["-", "-", "-", "-"]
        else:
            cells += [
                _fmt(d.base_median),
                _fmt(d.new_median),
                "-" if d.ratio != d.ratio else f"x{d.ratio:.3f}",
                fmt_p(d.p),
            ]
        cells += [r.verdict, "yes" if r.gated else "no"]
        table.add_row(*cells, style="bold" if (r.gated and r.verdict == "slower") else None)
    console.print(table)
    console.print(
        f"new/base = ratio of the medians; p = two-sided Mann-Whitney U. slower / faster: beyond "
        f"x{factor:g} (or 1/{factor:g}) with p < {alpha:g}; ambiguous: beyond it but not significant, or "
        f"too noisy to exclude it; gated: a slower verdict here fails the command.",
        soft_wrap=True,
    )


def _side(bl) -> dict:
    from kvaddr.gate.baseline_file import machine_summary

    return {
        "path": bl.path,
        "kind": bl.kind,
        "runs": [
            {
                "label": label,
                "created_utc": run.get("created_utc"),
                "machine": machine_summary(run["environment"]),
                "kvaddr": run["environment"].get("kvaddr"),
                "git_commit": run["environment"].get("git_commit"),
            }
            for label, run in zip(bl.labels, bl.runs)
        ],
    }


def comparison_document(
    command: str, outcome, base, new, *, factor, alpha, relative, gate_text, allow_env_mismatch
) -> dict:
    """The ``--json`` document (docs/baseline-format.md, "The comparison document")."""
    from kvaddr.gate.comparison import gated_measures, parse_gate

    gate = parse_gate(gate_text)
    status = "match" if not outcome.mismatches else ("mismatch" if outcome.stopped else "mismatch allowed")
    return {
        "schema_version": COMPARISON_SCHEMA,
        "kind": COMPARISON_KIND,
        "command": command,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "base": _side(base),
        "new": _side(new) if new is not None else None,
        "settings": {
            "factor": factor,
            "alpha": alpha,
            "relative": relative,
            "gate": gate_text,
            "gated_measures": {
                label: sorted(":".join(m) for m in gated_measures(gate, run))
                for label, run in zip(base.labels, base.runs)
            },
            "gate_notes": list(getattr(outcome, "gate_notes", ())),
            "allow_env_mismatch": allow_env_mismatch,
            "rule": RULE,
            "ratio_samples": (
                "sample i of the strategy over sample i of the floor (or per-layer), same run, mode "
                "and clock, for i < the smaller sample count"
            )
            if relative
            else None,
        },
        "environment_check": {
            "status": status,
            "mismatches": [{"run": label, **d.as_dict()} for label, d in outcome.mismatches],
            "notes": [{"run": label, **d.as_dict()} for label, d in outcome.notes],
            "unmatched_new_runs": outcome.unmatched_new,
        },
        "results": [{**r.as_dict(), "line": r.sentence()} for r in outcome.rows],
        "counts": {"gated": outcome.counts(True), "all": outcome.counts(False)},
        "slower": [r.sentence() for r in outcome.slower],
        "exit_code": outcome.exit_code,
    }


def finish(
    command: str,
    outcome,
    base,
    new,
    new_name: str,
    *,
    factor,
    alpha,
    relative,
    gate_text,
    allow_env_mismatch,
    json_path,
) -> None:
    """Print the environment check, the verdicts and the summary; exit with the outcome's status."""
    err = err_console()
    name = f"kvaddr {command}"
    for label, d in outcome.notes:
        err.print(f"{name}: note ({label}): {d.describe()}")
    for line in getattr(outcome, "gate_notes", ()):  # issue 12: --gate auto on the CPU path gates nothing
        err.print(f"{name}: note: {line}")
    for label in outcome.unmatched_new:
        err.print(f"{name}: note: the new run {label!r} has no baseline run with its workload; not compared")
    for label, d in outcome.mismatches:
        err.print(f"{name}: {'MISMATCH' if outcome.stopped else 'mismatch (allowed)'} ({label}): {d.describe()}")
    if outcome.stopped:
        hint = " (the GPU and driver may differ with --relative)" if not relative else ""
        err.print(
            f"{name}: the baseline's environment or workload does not match the new run{hint}; "
            f"nothing compared (--allow-env-mismatch compares anyway)"
        )
    doc = None
    if json_path is not None:
        doc = comparison_document(
            command,
            outcome,
            base,
            new,
            factor=factor,
            alpha=alpha,
            relative=relative,
            gate_text=gate_text,
            allow_env_mismatch=allow_env_mismatch,
        )
    if json_path == "-":
        click.echo(json.dumps(doc, indent=2))
    else:
        if outcome.rows:
            render_table(out_console(), outcome, base.path, new_name, factor, alpha, relative)
        if json_path is not None:
            write_json(doc, json_path, name.split()[-1])
    if not outcome.stopped:
        gated, everything = outcome.counts(True), outcome.counts(False)
        parts = ", ".join(
            f"{gated[v]} {v}"
            for v in ("slower", "faster", "same", "ambiguous", "missing")
            if gated[v] or v in ("slower", "same")
        )
        extra = sum(everything.values()) - sum(gated.values())
        err.print(
            f"{name}: {parts} of {sum(gated.values())} gated verdicts"
            + (f" ({extra} more reported, not gated)" if extra else "")
        )
        for r in outcome.slower:
            err.print(f"{name}: SLOWER: {r.sentence()}")
        missing = [r for r in outcome.rows if r.gated and r.verdict == "missing"]
        for r in missing:
            err.print(f"{name}: warning: {r.sentence()}")
    code = outcome.exit_code
    if code:
        raise SystemExit(code)


# ----------------------------------------------------------------------------- compare


@click.command(
    "compare",
    help=COMPARE_HELP,
    epilog=examples(
        "kvaddr compare base.json new.json",
        "kvaddr compare base.json new.json --relative --gate all --json -",
    ),
)
@click.argument("base_path", metavar="BASE")
@click.argument("new_path", metavar="NEW")
@_compare_options
@guarded("compare")
def compare(base_path, new_path, factor, alpha, relative, gate_text, allow_env_mismatch, json_path):
    from kvaddr.gate.comparison import compare_baselines

    gate = _gate(gate_text)
    _check_json_path(json_path)
    base, new = _load(base_path), _load(new_path)
    outcome = compare_baselines(
        base, new, factor=factor, alpha=alpha, relative=relative, gate=gate, allow_env_mismatch=allow_env_mismatch
    )
    finish(
        "compare",
        outcome,
        base,
        new,
        new_path,
        factor=factor,
        alpha=alpha,
        relative=relative,
        gate_text=gate_text,
        allow_env_mismatch=allow_env_mismatch,
        json_path=json_path,
    )


# ----------------------------------------------------------------------------- check


def profile_command_line(config: ProfileConfig, budget_given: bool) -> str:
    """The ``kvaddr profile`` command line that repeats ``config`` (what ``check`` says it runs)."""
    from kvaddr.commands.profile import flag

    words = []
    for name, value in config.recorded_options().items():
        if name in NOT_REPLAYED or value is None or (name == "budget" and budget_given):
            continue
        if name in ("context", "prefill"):
            text = f"{value[0]}:{value[1]}"
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        else:
            text = repr(value) if isinstance(value, float) else str(value)
        words += [flag(name), text]
    words += ["--device", config.device]
    if budget_given:
        words += ["--budget", repr(float(config.budget))]
    return " ".join(words)


def replay_config(run: dict, budget: float | None) -> ProfileConfig:
    """The profile config that repeats a baseline run.

    Every recorded option (``options``: the values the run used, whether given
    on its command line, taken from a ``--profile`` file or defaulted) is taken
    over, except :data:`NOT_REPLAYED` and null values, so the replay does not
    depend on a profile file or on defaults that may have changed. The device
    is the one the run used; ``budget`` replaces the run's when given.
    """
    options = {k: v for k, v in (run.get("options") or {}).items() if k not in NOT_REPLAYED}
    overrides = {"device": run["environment"].get("device", "auto")}
    if budget is not None:
        overrides["budget"] = budget
    try:
        return ProfileConfig.from_recorded(options, **overrides)
    except ProfileConfigError as exc:
        from kvaddr.commands.profile import option_hint

        hint = option_hint(exc.fields)
        raise Abort(
            EXIT_USAGE,
            f"the baseline's options do not replay on this kvaddr: invalid value for {hint}: {exc}",
        ) from None


def _machine_precheck(base, relative: bool, allow: bool) -> list:
    """Mismatches between the baseline runs' machine and this one, before any profiling."""
    from kvaddr.gate.baseline_file import environment_differences
    from kvaddr.measure.environment import environment_record, probe_cuda

    out = []
    current = {}
    for label, run in zip(base.labels, base.runs):
        device = run["environment"].get("device")
        if device == "cuda":
            probe = probe_cuda()
            if not probe.available:
                raise Abort(
                    EXIT_ENV,
                    f"the baseline ({label}) was measured on a GPU; this machine has no usable "
                    f"CUDA device: {probe.reason}",
                )
        if device not in current:
            current[device] = environment_record(device, 0 if device == "cuda" else None)
        mismatches, _ = environment_differences(run["environment"], current[device], relative)
        out.extend((label, d) for d in mismatches)
    return out


@click.command(
    "check",
    help=CHECK_HELP,
    epilog=examples(
        "kvaddr check --baseline profiles/baselines/h200.json",
        "kvaddr check --baseline base.json --budget 0.5 --save new.json --json verdicts.json",
    ),
)
@click.option(
    "--baseline",
    "baseline_path",
    required=True,
    metavar="PATH",
    help="A baseline file (kvaddr profile --save) or a kvaddr profile --json report.",
)
@click.option(
    "--budget",
    type=FloatBounds(0, 600),
    default=None,
    metavar="SECONDS",
    callback=finite,
    help="Sampling time per strategy and mode. [default: the baseline's]",
)
@click.option(
    "--save",
    "save_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="Also save the new runs as a baseline to PATH (as kvaddr profile --save does).",
)
@_compare_options
@guarded("check")
def check(baseline_path, budget, save_path, factor, alpha, relative, gate_text, allow_env_mismatch, json_path):
    from kvaddr.gate.baseline_file import Baseline, run_labels, save_runs
    from kvaddr.gate.comparison import Outcome, compare_baselines

    gate = _gate(gate_text)
    _check_json_path(json_path)
    check_output_path(save_path, "--save", regular=True)
    base = _load(baseline_path)
    err = err_console()
    finish_kw = dict(
        factor=factor,
        alpha=alpha,
        relative=relative,
        gate_text=gate_text,
        allow_env_mismatch=allow_env_mismatch,
        json_path=json_path,
    )
    mismatches = _machine_precheck(base, relative, allow_env_mismatch)
    if mismatches and not allow_env_mismatch:
        finish("check", Outcome([], mismatches, [], [], True), base, None, "this machine", **finish_kw)
        return
    from kvaddr.measure.profile_run import run as run_profile

    new_runs = []
    for i, (label, run) in enumerate(zip(base.labels, base.runs)):
        unknown = [n for n in ProfileConfig.unknown_options(run.get("options")) if n not in NOT_REPLAYED]
        if unknown:
            err.print(
                f"kvaddr check: run {label!r} records options this kvaddr does not have, not replayed: "
                f"{', '.join(unknown)}"
            )
        config = replay_config(run, budget)
        err.print(
            f"kvaddr check: run {i + 1}/{len(base.runs)} ({label}): kvaddr profile "
            f"{profile_command_line(config, budget is not None)}"
        )
        new_runs.append(run_profile(config, ConsoleProgress(err, show_bar=err.is_terminal)))
        err.print(f"kvaddr profile: done in {new_runs[-1]['wall_s']:.1f} s")
    new = Baseline("this machine", "kvaddr.baseline", new_runs, run_labels(new_runs))
    if save_path is not None:
        for action in save_runs(save_path, new_runs):
            err.print(f"kvaddr check: {save_path}: {action}")
    outcome = compare_baselines(
        base, new, factor=factor, alpha=alpha, relative=relative, gate=gate, allow_env_mismatch=allow_env_mismatch
    )
    finish("check", outcome, base, new, "this machine", **finish_kw)
