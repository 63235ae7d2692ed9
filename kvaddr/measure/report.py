"""Turning measurements into the profile report: tables, headlines and JSON.

The noise rule
--------------
A strategy's time differs from the per-layer baseline's only when their
interquartile ranges do not overlap: it is a *saving* when the strategy's 75th
percentile is below the baseline's 25th, *slower* when its 25th percentile is
above the baseline's 75th, and *within noise* otherwise. A difference within
noise is never reported as a saving (the table and the headline say "within
noise"); the JSON report still carries the median difference, with the
verdict next to it.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from kvaddr.constants import MEASURES, SAVINGS_REFERENCE, STRATEGY_NAMES
from kvaddr.measure.timing import FLOOR, Measurement, Summary

SCHEMA_VERSION = 1
NOISE_RULE = (
    "a difference counts only when the interquartile ranges [q25, q75] of the two strategies do "
    "not overlap: saving if candidate q75 < baseline q25, slower if candidate q25 > baseline q75, "
    "otherwise within noise"
)


#: What a headline calls each strategy.
PHRASES = {
    "per-layer-kernel": "one slot kernel per layer",
    "hoisted": "hoisting",
    "fused": "fusing",
}


@dataclass(frozen=True)
class Comparison:
    """A strategy against the per-layer baseline, same mode and clock.

    Attributes
    ----------
    saved_us : float
        Baseline median minus this strategy's median (positive: faster).
    saved_pct : float
        ``saved_us`` as a percentage of the baseline median.
    verdict : str
        ``"baseline"``, ``"saving"``, ``"slower"`` or ``"within noise"``.
    step_pct : float or None
        ``saved_us`` as a percentage of the ``--step-ms`` step.
    """

    saved_us: float
    saved_pct: float
    verdict: str
    step_pct: float | None = None

    def as_dict(self) -> dict:
        return {
            "saved_us": round(self.saved_us, 4),
            "saved_pct": round(self.saved_pct, 3),
            "verdict": self.verdict,
            "share_of_step_pct": None if self.step_pct is None else round(self.step_pct, 3),
        }


def verdict(baseline: Summary, candidate: Summary) -> str:
    """The noise rule (module docstring)."""
    if candidate.q75 < baseline.q25:
        return "saving"
    if candidate.q25 > baseline.q75:
        return "slower"
    return "within noise"


def compare_to_reference(
    reference: Summary, candidate: Summary, step_ms: float | None = None, is_reference: bool = False
) -> Comparison:
    """What ``candidate`` saves against the savings reference (:data:`~kvaddr.constants.SAVINGS_REFERENCE`)."""
    saved = reference.median - candidate.median
    pct = 100.0 * saved / reference.median if reference.median > 0 else 0.0
    step_pct = None if step_ms is None else 100.0 * saved / (step_ms * 1000.0)
    return Comparison(saved, pct, "baseline" if is_reference else verdict(reference, candidate), step_pct)


def count(n, noun: str, plural: str | None = None) -> str:
    """``count(1, "cache")`` -> ``"1 cache"``, ``count(2, "cache")`` -> ``"2 caches"`` (``n`` may be ``"?"``)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def format_us(us: float) -> str:
    """A duration for people: '0.84 us', '12.3 us', '415 us', '1.4 ms', '152 ms', '2.35 s'."""
    a = abs(us)
    if a >= 1_000_000:
        return f"{us / 1e6:.2f} s"
    if a >= 100_000:
        return f"{us / 1000:.0f} ms"
    if a >= 1000:
        return f"{us / 1000:.1f} ms"
    if a >= 100:
        return f"{us:.0f} us"
    if a >= 10:
        return f"{us:.1f} us"
    return f"{us:.2f} us"


def format_pct(p: float) -> str:
    return f"{p:.0f}%" if abs(p) >= 10 else f"{p:.1f}%"


def format_ms(ms: float) -> str:
    return f"{ms:g} ms"


#: What the CPU path times: say it wherever its numbers are shown, so they are not read as the GPU kernels'.
CPU_WHAT = "NumPy strategies on the CPU, not the GPU kernels"


def measure_label(mode: str, clock: str, device: str) -> str:
    if device == "cpu":
        return "CPU (NumPy), host wall time"
    return {
        ("graph", "gpu"): "CUDA graphs, GPU time",
        ("eager", "host"): "eager, host wall time",
        ("eager", "gpu"): "eager, GPU time",
    }.get((mode, clock), f"{mode}, {clock} time")


def group(measurements) -> dict:
    """``{(mode, clock): {strategy: Measurement}}`` in measurement order."""
    out: dict = {}
    for m in measurements:
        out.setdefault((m.mode, m.clock), {})[m.strategy] = m
    return out


def ordered_measures(groups: dict) -> list:
    keys = [k for k in MEASURES if k in groups]
    return keys + [k for k in groups if k not in keys]


@dataclass(frozen=True)
class MeasurementRow:
    """One line of a report table, with everything JSON needs too."""

    measurement: Measurement
    summary: Summary
    comparison: Comparison | None
    floor_ratio: float | None


