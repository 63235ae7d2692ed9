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
import os

import click

from kvaddr.commands.common import (
    EXIT_CHECK,
    EXIT_ENV,
    EXIT_PIPE_HELP,
    EXIT_USAGE,
    Abort,
    FloatBounds,
    IntBounds,
    check_output_path,
    err_console,
    examples,
    finite,
    guarded,
    load_report,
    out_console,
    write_json,
)
from kvaddr.commands.profile import ConsoleProgress
from kvaddr.errors import ProfileConfigError
from kvaddr.gate.ab import DEFAULT_BUDGET as DEFAULT_AGAINST_BUDGET
from kvaddr.gate.ab import DEFAULT_ROUNDS
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
       file, an output PATH (--json, --save) that cannot be written;
       --against: not in a git repository, no such revision, no kvaddr
       in it, or its profile cannot run the asked options
    3  the baseline's GPU, driver or workload does not match the new run
       (the GPU and driver may differ with --relative; any mismatch
       passes with --allow-env-mismatch), or an output file whose write
       fails at the end (a full disk)
{EXIT_PIPE_HELP}
"""

CHECK_EXIT_HELP = EXIT_HELP.replace(
    EXIT_PIPE_HELP,
    "  130  interrupted (Ctrl-C); --against's temporary tree is removed\n" + EXIT_PIPE_HELP,
)

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

CHECK_HELP = f"""Time this kvaddr against a stored baseline (--baseline) or against a git
revision built and timed side by side on this machine (--against).

--baseline PATH: each run of the baseline is replayed: `kvaddr profile`
with the options recorded in it (the device it ran on; --budget may be
changed), checked against the reference as always; then every verdict is
printed as by `kvaddr compare`. The baseline's GPU, driver and workload must
match this machine (see --relative and --allow-env-mismatch).

--against REV: REV's tree is written to a temporary folder (git archive; the
checkout is not touched, and the folder is removed afterwards, also on
Ctrl-C), then REV's `kvaddr profile` and this kvaddr's run the same workload
(the kvaddr profile options below, or --baseline's runs) round by round,
interleaved (REV, this, REV, this, ...), each in a process of its own. Each
side's samples are pooled over the --rounds and compared by the rule below,
REV as the base; the table adds each side's spread between rounds (max / min
of its per-round medians: noise of the machine, which belongs to neither
side), and stderr says how long the A/B took. REV runs as its own command
line, so versions whose Python APIs differ compare; a REV that does not
exist, has no kvaddr package, or whose profile lacks an asked option exits 2
before any timing. Two machines of one GPU model can differ by more than
the factor on some workloads; --against times both trees on one machine
(docs/ci-gate.md says when to use which).

{RULE_HELP}

{CHECK_EXIT_HELP}"""


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
    return load_report(path)  # BaselineError: exit 2


# ----------------------------------------------------------------------------- output


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.0f}"


def _measure_label(mode: str, clock: str) -> str:
    return f"{mode}: {'GPU' if clock == 'gpu' else clock}"


def _spread_text(x) -> str:
    return "-" if x is None or x != x else f"x{x:.3f}"


def render_table(
    console,
    outcome,
    base_name: str,
    new_name: str,
    factor: float,
    alpha: float,
    relative: bool,
    spreads: dict | None = None,
) -> None:
    """Every verdict, one section per run and batch size; with ``spreads`` (``check --against``) also each
    side's spread between rounds (max / min of its per-round medians)."""
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
    if spreads is not None:
        headers += ["base rounds", "new rounds"]
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
        if spreads is not None:
            sp = spreads.get(row_key(r))
            cells += [_spread_text(sp.base), _spread_text(sp.new)] if sp is not None else ["-", "-"]
        table.add_row(*cells, style="bold" if (r.gated and r.verdict == "slower") else None)
    console.print(table)
    console.print(
        f"new/base = ratio of the medians; p = two-sided Mann-Whitney U. slower / faster: beyond "
        f"x{factor:g} (or 1/{factor:g}) with p < {alpha:g}; ambiguous: beyond it but not significant, or "
        f"too noisy to exclude it; gated: a slower verdict here fails the command."
        + (
            " base / new rounds: max / min of that side's per-round medians (noise between processes, "
            "which belongs to neither side)."
            if spreads is not None
            else ""
        ),
        soft_wrap=True,
    )


