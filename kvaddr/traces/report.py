"""What ``kvaddr replay`` reports: bounded-memory statistics, the tables and the JSON.

Every replayed step gives one time per strategy (per mode and clock); the
*saving* of a strategy on a step is the per-layer baseline's time on that step
minus the strategy's. Over the trace, each is summarised by its count, mean,
median (p50), 99th percentile, minimum, maximum and total, and the savings
are broken down by batch size (active requests per step, in power-of-two
bins).

Memory stays bounded however long the trace: counts, sums, minima and maxima
are exact; quantiles come from a uniform reservoir sample (:class:`StreamStats`),
exact while a statistic has seen no more values than the reservoir holds
(``exact: true`` in the JSON) and an unbiased sample of them beyond.
"""

from __future__ import annotations

import math
import random

import numpy as np

from kvaddr.constants import SAVINGS_REFERENCE
from kvaddr.measure.report import PHRASES, count, envelope, format_us, measure_label

SCHEMA_VERSION = 1
#: Values a statistic keeps for its quantiles (the whole trace's statistics).
RESERVOIR = 16384
#: Values kept per batch-size bin.
BIN_RESERVOIR = 2048
#: Bad lines whose reasons are kept (all are counted).
MAX_BAD_EXAMPLES = 100
#: Measures in report order.
MEASURE_ORDER = (("graph", "gpu"), ("eager", "host"), ("eager", "gpu"))


class StreamStats:
    """Count, mean, min, max, total and reservoir-sampled quantiles of a stream of numbers.

    Parameters
    ----------
    capacity : int
        Values kept for quantiles (Vitter's algorithm R, seeded, so a replay
        is reproducible).
    seed : int
    """

    __slots__ = ("_cap", "_res", "_rng", "max", "min", "n", "total")

    def __init__(self, capacity: int = RESERVOIR, seed: int = 0):
        self.n, self.total = 0, 0.0
        self.min, self.max = math.inf, -math.inf
        self._res: list = []
        self._cap = capacity
        self._rng = random.Random(seed)

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x
        if len(self._res) < self._cap:
            self._res.append(x)
        else:
            j = self._rng.randrange(self.n)
            if j < self._cap:
                self._res[j] = x

    @property
    def exact(self) -> bool:
        """True while the quantiles are over every value seen."""
        return self.n <= self._cap

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    def quantile(self, pct: float) -> float:
        if not self._res:
            return math.nan
        return float(np.percentile(np.asarray(self._res), pct))

    def summary(self) -> dict:
        """``n``, ``mean``, ``p50``, ``p99``, ``min``, ``max``, ``total``, ``exact`` (JSON-ready)."""
        if not self.n:
            return {
                "n": 0,
                "mean": None,
                "p50": None,
                "p99": None,
                "min": None,
                "max": None,
                "total": 0.0,
                "exact": True,
            }
        return {
            "n": self.n,
            "mean": _r(self.mean),
            "p50": _r(self.quantile(50)),
            "p99": _r(self.quantile(99)),
            "min": _r(self.min),
            "max": _r(self.max),
            "total": _r(self.total),
            "exact": self.exact,
        }


def _r(x: float) -> float:
    return round(float(x), 4)


def batch_bin(active: int) -> tuple:
    """The power-of-two bin ``(lo, hi)`` of a step with ``active`` requests: 1, 2-3, 4-7, ..."""
    lo = 1 << (max(1, active).bit_length() - 1)
    return lo, 2 * lo - 1


def bin_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


class MeasureStats:
    """Per-step times and savings of every strategy in one (mode, clock)."""

    def __init__(self, mode: str, clock: str, strategies):
        self.mode, self.clock = mode, clock
        self.strategies = list(strategies)
        self.times = {s: StreamStats(seed=i) for i, s in enumerate(self.strategies)}
        self.saved = {s: StreamStats(seed=100 + i) for i, s in enumerate(self.strategies) if s != SAVINGS_REFERENCE}
        self.bins: dict = {}

    def add(self, active: int, times: dict) -> None:
        for name, t in times.items():
            self.times[name].add(t)
        base = times.get(SAVINGS_REFERENCE)
        if base is None:
            return
        lo, hi = batch_bin(active)
        b = self.bins.get(lo)
        if b is None:
            b = self.bins[lo] = {
                "hi": hi,
                "steps": 0,
                "baseline": StreamStats(BIN_RESERVOIR, seed=lo),
                "saved": {s: StreamStats(BIN_RESERVOIR, seed=lo + 7 * i) for i, s in enumerate(self.saved)},
            }
        b["steps"] += 1
        b["baseline"].add(base)
        for name, st in self.saved.items():
            if name in times:
                d = base - times[name]
                st.add(d)
                b["saved"][name].add(d)

    @property
    def steps(self) -> int:
        return self.times[self.strategies[0]].n if self.strategies else 0

    def as_json(self, device: str) -> dict:
        rows = []
        for name in self.strategies:
            rows.append(
                {
                    "strategy": name,
                    "time_us": self.times[name].summary(),
                    "saved_us": None if name == SAVINGS_REFERENCE else self.saved[name].summary(),
                }
            )
        bins = []
        for lo in sorted(self.bins):
            b = self.bins[lo]
            bins.append(
                {
                    "batch_lo": lo,
                    "batch_hi": b["hi"],
                    "steps": b["steps"],
                    "baseline_us": b["baseline"].summary(),
                    "saved_us": {name: st.summary() for name, st in b["saved"].items()},
                }
            )
        return {
            "mode": self.mode,
            "clock": self.clock,
            "label": measure_label(self.mode, self.clock, device),
            "unit": "us_per_step",
            "steps": self.steps,
            "strategies": rows,
            "by_batch": bins,
        }