def rows(section: dict, step_ms: float | None) -> list:
    """Rows of one (mode, clock) section: the strategies in order, then the floor."""
    base = section.get(SAVINGS_REFERENCE)
    floor = section.get(FLOOR)
    base_s = base.summary if base else None
    floor_s = floor.summary if floor else None
    out = []
    for name, m in section.items():
        s = m.summary
        comp = None
        if base_s is not None and name != FLOOR:
            comp = compare_to_reference(base_s, s, step_ms, is_reference=(name == SAVINGS_REFERENCE))
        ratio = s.median / floor_s.median if floor_s is not None and floor_s.median > 0 else None
        out.append(MeasurementRow(m, s, comp, ratio))
    out.sort(key=lambda r: r.measurement.strategy == FLOOR)
    return out


def headline(
    section: dict, mode: str, clock: str, device: str, batch: int, step_word: str, step_ms: float | None
) -> str | None:
    """One sentence: what hoisting and the fused kernel save against per-layer."""
    base = section.get(SAVINGS_REFERENCE)
    if base is None:
        return None
    parts = []
    for name in ("hoisted", "fused"):
        m = section.get(name)
        if m is None:
            continue
        c = compare_to_reference(base.summary, m.summary, step_ms)
        who = PHRASES[name] if device != "cpu" else name
        first = not parts
        tail = f" per {step_word} at batch {batch}" if first else ""
        if c.verdict == "saving":
            share = format_pct(c.step_pct if step_ms is not None else c.saved_pct)
            if first:
                share += f" of a {format_ms(step_ms)} step" if step_ms is not None else " of the per-layer time"
            if device == "cpu":  # host time of NumPy code: no claim about what a kernel saves
                parts.append(
                    f"{who} takes {format_us(c.saved_us)} less{' than per-layer' if first else ''}{tail} ({share})"
                )
            else:
                parts.append(f"{who} saves {format_us(c.saved_us)}{tail} ({share})")
        elif c.verdict == "slower":
            parts.append(f"{who} costs {format_us(-c.saved_us)} more{tail}")
        else:
            parts.append(f"{who} is within noise of per-layer" + (f" at batch {batch}" if first else ""))
    if not parts:
        return None
    if device == "cpu":
        return f"{measure_label(mode, clock, device)} of NumPy code, not the GPU kernels: " + "; ".join(parts) + "."
    return f"{measure_label(mode, clock, device)}: " + "; ".join(parts) + "."


def step_word(workload) -> str:
    return "decode step" if workload.prefill is None or workload.prefill[0] == 0 else "step"


# ----------------------------------------------------------------------------- rich table


def _num(x: float) -> str:
    """A table number: two decimals below 1000, one above."""
    return f"{x:.2f}" if abs(x) < 1000 else f"{x:.1f}"


def short_label(mode: str, clock: str, device: str) -> str:
    """The section heading of a table: 'graph: GPU', 'eager: host', 'CPU: host'."""
    if device == "cpu":
        return f"CPU: {clock}"
    return f"{mode}: {'GPU' if clock == 'gpu' else clock}"


def render_report(console, doc: dict) -> None:
    """Print every batch shape of a profile report (:func:`profile_document`) to ``console``."""
    step_ms = doc["settings"].get("step_ms")
    device = doc["environment"]["device"]
    for shape in doc["shapes"]:
        render_shape(console, shape, doc["workload"], device, step_ms)
    if doc.get("draft_steps"):
        from kvaddr.measure.mtp_profile import render

        render(console, doc["draft_steps"])