def row_key(row) -> tuple:
    """A verdict row's measurement, as :func:`kvaddr.gate.ab.round_spreads` keys it."""
    return (row.run, row.batch, row.strategy, row.relative_to, row.mode, row.clock)


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
    command: str,
    outcome,
    base,
    new,
    *,
    factor,
    alpha,
    relative,
    gate_text,
    allow_env_mismatch,
    spreads: dict | None = None,
    against: dict | None = None,
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
        "results": [
            {
                **r.as_dict(),
                "line": r.sentence(),
                **({"round_spread": _spread_doc(spreads, r)} if spreads is not None else {}),
            }
            for r in outcome.rows
        ],
        "counts": {"gated": outcome.counts(True), "all": outcome.counts(False)},
        "slower": [r.sentence() for r in outcome.slower],
        "exit_code": outcome.exit_code,
        **({"against": against} if against is not None else {}),
    }


def _spread_doc(spreads: dict, row):
    sp = spreads.get(row_key(row))
    return sp.as_dict() if sp is not None else None


def finish(
    command: str,
    outcome,
    base,
    new,
    new_name: str,
    *,
    json_path,
    spreads: dict | None = None,
    against: dict | None = None,
    **settings,
) -> None:
    """Print the environment check, the verdicts and the summary; exit with the outcome's status.

    ``settings``: the comparison's ``factor``, ``alpha``, ``relative``, ``gate_text`` and
    ``allow_env_mismatch`` (as :func:`comparison_document` takes them). ``spreads`` and ``against``
    (``check --against``): each measurement's spread between rounds (a table column, a JSON field), and the
    A/B run's description (the JSON document's ``against``; its wall time is printed)."""
    factor, alpha, relative = settings["factor"], settings["alpha"], settings["relative"]
    err = err_console()
    name = f"kvaddr {command}"
    for label, d in outcome.notes:
        err.print(f"{name}: note ({label}): {d.describe()}")
    for line in getattr(outcome, "gate_notes", ()):  # --gate auto on the CPU path gates nothing
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
        doc = comparison_document(command, outcome, base, new, spreads=spreads, against=against, **settings)
    if json_path == "-":
        click.echo(json.dumps(doc, indent=2))
    else:
        if outcome.rows:
            render_table(out_console(), outcome, base.path, new_name, factor, alpha, relative, spreads)
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
        for r in outcome.rows:
            sp = (spreads or {}).get(row_key(r))
            if r.gated and sp is not None and max(sp.base, sp.new) > factor:
                err.print(
                    f"{name}: note: {r.shape()}: {r.quantity}, {r.mode} mode: the rounds of one side spread by "
                    f"more than the factor (base x{sp.base:.3f}, new x{sp.new:.3f}): this machine's noise between "
                    f"processes; more --rounds or a quieter machine make the verdict firmer"
                )
    if against is not None:
        err.print(
            f"{name}: the A/B run took {against['wall_s']:.1f} s wall ({against['rounds']} round(s) x 2 sides x "
            f"{against['workloads']} workload(s), {against['budget_s']:g} s per strategy and mode each)"
        )
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


def option_words(name: str, value) -> list:
    """``kvaddr profile``'s words for setting ``name`` = ``value``: ``[flag, text]``, or none for a null value
    or an empty list (the option's default: ``--attention`` none)."""
    from kvaddr.commands.profile import flag

    if value is None or (isinstance(value, (list, tuple)) and not value):
        return []
    if name in ("context", "prefill"):
        text = f"{value[0]}:{value[1]}"
    elif isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    else:
        text = repr(value) if isinstance(value, float) else str(value)
    return [flag(name), text]


def profile_words(config: ProfileConfig, budget_given: bool) -> list:
    """The ``(flag, text)`` pairs of the ``kvaddr profile`` command line that repeats ``config``: every
    recorded setting but :data:`NOT_REPLAYED` and null or empty ones, then ``--device`` (and ``--budget`` when
    ``budget_given``)."""
    words = []
    for name, value in config.recorded_options().items():
        if name in NOT_REPLAYED or (name == "budget" and budget_given):
            continue
        w = option_words(name, value)
        if w:
            words.append(tuple(w))
    words.append(("--device", config.device))
    if budget_given:
        words.append(("--budget", repr(float(config.budget))))
    return words