class ReplayStats:
    """Everything a replay accumulates, in bounded memory.

    Attributes
    ----------
    measures : dict
        ``{(mode, clock): MeasureStats}``.
    steps : int
        Steps replayed (checked and run).
    idle_steps : int
        Good lines with no token to run (skipped).
    bad_lines : int
    bad_examples : list of (line, reason)
        The first :data:`MAX_BAD_EXAMPLES`.
    checked_steps : int
        Steps whose outputs were compared with the reference.
    not_run : dict
        ``{strategy: {"steps": n, "reason": "not run: ..."}}``: strategies left
        out of some steps (one-block on steps of more than 1024 padded requests).
    """

    def __init__(self, strategies):
        self.strategies = list(strategies)
        self.measures: dict = {}
        self.steps = 0
        self.idle_steps = 0
        self.bad_lines = 0
        self.bad_examples: list = []
        self.checked_steps = 0
        self.lines = 0
        self.batch = StreamStats(seed=1)
        self.tokens = StreamStats(seed=2)
        self.prefill_steps = 0
        self.shapes: dict = {}
        self.not_run: dict = {}

    def not_run_step(self, name: str, reason: str) -> None:
        """Strategy ``name`` did not run the step just added (``reason`` says why)."""
        entry = self.not_run.setdefault(name, {"steps": 0, "reason": reason})
        entry["steps"] += 1

    def bad(self, line: int, reason: str) -> None:
        self.bad_lines += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append((line, reason))

    def add(self, active: int, tokens: int, prefill: bool, shape: tuple, times: dict, checked: bool) -> None:
        """One replayed step: its batch and token counts, padded shape and times per measure."""
        self.steps += 1
        self.checked_steps += checked
        self.batch.add(active)
        self.tokens.add(tokens)
        self.prefill_steps += prefill
        self.shapes[shape] = self.shapes.get(shape, 0) + 1
        for key, t in times.items():
            m = self.measures.get(key)
            if m is None:
                m = self.measures[key] = MeasureStats(key[0], key[1], self.strategies)
            m.add(active, t)

    def ordered(self) -> list:
        keys = [k for k in MEASURE_ORDER if k in self.measures]
        return [self.measures[k] for k in keys + [k for k in self.measures if k not in keys]]


# ----------------------------------------------------------------------------- text


def _num(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.2f}" if abs(x) < 1000 else f"{x:.1f}"


def headline(m: MeasureStats, device: str) -> str | None:
    """One sentence per measure: what hoisting and fusing saved over the trace."""
    parts = []
    for name in ("hoisted", "fused"):
        st = m.saved.get(name)
        if st is None or not st.n:
            continue
        parts.append(
            f"{PHRASES[name]} saved {format_us(st.total)} in total over {st.n} steps "
            f"(per step: mean {format_us(st.mean)}, p50 {format_us(st.quantile(50))}, "
            f"p99 {format_us(st.quantile(99))}, min {format_us(st.min)})"
        )
    if not parts:
        return None
    return f"{measure_label(m.mode, m.clock, device)}: " + "; ".join(parts) + "."