def render_shape(console, shape: dict, workload: dict, device: str, step_ms: float | None) -> None:
    """Print one batch shape's table and headlines to ``console`` (stdout).

    ``shape`` and ``workload`` are the report's JSON objects (:func:`shape_json`,
    ``Workload.describe()``). One section per (mode, clock), headed by a bold
    row. Columns fold rather than elide when the terminal is narrow, so no
    number is ever cut short.
    """
    from rich.table import Table

    sizes = ", ".join(map(str, dict.fromkeys(workload["block_sizes"])))
    cpu = device == "cpu"
    title = (
        f"batch {shape['batch']}: {workload['model']}, {count(workload['num_layers'], 'layer')} x "
        f"{count(workload['num_caches'], 'cache')} (B = {sizes}), {count(shape['capacity'], 'token')}/step; "
        + (f"{CPU_WHAT}; " if cpu else "")
        + "times in us per step"
    )
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    headers = ["strategy", "launches", "median", "IQR", "n", "saved", "saved %"]
    if step_ms is not None:
        headers.append("of step")
    if not cpu:  # the CPU path's floor is an empty Python call, no launch: no floor column there
        headers.append("x floor")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    skipped = shape.get("skipped") or {}
    order = {n: i for i, n in enumerate(STRATEGY_NAMES)}
    pending: list = []

    def not_run_rows(before: str | None) -> None:
        # Rows of strategies this batch did not run, in strategy order, before `before` (None: all left).
        while pending and (before is None or order.get(pending[0], -1) < order.get(before, len(order))):
            name = pending.pop(0)
            cells = (
                [name, "-", "not run", "", "", "-", ""] + ([""] if step_ms is not None else []) + (["-"] * (not cpu))
            )
            table.add_row(*cells, style="dim")

    section = None
    for r in shape["results"]:
        if (r["mode"], r["clock"]) != section:
            not_run_rows(None)
            section = (r["mode"], r["clock"])
            table.add_row(short_label(r["mode"], r["clock"], device), style="bold")
            pending = [n for n in STRATEGY_NAMES if n in skipped] + [n for n in skipped if n not in order]
        not_run_rows(r["strategy"])
        if cpu and r["strategy"] == FLOOR:
            continue
        s, c, floor_ratio = r["summary"], r["vs_per_layer"], r["vs_floor"]
        share = ""
        if c is None:
            saved, pct = "-", "-"
        elif c["verdict"] == "baseline":
            saved, pct = "baseline", ""
        elif c["verdict"] == "within noise":
            saved, pct = "within noise", ""
        else:
            saved, pct = _num(c["saved_us"]), f"{c['saved_pct']:.1f}%"
            share = f"{c['share_of_step_pct']:.1f}%" if c["share_of_step_pct"] is not None else ""
        cells = [
            r["strategy"],
            "-" if r["launches_per_step"] is None else str(r["launches_per_step"]),
            _num(s["median"]),
            _num(s["iqr"]),
            str(s["n"]),
            saved,
            pct,
        ]
        if step_ms is not None:
            cells.append(share)
        if not cpu:
            cells.append(
                "-" if floor_ratio is None else (f"{floor_ratio:.1f}x" if floor_ratio < 100 else f"{floor_ratio:.0f}x")
            )
        table.add_row(*cells)
    not_run_rows(None)
    console.print(title, style="italic", soft_wrap=True)
    console.print(table)
    for name, reason in skipped.items():
        console.print(f"{name}: {reason} (batch {shape['batch']}).", soft_wrap=True)
    if cpu:
        legend = (
            "host = wall time per step as the Python loop sees it; launches = the kernel launches each "
            "strategy stands for on a GPU."
        )
    else:
        legend = (
            "graph = CUDA-graph replays, eager = one launch at a time; host = wall time per step as a "
            "Python loop sees it, GPU = CUDA events. floor = one empty kernel launch per step."
        )
    console.print(
        f'{legend} saved = per-layer median minus the row\'s (negative: slower; "within noise" when the IQRs overlap).',
        soft_wrap=True,
    )
    for line in shape["headlines"]:
        console.print(line, soft_wrap=True)
    console.print()


# ----------------------------------------------------------------------------- JSON


def measurement_json(r: MeasurementRow, include_samples: bool = True) -> dict:
    m = r.measurement
    d = {
        "strategy": m.strategy,
        "mode": m.mode,
        "clock": m.clock,
        "launches_per_step": m.launches_per_step,
        "steps_per_sample": m.steps_per_sample,
        "unit": "us_per_step",
        "summary": r.summary.as_dict(),
        "vs_per_layer": None if r.comparison is None else r.comparison.as_dict(),
        "vs_floor": None if r.floor_ratio is None else round(r.floor_ratio, 4),
    }
    if include_samples:
        d["samples_us"] = [round(x, 4) for x in m.samples_us]
    return d


def shape_json(shape, workload, device: str, step_ms: float | None) -> dict:
    groups = group(shape.measurements)
    results, headlines = [], []
    for mode, clock in ordered_measures(groups):
        results.extend(measurement_json(r) for r in rows(groups[(mode, clock)], step_ms))
        line = headline(groups[(mode, clock)], mode, clock, device, shape.batch, step_word(workload), step_ms)
        if line:
            headlines.append(line)
    out = {
        "batch": shape.batch,
        "capacity": shape.capacity,
        "num_tokens": shape.capacity,
        "input_sets": [b.stats() for b in shape.batches],
        "correctness": shape.checks,
        "results": results,
        "headlines": headlines,
    }
    skipped = getattr(shape, "skipped", None)
    if skipped:
        out["skipped"] = dict(skipped)  # {strategy: "not run: ..."}; only when a strategy was not run
    return out


def envelope(kind: str, options: dict, environment: dict, schema_version: int = SCHEMA_VERSION) -> dict:
    """The fields every kvaddr JSON report opens with."""
    return {
        "schema_version": schema_version,
        "kind": kind,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "options": options,
        "environment": environment,
    }


def profile_document(shapes, workload, environment: dict, settings: dict, options: dict) -> dict:
    """The whole JSON report (schema: docs/json-schema.md)."""
    return {
        **envelope("kvaddr.profile", options, environment),
        "settings": {**settings, "baseline": SAVINGS_REFERENCE, "noise_rule": NOISE_RULE},
        "workload": workload.describe(),
        "shapes": [shape_json(s, workload, environment.get("device", "cpu"), settings.get("step_ms")) for s in shapes],
    }
