"""The regression rule: is a new set of timing samples faster, the same, slower, or ambiguous?

Statistics (NumPy only)
-----------------------
:func:`mann_whitney_u`
    The two-sided Mann-Whitney U test: exact distribution for small samples
    without ties, otherwise the normal approximation with the tie correction
    and a continuity correction of 0.5 (what ``scipy.stats.mannwhitneyu``
    computes with ``method="exact"`` / ``"asymptotic"``).
:func:`median_ci`
    The distribution-free confidence interval of a median: order statistics
    ``x_(k)`` and ``x_(n+1-k)`` with ``k`` from the Binomial(n, 1/2) law.

The decision rule (:func:`decide`)
----------------------------------
With ``ratio = median(new) / median(base)``, ``p`` the two-sided Mann-Whitney
p-value, and ``[lo, hi]`` the ratio's interval ``[new_lo / base_hi, new_hi /
base_lo]`` built from each median's ``1 - alpha`` interval (so it covers the
true ratio with probability at least ``1 - 2 alpha``):

* ``slower``     ratio > factor and p < alpha;
* ``faster``     ratio < 1 / factor and p < alpha;
* ``ambiguous``  ratio beyond the factor (either way) but p >= alpha, or ratio
  within ``[1/factor, factor]`` but ``[lo, hi]`` is not (the noise, or too
  few samples, cannot exclude a change beyond the factor);
* ``same``       ratio and ``[lo, hi]`` both within ``[1/factor, factor]``;
  or the two sample sets are identical (the same values, in any order: a file
  compared with itself), whatever their spread.

A change smaller than the factor is ``same`` even when it is significant.

Ratio samples (``--relative``)
------------------------------
:func:`pairwise_ratios` forms the samples of a ratio of two measurements of
one run (``fused / floor``): sample i of the numerator divided by sample i of
the denominator, in the order taken, for i < min(n_num, n_den) (pairs with a
denominator sample that is not positive are left out).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from kvaddr.constants import FLOOR, SAVINGS_REFERENCE
from kvaddr.constants import MEASURES as GATE_MEASURES

DEFAULT_FACTOR = 1.10
DEFAULT_ALPHA = 0.01
#: Use the exact U distribution when both samples have at most this many values and there are no ties.
EXACT_MAX_N = 20
VERDICTS = ("faster", "same", "slower", "ambiguous")

RULE = (
    "ratio = median(new) / median(base); p = two-sided Mann-Whitney U p-value; [lo, hi] = the ratio's "
    "interval from each median's distribution-free (1 - alpha) interval. slower: ratio > factor and "
    "p < alpha; faster: ratio < 1/factor and p < alpha; ambiguous: ratio beyond the factor but p >= alpha, "
    "or ratio within [1/factor, factor] but [lo, hi] not; same: ratio and [lo, hi] within "
    "[1/factor, factor], or identical sample sets"
)


def _samples(values, what: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError(f"{what} must hold at least one sample, got none")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} must hold finite numbers only")
    return a


# ----------------------------------------------------------------------------- Mann-Whitney U


@dataclass(frozen=True)
class MannWhitney:
    """The result of :func:`mann_whitney_u`.

    Attributes
    ----------
    u : float
        U of the first sample: pairs (x_i, y_j) with x_i > y_j, plus half the ties.
    p : float
        Two-sided p-value.
    method : str
        ``"exact"`` or ``"asymptotic"``.
    """

    u: float
    p: float
    method: str


def average_ranks(values) -> tuple:
    """Ranks 1..n of ``values``, ties sharing their average rank.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        The ranks, and the size of every tie group (1 for a value without ties).
    """
    a = np.asarray(values, dtype=np.float64)
    n = a.size
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    counts = np.diff(np.append(starts, n))
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.repeat(starts + (counts + 1) / 2.0, counts)
    return ranks, counts


def u_distribution(n1: int, n2: int) -> np.ndarray:
    """Counts of each U = 0 .. n1*n2 over the C(n1+n2, n1) orderings of two tie-free samples.

    The recurrence ``N(i, j, u) = N(i-1, j, u-j) + N(i, j-1, u)``: the largest
    value belongs to the first sample (beating all j values of the second) or
    to the second.
    """
    # table[j] = counts for (i, j) at the current i, as an int64 array of length i*j + 1.
    table = [np.ones(1, dtype=np.int64) for _ in range(n2 + 1)]  # i = 0: U is 0
    for i in range(1, n1 + 1):
        row = [np.ones(1, dtype=np.int64)]  # j = 0: U is 0
        for j in range(1, n2 + 1):
            c = np.zeros(i * j + 1, dtype=np.int64)
            up = table[j]  # (i-1, j), shifted by j
            c[j : j + up.size] += up
            left = row[j - 1]  # (i, j-1)
            c[: left.size] += left
            row.append(c)
        table = row
    return table[n2]


def mann_whitney_u(x, y, method: str = "auto") -> MannWhitney:
    """Two-sided Mann-Whitney U test of two independent samples.

    Parameters
    ----------
    x, y : array_like
        The samples (finite numbers).
    method : {"auto", "exact", "asymptotic"}
        ``auto``: exact when both samples hold at most :data:`EXACT_MAX_N`
        values and no value is tied, else asymptotic.

    Returns
    -------
    MannWhitney
        ``u`` of ``x`` and the two-sided p-value. The asymptotic p-value uses
        the normal approximation with the tie-corrected variance
        ``n1 n2 / 12 * ((n + 1) - sum(t^3 - t) / (n (n - 1)))`` and a continuity
        correction of 0.5; it is 1 when every value is the same.
    """
    a = _samples(x, "x")
    b = _samples(y, "y")
    n1, n2 = a.size, b.size
    ranks, ties = average_ranks(np.concatenate((a, b)))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    big = max(u1, n1 * n2 - u1)
    tied = bool(np.any(ties > 1))
    if method == "auto":
        method = "exact" if (not tied and max(n1, n2) <= EXACT_MAX_N) else "asymptotic"
    if method == "exact":
        if tied:
            raise ValueError("the exact Mann-Whitney distribution needs samples without ties")
        counts = u_distribution(n1, n2)
        tail = counts[round(big) :].sum()
        p = 2.0 * float(tail) / float(counts.sum())
    elif method == "asymptotic":
        n = n1 + n2
        tie_term = float(np.sum(ties.astype(np.float64) ** 3 - ties)) / (n * (n - 1)) if n > 1 else 0.0
        var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
        if var <= 0:
            p = 1.0
        else:
            z = (big - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
            p = math.erfc(z / math.sqrt(2.0))
    else:
        raise ValueError(f"method must be 'auto', 'exact' or 'asymptotic', got {method!r}")
    return MannWhitney(u1, min(1.0, max(0.0, p)), method)


# ----------------------------------------------------------------------------- medians


def median_ci(values, alpha: float = DEFAULT_ALPHA) -> tuple:
    """Distribution-free ``1 - alpha`` confidence interval of the median.

    ``[x_(k), x_(n+1-k)]`` for the largest ``k >= 1`` with
    ``P(Binomial(n, 1/2) <= k - 1) <= alpha / 2``; ``(-inf, inf)`` when no such
    ``k`` exists (fewer than ``log2(2 / alpha)`` samples).
    """
    a = np.sort(_samples(values, "values"))
    n = a.size
    i = np.arange(n)
    log_pmf = np.concatenate(([-n * math.log(2.0)], np.log((n - i) / (i + 1.0))))
    cdf = np.cumsum(np.exp(np.cumsum(log_pmf)))  # cdf[m] = P(Bin(n, 1/2) <= m)
    ok = np.flatnonzero(cdf[: (n + 1) // 2] <= alpha / 2.0)
    if ok.size == 0:
        return -math.inf, math.inf
    k = int(ok[-1]) + 1
    return float(a[k - 1]), float(a[n - k])


def pairwise_ratios(numerator, denominator) -> np.ndarray:
    """Sample i of ``numerator`` over sample i of ``denominator``, for i < the shorter length.

    Pairs whose denominator sample is not positive are left out (the result may be empty).
    """
    num = _samples(numerator, "numerator")
    den = _samples(denominator, "denominator")
    n = min(num.size, den.size)
    num, den = num[:n], den[:n]
    keep = den > 0
    return num[keep] / den[keep]


# ----------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class Decision:
    """One verdict of :func:`decide`.

    Attributes
    ----------
    verdict : str
        ``faster``, ``same``, ``slower`` or ``ambiguous``.
    ratio : float
        ``median(new) / median(base)`` (nan when the base median is not positive).
    p : float
        Two-sided Mann-Whitney p-value.
    ratio_ci : tuple of float
        ``(lo, hi)``, the ratio's interval (module docstring).
    reason : str
        Why, in words.
    base_median, new_median : float
    base_iqr, new_iqr : float
    base_n, new_n : int
    """

    verdict: str
    ratio: float
    p: float
    ratio_ci: tuple
    reason: str
    base_median: float
    new_median: float
    base_iqr: float
    new_iqr: float
    base_n: int
    new_n: int


def _ratio_interval(base_ci: tuple, new_ci: tuple) -> tuple:
    b_lo, b_hi = base_ci
    n_lo, n_hi = new_ci
    lo = n_lo / b_hi if (b_hi > 0 and math.isfinite(b_hi) and n_lo > 0) else 0.0
    hi = n_hi / b_lo if (b_lo > 0 and math.isfinite(n_hi)) else math.inf
    return lo, hi


def fmt_p(p: float) -> str:
    """A p-value for people: two significant digits, ``<1e-300`` for zero."""
    return "<1e-300" if p <= 0 else f"{p:.2g}"


def p_phrase(p: float) -> str:
    """``p = 0.032`` or ``p < 1e-300``."""
    return "p < 1e-300" if p <= 0 else f"p = {p:.2g}"


def decide(base, new, factor: float = DEFAULT_FACTOR, alpha: float = DEFAULT_ALPHA) -> Decision:
    """Compare a new set of samples with a baseline's (the rule of the module docstring).

    Parameters
    ----------
    base, new : array_like
        Samples (e.g. microseconds per step, or ratios); lower is faster.
    factor : float
        > 1: the smallest ratio that counts as a change.
    alpha : float
        In (0, 1): the significance level of the Mann-Whitney test and the
        confidence level ``1 - alpha`` of each median's interval.

    Returns
    -------
    Decision
    """
    if not (math.isfinite(factor) and factor > 1.0):
        raise ValueError(f"factor must be a finite number > 1, got {factor}")
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    b = _samples(base, "base")
    x = _samples(new, "new")
    b25, b50, b75 = np.percentile(b, [25, 50, 75])
    x25, x50, x75 = np.percentile(x, [25, 50, 75])
    p = mann_whitney_u(x, b).p
    common = dict(
        base_median=float(b50),
        new_median=float(x50),
        base_iqr=float(b75 - b25),
        new_iqr=float(x75 - x25),
        base_n=int(b.size),
        new_n=int(x.size),
    )
    if b.size == x.size and np.array_equal(np.sort(b), np.sort(x)):
        # The same measurements (a file compared with itself): nothing changed, however noisy they are. The
        # medians' interval would still be wide for few or spread samples, since it allows for two independent
        # draws; identical sets are not two draws.
        ratio = 1.0 if b50 > 0 else math.nan
        return Decision(
            "same", ratio, p, (ratio, ratio), "identical samples: the two sets hold the same values", **common
        )
    if not b50 > 0:
        return Decision("ambiguous", math.nan, p, (0.0, math.inf), "the baseline median is not positive", **common)
    ratio = float(x50 / b50)
    lo, hi = _ratio_interval(median_ci(b, alpha), median_ci(x, alpha))
    sig = p < alpha
    if ratio > factor or ratio < 1.0 / factor:
        way = "slower" if ratio > factor else "faster"
        bound = f"> {factor:g}" if ratio > factor else f"< 1/{factor:g}"
        if sig:
            return Decision(
                way, ratio, p, (lo, hi), f"ratio {ratio:.3f} {bound} and {p_phrase(p)} < {alpha:g}", **common
            )
        return Decision(
            "ambiguous",
            ratio,
            p,
            (lo, hi),
            f"ratio {ratio:.3f} {bound} but {p_phrase(p)} >= {alpha:g}: not significant",
            **common,
        )
    if lo >= 1.0 / factor and hi <= factor:
        return Decision(
            "same",
            ratio,
            p,
            (lo, hi),
            f"ratio {ratio:.3f} and its interval [{lo:.3f}, {hi:.3f}] within the factor {factor:g}",
            **common,
        )
    return Decision(
        "ambiguous",
        ratio,
        p,
        (lo, hi),
        f"ratio {ratio:.3f} within the factor, but its interval [{lo:.3f}, {hi:.3g}] is not: "
        f"too noisy or too few samples to exclude a change beyond {factor:g}",
        **common,
    )


# ----------------------------------------------------------------------------- runs and baselines


def parse_gate(text: str):
    """``auto``, ``all``, or a comma list of ``MODE:CLOCK`` (``graph:gpu,eager:host``).

    Returns
    -------
    str or frozenset of (str, str)
        ``"auto"``, ``"all"`` or the measures.
    """
    text = text.strip().lower()
    if text in ("auto", "all"):
        return text
    out = set()
    for part in text.split(","):
        mode, _, clock = part.strip().partition(":")
        if (mode, clock) not in GATE_MEASURES:
            raise ValueError(
                f"expected auto, all, or a comma list of {', '.join(':'.join(m) for m in GATE_MEASURES)}"
                f", got {part.strip()!r}"
            )
        out.add((mode, clock))
    return frozenset(out)


#: What ``--gate auto`` gates when a run has it: graph mode's GPU clock, the one measure a Python host does
#: not disturb.
AUTO_GATE = ("graph", "gpu")


def gated_measures(gate, run: dict) -> frozenset:
    """The (mode, clock) measures of ``run`` that can fail the comparison.

    ``auto``: graph mode's GPU clock when the run has it, else nothing. Eager
    timings move with the Python host: on the CPU path, host wall time of the
    NumPy strategies moved by x1.3-2.1 (p down to 1e-300) between a
    ``profile --save`` and a ``check`` run straight after it on one machine,
    and eager GPU time on a GPU is bounded by the host's launches. A run
    without graph mode (the CPU path, ``--mode eager``) is then compared and
    reported, but nothing of it fails the command unless ``--gate`` names
    its measures (:func:`auto_gate_note` says so).
    """
    have = {(r["mode"], r["clock"]) for s in run["shapes"] for r in s["results"]}
    if gate == "all":
        return frozenset(have)
    if gate == "auto":
        return frozenset({AUTO_GATE}) if AUTO_GATE in have else frozenset()
    return frozenset(gate)


def auto_gate_note(gate, run: dict, label: str) -> str | None:
    """One line when ``--gate auto`` gates nothing of ``run`` (no graph mode), else None."""
    if gate != "auto" or gated_measures(gate, run):
        return None
    where = "the CPU path" if run.get("environment", {}).get("device") == "cpu" else "eager mode only"
    return (
        f"--gate auto gates nothing of run {label!r} ({where}: eager timings move with the host by more than "
        f"the factor between runs); its verdicts are reported, not gated (--gate eager:host or --gate all gates them)"
    )


@dataclass(frozen=True)
class VerdictRow:
    """One verdict: a run's batch size, a strategy (or ratio), a mode and a clock.

    Attributes
    ----------
    run : str
        The run's label (its ``--profile`` name or model).
    batch : int
    strategy : str
    relative_to : str or None
        ``None`` (absolute times), ``"floor"`` or ``"per-layer"`` (``--relative``).
    mode, clock : str
    gated : bool
        Whether a ``slower`` verdict here fails the comparison.
    verdict : str
        ``faster``, ``same``, ``slower``, ``ambiguous``; ``missing`` (only in
        the baseline) or ``new`` (only in the new run).
    decision : Decision or None
        None for ``missing`` and ``new``.
    """

    run: str
    batch: int
    strategy: str
    relative_to: str | None
    mode: str
    clock: str
    gated: bool
    verdict: str
    decision: Decision | None = None

    @property
    def quantity(self) -> str:
        return self.strategy if self.relative_to is None else f"{self.strategy} / {self.relative_to}"

    def shape(self) -> str:
        return f"{self.run}, batch {self.batch}"

    def sentence(self) -> str:
        """``deepseek-v3.2, batch 64: fused, graph mode, GPU clock: slower, x1.25 (3.30 -> 4.12 us, p = 1e-40)``."""
        clock = "GPU" if self.clock == "gpu" else self.clock
        head = f"{self.shape()}: {self.quantity}, {self.mode} mode, {clock} clock: {self.verdict}"
        d = self.decision
        if d is None:
            return head + (" (only in the baseline)" if self.verdict == "missing" else " (not in the baseline)")
        unit = "" if self.relative_to else " us"
        return f"{head}, x{d.ratio:.3f} ({d.base_median:.4g} -> {d.new_median:.4g}{unit}, {p_phrase(d.p)})" + (
            "" if self.gated else " [not gated]"
        )

    def as_dict(self) -> dict:
        d = self.decision
        out = {
            "run": self.run,
            "batch": self.batch,
            "strategy": self.strategy,
            "relative_to": self.relative_to,
            "quantity": self.quantity,
            "mode": self.mode,
            "clock": self.clock,
            "gated": self.gated,
            "verdict": self.verdict,
            "ratio": None,
            "p_value": None,
            "ratio_ci": None,
            "reason": None,
            "base": None,
            "new": None,
        }
        if d is not None:
            out.update(
                ratio=_num(d.ratio),
                p_value=d.p,
                ratio_ci=[_num(d.ratio_ci[0]), _num(d.ratio_ci[1])],
                reason=d.reason,
                base={"median": _num(d.base_median), "iqr": _num(d.base_iqr), "n": d.base_n},
                new={"median": _num(d.new_median), "iqr": _num(d.new_iqr), "n": d.new_n},
            )
        return out


def _num(x: float):
    """JSON-safe: None for nan/inf, else rounded to 6 significant digits."""
    return float(f"{x:.6g}") if math.isfinite(x) else None


def _sections(shape: dict) -> dict:
    """``{(mode, clock): {strategy: samples}}`` of one shape, in report order."""
    out: dict = {}
    for r in shape["results"]:
        out.setdefault((r["mode"], r["clock"]), {})[r["strategy"]] = r["samples_us"]
    return out


def _quantities(section: dict, relative: bool) -> dict:
    """``{(strategy, relative_to): samples}``: times, or (``relative``) pair-wise ratios to floor and per-layer."""
    if not relative:
        return {(name, None): s for name, s in section.items()}
    out = {}
    for name, s in section.items():
        if name == FLOOR:
            continue
        for den in (FLOOR, SAVINGS_REFERENCE):
            if den in section and name != den:
                ratios = pairwise_ratios(s, section[den])
                if ratios.size:
                    out[(name, den)] = ratios
    return out


def measurement_samples(run: dict, relative: bool = False) -> dict:
    """Every measurement of a run as ``{(batch, strategy, relative_to, mode, clock): samples}``.

    The quantities :func:`compare_runs` compares: times, or with ``relative``
    the pair-wise ratios to the floor and to per-layer.
    """
    out = {}
    for shape in run["shapes"]:
        for (mode, clock), section in _sections(shape).items():
            for (name, den), samples in _quantities(section, relative).items():
                out[(shape["batch"], name, den, mode, clock)] = samples
    return out


def compare_runs(
    base_run: dict,
    new_run: dict,
    label: str,
    *,
    factor: float = DEFAULT_FACTOR,
    alpha: float = DEFAULT_ALPHA,
    relative: bool = False,
    gate="auto",
) -> list:
    """Verdicts of every batch size, strategy (or ratio), mode and clock of two runs.

    Parameters
    ----------
    base_run, new_run : dict
        Profile documents (``shapes[].results[].samples_us``).
    label : str
        Names the run in each :class:`VerdictRow`.
    factor, alpha : float
        See :func:`decide`.
    relative : bool
        Compare ratios (``X / floor`` for every strategy X, ``X / per-layer``
        for the others) formed by :func:`pairwise_ratios`, instead of times.
    gate : str or frozenset
        See :func:`parse_gate`; resolved on the baseline run.

    Returns
    -------
    list of VerdictRow
        In the baseline's order; batch sizes only in the new run are skipped
        (the workload check reports them).
    """
    gated = gated_measures(gate, base_run)
    new_shapes = {s["batch"]: s for s in new_run["shapes"]}
    rows = []
    for bshape in base_run["shapes"]:
        batch = bshape["batch"]
        bsec = _sections(bshape)
        nsec = _sections(new_shapes[batch]) if batch in new_shapes else {}
        for measure in list(bsec) + [m for m in nsec if m not in bsec]:
            bq = _quantities(bsec.get(measure, {}), relative)
            nq = _quantities(nsec.get(measure, {}), relative)
            for key in list(bq) + [k for k in nq if k not in bq]:
                name, den = key
                is_gated = measure in gated and (relative or name != FLOOR)
                if key not in nq or key not in bq:
                    rows.append(
                        VerdictRow(label, batch, name, den, *measure, is_gated, "missing" if key not in nq else "new")
                    )
                    continue
                d = decide(bq[key], nq[key], factor, alpha)
                rows.append(VerdictRow(label, batch, name, den, *measure, is_gated, d.verdict, d))
    return rows


@dataclass
class Outcome:
    """Everything :func:`compare_baselines` found.

    Attributes
    ----------
    rows : list of VerdictRow
        Empty when a mismatch stopped the comparison.
    mismatches : list of (str, Difference)
        Run label and what does not match (GPU, driver, workload).
    notes : list of (str, Difference)
        Differences that do not stop a comparison (versions, commit).
    unmatched_new : list of str
        Runs of the new side no baseline run has the workload of.
    stopped : bool
        True when mismatches were found and not allowed.
    gate_notes : list of str
        One line per run that ``--gate auto`` gates nothing of (:func:`auto_gate_note`).
    """

    rows: list
    mismatches: list
    notes: list
    unmatched_new: list
    stopped: bool
    gate_notes: list = field(default_factory=list)

    @property
    def slower(self) -> list:
        return [r for r in self.rows if r.gated and r.verdict == "slower"]

    def counts(self, gated_only: bool = True) -> dict:
        out = dict.fromkeys(VERDICTS + ("missing", "new"), 0)
        for r in self.rows:
            if r.gated or not gated_only:
                out[r.verdict] += 1
        return out

    @property
    def exit_code(self) -> int:
        if self.stopped:
            return 3
        return 1 if self.slower else 0


def pair_runs(base, new) -> tuple:
    """Match the runs of two :class:`~kvaddr.gate.baseline_file.Baseline` by run key.

    Two one-run baselines are paired whatever their keys (their workload
    differences are then reported).

    Returns
    -------
    (list of (int, int or None), list of int)
        For each baseline run its index and the new run's (None: no match);
        the new runs matched by none.
    """
    from kvaddr.gate.baseline_file import run_key

    new_keys = [run_key(r) for r in new.runs]
    pairs, used = [], set()
    for i, run in enumerate(base.runs):
        key = run_key(run)
        j = next((j for j, k in enumerate(new_keys) if k == key and j not in used), None)
        pairs.append((i, j))
        if j is not None:
            used.add(j)
    if len(base.runs) == 1 and len(new.runs) == 1 and pairs[0][1] is None:
        pairs, used = [(0, 0)], {0}
    return pairs, [j for j in range(len(new.runs)) if j not in used]


def compare_baselines(
    base,
    new,
    *,
    factor: float = DEFAULT_FACTOR,
    alpha: float = DEFAULT_ALPHA,
    relative: bool = False,
    gate="auto",
    allow_env_mismatch: bool = False,
) -> Outcome:
    """Check the environment and workload of each pair of runs, then compare them.

    Parameters
    ----------
    base, new : kvaddr.gate.baseline_file.Baseline
    relative : bool
        Machine-independent mode: the GPU and driver may differ (notes), the
        workload may not.
    allow_env_mismatch : bool
        Compare whatever matches despite mismatches (reported in ``mismatches``).

    Returns
    -------
    Outcome
    """
    from kvaddr.gate.baseline_file import Difference, environment_differences, workload_differences

    pairs, unmatched = pair_runs(base, new)
    mismatches, notes = [], []
    for i, j in pairs:
        label = base.labels[i]
        if j is None:
            mismatches.append(
                (
                    label,
                    Difference(
                        "run",
                        f"{label} (a baseline run)",
                        "no run of the new side has its workload, batch sizes and modes",
                    ),
                )
            )
            continue
        env_mis, env_notes = environment_differences(base.runs[i]["environment"], new.runs[j]["environment"], relative)
        mismatches.extend((label, d) for d in env_mis + workload_differences(base.runs[i], new.runs[j]))
        notes.extend((label, d) for d in env_notes)
    # The same note for every run is said once.
    seen, unique_notes = set(), []
    for label, d in notes:
        key = (d.field, json_key(d.base), json_key(d.new))
        if key not in seen:
            seen.add(key)
            unique_notes.append((label, d))
    if mismatches and not allow_env_mismatch:
        return Outcome([], mismatches, unique_notes, [new.labels[j] for j in unmatched], True)
    rows = []
    for i, j in pairs:
        if j is not None:
            rows.extend(
                compare_runs(
                    base.runs[i], new.runs[j], base.labels[i], factor=factor, alpha=alpha, relative=relative, gate=gate
                )
            )
    gate_notes = [
        note
        for i, j in pairs
        if j is not None
        for note in [auto_gate_note(gate, base.runs[i], base.labels[i])]
        if note is not None
    ]
    return Outcome(rows, mismatches, unique_notes, [new.labels[j] for j in unmatched], False, gate_notes)


def json_key(value) -> str:
    """A hashable, order-independent text of a JSON value."""
    return json.dumps(value, sort_keys=True, default=str)