def profile_command_line(config: ProfileConfig, budget_given: bool) -> str:
    """The ``kvaddr profile`` arguments that repeat ``config`` (what ``check`` says it runs), quoted for a
    shell: pasted after ``kvaddr profile`` they parse."""
    import shlex

    return shlex.join(w for pair in profile_words(config, budget_given) for w in pair)


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


def no_gpu_message(label: str, reason: str, allow: bool) -> str:
    """Why a GPU baseline cannot be checked on this machine, and why ``--allow-env-mismatch`` cannot help."""
    why = "does not help" if not allow else "cannot help"
    return (
        f"the baseline ({label}) was measured on a GPU; this machine has no usable CUDA device: {reason}. "
        f"--allow-env-mismatch {why} here: it compares runs whose GPU, driver or workload differ, but a GPU "
        f"baseline's runs replay on a GPU (graph mode, GPU clock) and a CPU-only machine cannot time them. "
        f"Check on a GPU machine, or record a CPU baseline (kvaddr profile --device cpu --save PATH) to check "
        f"against here"
    )


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
                raise Abort(EXIT_ENV, no_gpu_message(label, probe.reason, allow))
        if device not in current:
            current[device] = environment_record(device, 0 if device == "cuda" else None)
        mismatches, _ = environment_differences(run["environment"], current[device], relative)
        out.extend((label, d) for d in mismatches)
    return out


#: ``kvaddr profile`` options ``check --against`` takes for its workload (without --baseline): the core
#: engine's settings but the engine, the timing and the outputs (a vLLM engine report is no baseline for the
#: gate; --budget is check's own).
AGAINST_OPTIONS = tuple(
    n for n in ProfileConfig.settings_of("core") if n not in ("engine", "budget", "step_ms", "json_path", "save_path")
)