def render(console, stats: ReplayStats, info: dict) -> None:
    """Print the replay's tables and headlines to ``console`` (stdout)."""
    from rich.table import Table

    device = info["device"]
    w = info["workload"]
    sizes = ", ".join(map(str, dict.fromkeys(w["block_sizes"])))
    b, t = stats.batch, stats.tokens
    console.print(
        f"replay of {info['trace']}: {stats.steps} steps replayed ({stats.checked_steps} checked against the "
        f"reference), {stats.bad_lines} bad lines, {stats.idle_steps} idle steps; {w['model']}, "
        f"{count(w['num_layers'], 'layer')} x {count(w['num_caches'], 'cache')} (B = {sizes}); times in us per step",
        style="italic",
        soft_wrap=True,
    )
    if b.n:
        console.print(
            f"requests per step: min {b.min:.0f}, mean {b.mean:.1f}, max {b.max:.0f}; tokens per step: "
            f"min {t.min:.0f}, mean {t.mean:.1f}, max {t.max:.0f}; {stats.prefill_steps} steps carry "
            f"prefill chunks",
            soft_wrap=True,
        )
    for m in stats.ordered():
        table = Table(
            box=None,
            padding=(0, 1),
            pad_edge=False,
            show_edge=False,
            header_style="bold",
            title=f"{measure_label(m.mode, m.clock, device)} ({m.steps} steps)",
            title_justify="left",
            title_style="bold",
        )
        heads = ["strategy", "time mean", "p50", "p99", "saved mean", "p50", "p99", "min", "total"]
        for i, h in enumerate(heads):
            table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
        for name in m.strategies:
            ts = m.times[name].summary()
            if name == SAVINGS_REFERENCE:
                saved = ["baseline", "", "", "", ""]
            else:
                s = m.saved[name].summary()
                saved = [
                    _num(s["mean"]),
                    _num(s["p50"]),
                    _num(s["p99"]),
                    _num(s["min"]),
                    format_us(s["total"]) if s["n"] else "-",
                ]
            table.add_row(name, _num(ts["mean"]), _num(ts["p50"]), _num(ts["p99"]), *saved)
        console.print(table)
        if m.bins:
            bt = Table(
                box=None,
                padding=(0, 1),
                pad_edge=False,
                show_edge=False,
                header_style="bold",
                title="by batch size (requests running a token), p50 of each bin",
                title_justify="left",
            )
            bt.add_column("batch", justify="left")
            bt.add_column("steps", justify="right")
            bt.add_column(f"{SAVINGS_REFERENCE} time", justify="right")
            for name in m.saved:
                bt.add_column(f"{name} saved", justify="right", overflow="fold")
            for lo in sorted(m.bins):
                bb = m.bins[lo]
                bt.add_row(
                    bin_label(lo, bb["hi"]),
                    str(bb["steps"]),
                    _num(bb["baseline"].quantile(50)),
                    *[_num(bb["saved"][name].quantile(50)) for name in m.saved],
                )
            console.print(bt)
        line = headline(m, device)
        if line:
            console.print(line, soft_wrap=True)
        console.print()
    for name, entry in stats.not_run.items():
        console.print(
            f"{name}: {entry['reason']}; left out of {entry['steps']} of {stats.steps} steps "
            f"(its times and savings cover the other steps).",
            soft_wrap=True,
        )
    console.print(
        "saved = per-layer time minus the strategy's, on the same step (negative: slower); one "
        "sample per step and strategy, so single steps are noisy and the distribution is the result.",
        soft_wrap=True,
    )


# ----------------------------------------------------------------------------- JSON


def replay_document(stats: ReplayStats, info: dict, environment: dict, settings: dict, options: dict) -> dict:
    """The whole replay JSON report (schema: docs/trace-format.md, "The replay report")."""
    return {
        **envelope("kvaddr.replay", options, environment, SCHEMA_VERSION),
        "settings": {**settings, "baseline": SAVINGS_REFERENCE, "reservoir": RESERVOIR, "bin_reservoir": BIN_RESERVOIR},
        "workload": info["workload"],
        "trace": {
            "path": info["trace"],
            "header": info.get("header"),
            "lines": stats.lines,
            "steps_replayed": stats.steps,
            "steps_checked": stats.checked_steps,
            "idle_steps": stats.idle_steps,
            "bad_lines": stats.bad_lines,
            "bad_line_examples": [{"line": ln, "reason": r} for ln, r in stats.bad_examples],
            "requests_per_step": stats.batch.summary(),
            "tokens_per_step": stats.tokens.summary(),
            "prefill_steps": stats.prefill_steps,
            "padded_shapes": [
                {"rows": k[0], "capacity": k[1], "width": k[2], "steps": v} for k, v in sorted(stats.shapes.items())
            ],
        },
        "correctness": {"status": "passed", "steps_checked": stats.checked_steps, "strategies": stats.strategies},
        "not_run": {name: dict(entry) for name, entry in stats.not_run.items()},
        "measures": [m.as_json(environment.get("device", "cpu")) for m in stats.ordered()],
        "headlines": [h for h in (headline(m, environment.get("device", "cpu")) for m in stats.ordered()) if h],
    }
