"""How many rounds ``kvaddr check --against`` needs: a simulation with the gate's own rule.

Each side of an A/B run is ``R`` processes (rounds). A process's samples are drawn from real
ones: the H200 baseline's samples of one measurement (profiles/baselines/h200.json), divided
by their median, resampled to the count ``kvaddr profile`` takes at the A/B's budget (the
recorded count scaled by budget / recorded budget, at least 10, at most 2000). Each process
is also offset as a whole by a factor exp(N(0, s)): what moves between processes on one
machine (clocks, placement, the kernel cache), the noise that belongs to neither side. The new
side is multiplied by the true change. Both sides are pooled over the rounds and judged by
:func:`kvaddr.gate.comparison.decide`, as ``check --against`` judges them.

Run: ``python scripts/gate_rounds.py [--trials N]`` (CPU only, about a minute). It prints, per
measurement, process spread s, true change and rounds, the share of each verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvaddr.gate.ab import DEFAULT_BUDGET
from kvaddr.gate.comparison import decide, mann_whitney_u

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "profiles", "baselines", "h200.json")
#: (run label, batch, strategy, mode, clock): the gated measure of a fast step, and the eager measure
#: with the fewest samples (reported, gated only with --gate).
MEASURES = (
    ("deepseek-v3.2-decode", 64, "fused", "graph", "gpu"),
    ("deepseek-v3.2-decode", 64, "per-layer", "eager", "host"),
)
SPREADS = (0.02, 0.04)
CHANGES = (1.00, 1.10, 1.15)
ROUNDS = (1, 2, 3, 5, 8)


def samples_of(label: str, batch: int, strategy: str, mode: str, clock: str) -> tuple:
    with open(BASELINE, encoding="utf-8") as fh:
        doc = json.load(fh)
    for run in doc["runs"]:
        if os.path.basename(run["options"].get("workload_profile") or "").startswith(label):
            for shape in run["shapes"]:
                if shape["batch"] != batch:
                    continue
                for r in shape["results"]:
                    if (r["strategy"], r["mode"], r["clock"]) == (strategy, mode, clock):
                        a = np.asarray(r["samples_us"], dtype=np.float64)
                        return a / np.median(a), float(run["settings"]["budget_s"])
    raise LookupError((label, batch, strategy, mode, clock))


def side(rng, shape: np.ndarray, n: int, rounds: int, spread: float, change: float) -> np.ndarray:
    return np.concatenate([rng.choice(shape, n) * np.exp(rng.normal(0.0, spread)) * change for _ in range(rounds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET)
    ap.add_argument("--seed", type=int, default=20261203)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print("Mann-Whitney on the rounds' medians alone (R vs R, fully separated): smallest two-sided p")
    for r in range(2, 7):
        p = mann_whitney_u(np.arange(r), np.arange(r) + r).p
        print(f"  R = {r}: p = {p:.4f}{'  < 0.01' if p < 0.01 else ''}")
    for measure in MEASURES:
        shape, recorded_budget = samples_of(*measure)
        n = int(min(2000, max(10, round(shape.size * args.budget / recorded_budget))))
        print(f"\n{measure[0]}, batch {measure[1]}: {measure[2]}, {measure[3]}:{measure[4]}; {n} samples per round")
        print("  s      change  R   slower  faster  same  ambiguous")
        for spread in SPREADS:
            for change in CHANGES:
                for rounds in ROUNDS:
                    counts = dict.fromkeys(("slower", "faster", "same", "ambiguous"), 0)
                    for _ in range(args.trials):
                        base = side(rng, shape, n, rounds, spread, 1.0)
                        new = side(rng, shape, n, rounds, spread, change)
                        counts[decide(base, new).verdict] += 1
                    share = {k: f"{100 * v / args.trials:5.1f}%" for k, v in counts.items()}
                    print(
                        f"  {spread:.2f}   x{change:.2f}   {rounds}  {share['slower']}  {share['faster']}  "
                        f"{share['same']}  {share['ambiguous']}"
                    )


if __name__ == "__main__":
    main()