@click.command(
    "check",
    help=CHECK_HELP,
    epilog=examples(
        "kvaddr check --baseline profiles/baselines/h200.json",
        "kvaddr check --against origin/main --profile mixed-chunked-prefill --batch 64",
        "kvaddr check --baseline base.json --against HEAD~1 --rounds 7 --json verdicts.json",
    ),
)
@click.option(
    "--baseline",
    "baseline_path",
    default=None,
    metavar="PATH",
    help="A baseline file (kvaddr profile --save) or a kvaddr profile --json report. With --against: only its "
    "workloads are used (each run's recorded options), not its samples.",
)
@click.option(
    "--against",
    "against",
    default=None,
    metavar="REV",
    help="Time the git revision REV (a commit, tag, origin/main, HEAD~1) and this kvaddr side by side, "
    "interleaved, on this machine, and compare them (REV is the base). The workload: --baseline's runs, "
    "else the kvaddr profile options below.",
)
@click.option(
    "--rounds",
    type=IntBounds(1, 100),
    default=None,
    help=f"With --against: rounds; each runs REV's, then this kvaddr's profile, each in a process of its own. "
    f"[default: {DEFAULT_ROUNDS}]",
)
@click.option(
    "--budget",
    type=FloatBounds(0, 600),
    default=None,
    metavar="SECONDS",
    callback=finite,
    help=f"Sampling time per strategy and mode (with --against: per round and side). [default: the "
    f"baseline's; with --against {DEFAULT_AGAINST_BUDGET:g}]",
)
@click.option(
    "--save",
    "save_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="Also save the new runs as a baseline to PATH (as kvaddr profile --save does); not with --against.",
)
@_compare_options
@click.pass_context
@guarded("check")
def check(
    ctx,
    baseline_path,
    against,
    rounds,
    budget,
    save_path,
    factor,
    alpha,
    relative,
    gate_text,
    allow_env_mismatch,
    json_path,
    **workload,
):
    from click.core import ParameterSource

    gate = _gate(gate_text)
    given = [
        n
        for n in AGAINST_OPTIONS
        if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    finish_kw = dict(
        factor=factor,
        alpha=alpha,
        relative=relative,
        gate_text=gate_text,
        allow_env_mismatch=allow_env_mismatch,
        json_path=json_path,
    )
    if against is None:
        if rounds is not None:
            raise click.BadParameter("--rounds applies to --against", param_hint="'--rounds'")
        if baseline_path is None:
            raise click.UsageError(
                "give --baseline PATH (check against a stored baseline), --against REV (time a git revision "
                "side by side with this kvaddr), or both"
            )
    if baseline_path is not None and given:
        from kvaddr.commands.profile import option_hint

        raise click.BadParameter(
            "the workload comes from --baseline's runs; kvaddr profile's workload options apply to --against "
            "without --baseline",
            param_hint=option_hint(given),
        )
    _check_json_path(json_path)
    if against is not None:
        if save_path is not None:
            raise click.BadParameter(
                "applies to checks against a stored baseline; with --against, --json keeps both sides' verdicts",
                param_hint="'--save'",
            )
        check_against(ctx, against, rounds, budget, baseline_path, workload, given, gate, finish_kw)
        return
    check_baseline(baseline_path, budget, save_path, gate, finish_kw)


def check_baseline(baseline_path: str, budget, save_path, gate, finish_kw: dict) -> None:
    """``kvaddr check --baseline PATH``: replay the baseline's runs in this process and compare."""
    from kvaddr.gate.baseline_file import Baseline, run_labels, save_runs
    from kvaddr.gate.comparison import Outcome
    from kvaddr.measure.profile_run import run as run_profile

    check_output_path(save_path, "--save", regular=True)
    base = _load(baseline_path)
    err = err_console()
    relative, allow_env_mismatch = finish_kw["relative"], finish_kw["allow_env_mismatch"]
    mismatches = _machine_precheck(base, relative, allow_env_mismatch)
    if mismatches and not allow_env_mismatch:
        finish("check", Outcome([], mismatches, [], [], True), base, None, "this machine", **finish_kw)
        return
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
    outcome = _compare(base, new, gate, finish_kw)
    finish("check", outcome, base, new, "this machine", **finish_kw)


def _compare(base, new, gate, finish_kw: dict):
    """:func:`~kvaddr.gate.comparison.compare_baselines` with ``check``'s settings."""
    from kvaddr.gate.comparison import compare_baselines

    return compare_baselines(
        base,
        new,
        factor=finish_kw["factor"],
        alpha=finish_kw["alpha"],
        relative=finish_kw["relative"],
        gate=gate,
        allow_env_mismatch=finish_kw["allow_env_mismatch"],
    )


# ----------------------------------------------------------------------------- check --against


def _profile_reference(path: str) -> str:
    """``--profile``'s value for both sides: the name of a shipped profile (each tree reads its own copy),
    else the file's absolute path (the processes run in another folder)."""
    from kvaddr.measure.profiles import available

    for name, known in available().items():
        if os.path.realpath(known) == os.path.realpath(path):
            return name
    return os.path.abspath(path)


def _defaulted_flags(config: ProfileConfig) -> frozenset:
    """The flags of ``config``'s settings that hold ``kvaddr profile``'s default: a revision without such an
    option runs the same without it."""
    from kvaddr.commands.profile import flag

    default = ProfileConfig(engine=config.engine)
    return frozenset(
        flag(n)
        for n in ProfileConfig.settings_of(config.engine)
        if n not in NOT_REPLAYED and getattr(config, n) == getattr(default, n)
    )


def against_workloads(ctx, baseline_path, workload: dict, given: list, budget: float) -> list:
    """``(name, words, droppable flags, device)`` of each workload ``check --against`` times: the
    baseline's runs, or the one ``kvaddr profile`` options describe (checked here first, exit 2)."""
    from kvaddr.commands.profile import validated

    if baseline_path is not None:
        base = _load(baseline_path)
        out = []
        for label, run in zip(base.labels, base.runs):
            config = replay_config(run, budget)
            out.append((label, profile_words(config, True), _defaulted_flags(config), config.device))
        return out
    settings = {k: v for k, v in workload.items() if k in AGAINST_OPTIONS}
    config = validated(ProfileConfig(**settings, budget=budget))
    words = []
    for name in given:
        if name == "workload_profile":
            words.append(("--profile", _profile_reference(workload[name])))
        elif name != "device":
            pair = option_words(name, getattr(config, name))
            if pair:
                words.append(tuple(pair))
            elif name == "attention":
                words.append(("--attention", ""))
    words += [("--device", config.device), ("--budget", repr(float(budget)))]
    name = (
        os.path.splitext(os.path.basename(workload["workload_profile"]))[0]
        if workload.get("workload_profile")
        else config.model
    )
    return [(name, words, frozenset(), config.device)]


def check_against(ctx, against: str, rounds, budget, baseline_path, workload: dict, given: list, gate, finish_kw):
    """``kvaddr check --against REV``: time REV and this kvaddr side by side, interleaved, and compare."""
    import shlex

    from kvaddr.errors import SideFailed
    from kvaddr.gate import ab
    from kvaddr.gate.baseline_file import Baseline, run_labels
    from kvaddr.measure.environment import probe_cuda

    err = err_console()
    rounds = rounds if rounds is not None else DEFAULT_ROUNDS
    budget = budget if budget is not None else DEFAULT_AGAINST_BUDGET
    workloads = against_workloads(ctx, baseline_path, workload, given, budget)
    if any(device == "cuda" for *_, device in workloads):
        probe = probe_cuda()
        if not probe.available:
            raise Abort(EXIT_ENV, f"--device cuda (or a GPU baseline's run) needs a CUDA device: {probe.reason}")
    with ab.materialised(against) as revision:
        base_side = ab.Side("base", revision.label, revision.tree)
        new_side = ab.Side("new", "this tree", ab.current_import_root())
        base_flags = ab.probe(base_side, revision.workdir)
        new_flags = ab.probe(new_side, revision.workdir)
        plan = [
            (name, ab.side_args(base_side, base_flags, words, drop), ab.side_args(new_side, new_flags, words, drop))
            for name, words, drop, _ in workloads
        ]
        for name, base_args, new_args in plan:
            same = base_args == new_args
            err.print(
                f"kvaddr check: {name}: {rounds} round(s), each `kvaddr profile {shlex.join(base_args)}` of "
                f"{revision.label}"
                + (" then" if same else f", then `kvaddr profile {shlex.join(new_args)}` of")
                + f" this tree ({new_side.import_root}), each in a process of its own"
            )
        try:
            result = ab.run_ab(
                base_side, new_side, plan, rounds, revision.workdir, lambda line: err.print(f"kvaddr check: {line}")
            )
        except SideFailed as exc:
            code = exc.status if exc.status in (EXIT_USAGE, EXIT_ENV) else EXIT_CHECK
            raise Abort(code, str(exc)) from None
    base_runs = [ab.pool(docs) for docs in result.base]
    new_runs = [ab.pool(docs) for docs in result.new]
    base = Baseline(revision.label, "kvaddr.baseline", base_runs, run_labels(base_runs))
    new = Baseline("this tree", "kvaddr.baseline", new_runs, run_labels(new_runs))
    relative = finish_kw["relative"]
    outcome = _compare(base, new, gate, finish_kw)
    description = {
        "revision": against,
        "commit": revision.commit,
        "new_tree": new_side.import_root,
        "rounds": rounds,
        "order": "each round: the revision's profile, then this tree's, each in a process of its own",
        "budget_s": budget,
        "workloads": len(plan),
        "commands": [
            {"workload": name, "base": ["kvaddr", "profile", *b], "new": ["kvaddr", "profile", *n]}
            for name, b, n in plan
        ],
        "wall_s": result.wall_s,
    }
    finish(
        "check",
        outcome,
        base,
        new,
        "this tree",
        spreads=ab.round_spreads(result, base.labels, relative),
        against=description,
        **finish_kw,
    )


def _add_workload_options() -> None:
    """Give ``check`` the workload options of ``kvaddr profile`` (:data:`AGAINST_OPTIONS`) for ``--against``."""
    from kvaddr.commands.profile import profile as profile_command

    check.params.extend(p for p in profile_command.params if p.name in AGAINST_OPTIONS)


_add_workload_options()
