"""The regression rule (kvaddr.gate.comparison) and baseline files (kvaddr.gate.baseline_file), without the CLI."""

import json
import math

import numpy as np
import pytest

from kvaddr.gate import baseline_file as bl
from kvaddr.gate.comparison import (
    auto_gate_note,
    compare_baselines,
    compare_runs,
    decide,
    gated_measures,
    mann_whitney_u,
    median_ci,
    pairwise_ratios,
    parse_gate,
    u_distribution,
)

# ----------------------------------------------------------------------------- Mann-Whitney U, by hand


def test_u_distribution_counts_every_ordering():
    # Two values each: the 6 orderings of xxyy give U = 0, 1, 2, 2, 3, 4.
    assert u_distribution(2, 2).tolist() == [1, 1, 2, 1, 1]
    assert u_distribution(3, 0).tolist() == [1]
    assert u_distribution(1, 3).tolist() == [1, 1, 1, 1]
    assert int(u_distribution(8, 7).sum()) == math.comb(15, 7)
    d = u_distribution(6, 9)
    assert (d == d[::-1]).all()  # symmetric about n1 n2 / 2


def test_mann_whitney_fully_separated_by_hand():
    # x = 1, 2, 3 below y = 4, 5, 6: U(x) = 0. Exact: only 1 of the C(6, 3) = 20 orderings is as
    # extreme on each side, so p = 2 / 20 = 0.1.
    r = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert (r.u, r.method) == (0.0, "exact") and r.p == pytest.approx(0.1, abs=1e-12)
    # Normal approximation: mean 4.5, variance 3*3*7/12 = 5.25; z = (4.5 - 0.5) / sqrt(5.25) = 1.74574,
    # p = 2 (1 - Phi(1.74574)) = 0.080856.
    a = mann_whitney_u([1, 2, 3], [4, 5, 6], method="asymptotic")
    assert a.p == pytest.approx(0.080856, abs=1e-6)
    # The other way round gives U = 9 and the same p.
    assert mann_whitney_u([4, 5, 6], [1, 2, 3]).u == 9.0


def test_mann_whitney_with_ties_by_hand():
    # x = 1 2 2 3, y = 2 3 4 5. Sorted: 1 | 2 2 2 | 3 3 | 4 | 5, average ranks 1 | 3 3 3 | 5.5 5.5 | 7 | 8.
    # R(x) = 1 + 3 + 3 + 5.5 = 12.5, U(x) = 12.5 - 4*5/2 = 2.5; U = max(2.5, 13.5) = 13.5.
    # Ties: groups of 3 and 2, sum(t^3 - t) = 24 + 6 = 30; var = 16/12 * (9 - 30/56) = 11.285714.
    # z = (13.5 - 8 - 0.5) / sqrt(11.285714) = 1.488351, p = erfc(z / sqrt 2) = 0.136658.
    r = mann_whitney_u([1, 2, 2, 3], [2, 3, 4, 5])
    assert r.method == "asymptotic" and r.u == 2.5
    z = (13.5 - 8 - 0.5) / math.sqrt(16 / 12 * (9 - 30 / 56))
    assert z == pytest.approx(1.488351, abs=1e-6)
    assert r.p == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-12)
    assert r.p == pytest.approx(0.136658, abs=1e-6)


def test_mann_whitney_degenerate_and_bad_input():
    assert mann_whitney_u([5, 5, 5], [5, 5]).p == 1.0
    assert mann_whitney_u([1.0], [2.0]).p == 1.0
    with pytest.raises(ValueError, match="x must hold at least one sample"):
        mann_whitney_u([], [1])
    with pytest.raises(ValueError, match="finite"):
        mann_whitney_u([1, float("nan")], [1])
    with pytest.raises(ValueError, match="without ties"):
        mann_whitney_u([1, 1], [2], method="exact")
    with pytest.raises(ValueError, match="method"):
        mann_whitney_u([1], [2], method="bogus")


def test_mann_whitney_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    for n1, n2, rounding in [
        (3, 4, None),
        (8, 8, None),
        (12, 20, None),
        (20, 15, None),
        (40, 60, 1),
        (300, 250, 1),
        (1000, 800, 2),
        (5, 9, 0),
    ]:
        x = rng.normal(size=n1)
        y = rng.normal(size=n2) + 0.3
        if rounding is not None:
            x, y = np.round(x, rounding), np.round(y, rounding)
        ours = mann_whitney_u(x, y, method="asymptotic")
        ref = stats.mannwhitneyu(x, y, alternative="two-sided", method="asymptotic")
        assert ours.u == pytest.approx(float(ref.statistic))
        assert ours.p == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-300)
        if len(np.unique(np.concatenate([x, y]))) == n1 + n2 and max(n1, n2) <= 20:
            ours = mann_whitney_u(x, y, method="exact")
            ref = stats.mannwhitneyu(x, y, alternative="two-sided", method="exact")
            assert ours.p == pytest.approx(float(ref.pvalue), rel=1e-9)


# ----------------------------------------------------------------------------- medians and ratios


def test_median_ci_matches_the_binomial_tables():
    a = np.arange(1, 101, dtype=float)
    assert median_ci(a, 0.01) == (37.0, 64.0)  # n = 100: 99% from the 37th to the 64th value
    assert median_ci(a, 0.05) == (40.0, 61.0)  # 95%: 40th to 61st
    assert median_ci(np.arange(1, 11), 0.05) == (2.0, 9.0)  # n = 10, 95%: 2nd to 9th
    assert median_ci(np.arange(1, 11), 0.01) == (1.0, 10.0)
    assert median_ci(np.arange(7), 0.01) == (-math.inf, math.inf)  # 2^-7 > 0.005: no interval
    assert median_ci([3.0, 1.0, 2.0, 9.0, 4.0, 7.0, 6.0, 5.0, 8.0, 10.0], 0.05) == (2.0, 9.0)  # sorts first


def test_pairwise_ratios_pair_by_index():
    r = pairwise_ratios([2, 4, 6, 8], [1, 2, 3])
    assert r.tolist() == [2.0, 2.0, 2.0]
    assert pairwise_ratios([1, 2, 3], [1, 0, 3]).tolist() == [1.0, 1.0]  # a zero denominator is left out


# ----------------------------------------------------------------------------- the decision rule


def _lognormal(rng, median, sigma, n):
    return median * np.exp(rng.normal(0.0, sigma, n))


def test_identical_distributions_are_same():
    rng = np.random.default_rng(1)
    d = decide(_lognormal(rng, 10.0, 0.02, 300), _lognormal(rng, 10.0, 0.02, 300))
    assert d.verdict == "same", d.reason
    assert d.ratio == pytest.approx(1.0, abs=0.01)
    lo, hi = d.ratio_ci
    assert 1 / 1.1 <= lo <= 1.0 <= hi <= 1.1


def test_a_20_percent_shift_with_low_noise_is_slower():
    rng = np.random.default_rng(2)
    d = decide(_lognormal(rng, 10.0, 0.02, 300), _lognormal(rng, 12.0, 0.02, 300))
    assert d.verdict == "slower", d.reason
    assert d.ratio == pytest.approx(1.2, abs=0.01) and d.p < 1e-10
    assert d.reason.startswith("ratio 1.19") and "< 0.01" in d.reason


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_the_same_shift_under_heavy_noise_is_ambiguous(seed):
    rng = np.random.default_rng(seed)
    d = decide(_lognormal(rng, 10.0, 0.8, 20), _lognormal(rng, 12.0, 0.8, 20))
    assert d.verdict == "ambiguous", d.reason


def test_an_improvement_is_faster():
    rng = np.random.default_rng(8)
    d = decide(_lognormal(rng, 10.0, 0.03, 100), _lognormal(rng, 7.0, 0.03, 100))
    assert d.verdict == "faster" and d.ratio == pytest.approx(0.7, abs=0.02)


def test_a_significant_change_within_the_factor_is_same():
    rng = np.random.default_rng(9)
    d = decide(_lognormal(rng, 10.0, 0.01, 500), _lognormal(rng, 10.4, 0.01, 500))
    assert d.p < 1e-10 and d.verdict == "same"


def test_beyond_the_factor_but_not_significant_is_ambiguous():
    # Three samples each: the exact test cannot go below p = 0.1.
    d = decide([10.0, 10.1, 10.2], [20.0, 20.1, 20.2])
    assert d.ratio == pytest.approx(20.1 / 10.1) and d.p == pytest.approx(0.1)
    assert d.verdict == "ambiguous" and "not significant" in d.reason
    # ... and with a looser alpha it is slower.
    assert decide([10.0, 10.1, 10.2], [20.0, 20.1, 20.2], alpha=0.2).verdict == "slower"


def test_too_few_samples_to_call_same_is_ambiguous():
    d = decide([10.0, 10.1, 9.9, 10.0], [10.0, 10.2, 9.9, 10.0])
    assert d.ratio == 1.0 and d.verdict == "ambiguous" and "too noisy or too few" in d.reason


def test_identical_samples_are_same_however_few_or_noisy():
    """A file compared with itself (the floor row was "ambiguous" at x1.000, p = 1)."""
    rng = np.random.default_rng(0)
    for base in ([10.0, 10.1, 9.9, 10.0], [0.2, 0.9, 0.21, 3.0, 0.25], list(rng.lognormal(0, 1, 50)), [5.0]):
        new = list(reversed(base))  # the same values, in another order
        d = decide(base, new)
        assert (d.verdict, d.ratio, d.p, d.ratio_ci) == ("same", 1.0, 1.0, (1.0, 1.0)), d
        assert "identical samples" in d.reason
    # Not identical: the usual rule (one value moved, or one more sample).
    assert decide([10.0, 10.1, 9.9, 10.0], [10.0, 10.1, 9.9, 10.0, 10.0]).verdict == "ambiguous"
    assert decide([0.2, 0.9, 0.21, 3.0, 0.25], [0.2, 0.9, 0.21, 3.0, 0.26]).verdict == "ambiguous"
    assert decide([0.0, 0.0], [0.0, 0.0]).verdict == "same" and math.isnan(decide([0.0], [0.0]).ratio)


def test_factor_and_alpha_are_checked():
    with pytest.raises(ValueError, match="factor"):
        decide([1.0], [1.0], factor=1.0)
    with pytest.raises(ValueError, match="alpha"):
        decide([1.0], [1.0], alpha=1.0)
    assert decide([0.0, 0.0], [1.0, 1.0]).verdict == "ambiguous"  # no ratio to a zero median


# ----------------------------------------------------------------------------- runs and baselines

ENV_H200 = {
    "device": "cuda",
    "gpu": {
        "index": 0,
        "name": "NVIDIA H200",
        "compute_capability": "9.0",
        "total_memory_bytes": 150 * 2**30,
        "multiprocessors": 132,
    },
    "driver_version": "580.159.04",
    "cupy": "14.2.0",
    "cuda_driver": "13.2",
    "cuda_runtime": "13.2",
    "nvrtc": "13.2",
    "numpy": "2.1",
    "python": "3.12",
    "platform": "Linux",
    "cpu": "x86_64",
    "kvaddr": "0.1.0",
    "git_commit": "aaaa",
    "git_dirty": False,
}
WORKLOAD = {
    "model": "deepseek-v3.2",
    "model_source": "spec",
    "num_layers": 61,
    "num_caches": 2,
    "block_sizes": [64, 64],
    "shared_table": True,
    "context": {"lo": 1024, "hi": 32768, "distribution": "log-uniform"},
    "spec_tokens": 0,
    "prefill": None,
    "seed": 0,
    "input_sets": 4,
    "block_pool_slack": 1.25,
}
MEDIANS = {"per-layer": 1100.0, "per-layer-kernel": 180.0, "hoisted": 12.0, "fused": 3.3, "floor": 0.55}


def make_run(
    seed=0,
    env=None,
    workload=None,
    scale=None,
    sigma=0.01,
    n=200,
    batches=(64,),
    modes=("eager", "graph"),
    eager_host_scale=1.0,
):
    """A synthetic profile document: lognormal samples around MEDIANS (times ``scale[strategy]``)."""
    rng = np.random.default_rng(seed)
    scale = scale or {}
    shapes = []
    for b in batches:
        results = []
        for mode, clock in (("graph", "gpu"), ("eager", "host"), ("eager", "gpu")):
            if mode not in modes:
                continue
            for name, med in MEDIANS.items():
                k = scale.get(name, 1.0) * (eager_host_scale if clock == "host" else 1.0)
                samples = _lognormal(rng, med * k, sigma, n)
                results.append(
                    {
                        "strategy": name,
                        "mode": mode,
                        "clock": clock,
                        "samples_us": [round(float(x), 4) for x in samples],
                    }
                )
        shapes.append({"batch": b, "capacity": b, "results": results})
    return {
        "schema_version": 1,
        "kind": "kvaddr.profile",
        "created_utc": "2026-01-01T00:00:00Z",
        "options": {"batches": list(batches), "model": "deepseek-v3.2"},
        "environment": dict(env or ENV_H200),
        "workload": dict(workload or WORKLOAD),
        "settings": {"device": "cuda", "modes": list(modes), "batches": list(batches)},
        "shapes": shapes,
    }


def as_baseline(*runs, path="base.json"):
    return bl.from_document({"kind": bl.BASELINE_KIND, "baseline_format": 1, "runs": list(runs)}, path)


def test_compare_runs_gives_a_verdict_per_shape_strategy_mode_and_clock():
    rows = compare_runs(make_run(1), make_run(2, scale={"fused": 1.3}), "ds")
    assert len(rows) == 3 * 5
    by = {(r.strategy, r.mode, r.clock): r for r in rows}
    assert by[("fused", "graph", "gpu")].verdict == "slower"
    assert by[("fused", "eager", "host")].verdict == "slower"
    assert by[("hoisted", "graph", "gpu")].verdict == "same"
    # auto gate: graph mode's GPU clock only; the floor never.
    assert [r.gated for r in rows if r.mode == "graph" and r.strategy != "floor"] == [True] * 4
    assert not any(r.gated for r in rows if r.mode == "eager" or r.strategy == "floor")
    s = by[("fused", "graph", "gpu")].sentence()
    assert s.startswith("ds, batch 64: fused, graph mode, GPU clock: slower, x1.3")


def test_gates():
    run = make_run(1, modes=("eager",))
    assert gated_measures("auto", run) == frozenset()  # no graph mode: auto gates nothing
    assert auto_gate_note("auto", run, "ds").startswith("--gate auto gates nothing of run 'ds' (eager mode only")
    assert auto_gate_note("auto", make_run(1), "ds") is None and auto_gate_note("all", run, "ds") is None
    assert gated_measures("auto", make_run(1)) == {("graph", "gpu")}
    assert gated_measures("all", make_run(1)) == {("graph", "gpu"), ("eager", "host"), ("eager", "gpu")}
    assert parse_gate("graph:gpu, eager:host") == {("graph", "gpu"), ("eager", "host")}
    with pytest.raises(ValueError, match="graph:gpu"):
        parse_gate("graph:host")


def test_relative_mode_ratios_carry_across_gpus():
    base = make_run(1)
    slower_gpu = make_run(
        2, env={**ENV_H200, "gpu": {**ENV_H200["gpu"], "name": "NVIDIA H100"}}, scale=dict.fromkeys(MEDIANS, 1.5)
    )
    absolute = compare_baselines(as_baseline(base), as_baseline(slower_gpu))
    assert absolute.stopped and absolute.exit_code == 3
    assert [d.field for _, d in absolute.mismatches] == ["environment.gpu.name"]
    allowed = compare_baselines(as_baseline(base), as_baseline(slower_gpu), allow_env_mismatch=True)
    assert allowed.exit_code == 1 and {r.strategy for r in allowed.slower} == {
        "per-layer",
        "per-layer-kernel",
        "hoisted",
        "fused",
    }
    rel = compare_baselines(as_baseline(base), as_baseline(slower_gpu), relative=True)
    assert not rel.stopped and rel.exit_code == 0
    assert any(d.field == "environment.gpu.name" for _, d in rel.notes)
    quantities = {r.quantity for r in rel.rows}
    assert {"fused / floor", "fused / per-layer", "per-layer / floor", "hoisted / per-layer"} <= quantities
    assert "floor / floor" not in quantities and "per-layer / per-layer" not in quantities
    assert {r.verdict for r in rel.rows if r.gated} == {"same"}
    # A fused step that got slower relative to the floor is caught on the other GPU.
    worse = make_run(3, env=slower_gpu["environment"], scale={**dict.fromkeys(MEDIANS, 1.5), "fused": 2.0})
    rel = compare_baselines(as_baseline(base), as_baseline(worse), relative=True)
    assert rel.exit_code == 1
    assert {r.quantity for r in rel.slower} == {"fused / floor", "fused / per-layer"}


def test_workload_mismatch_stops_even_relative():
    other = make_run(2, workload={**WORKLOAD, "num_layers": 5})
    for relative in (False, True):
        out = compare_baselines(as_baseline(make_run(1)), as_baseline(other), relative=relative)
        assert out.stopped and out.exit_code == 3
        assert [d.describe() for _, d in out.mismatches] == ["workload.num_layers: 61 (baseline) vs 5 (new)"]
    # model_source is prose, not the workload.
    reworded = make_run(2, workload={**WORKLOAD, "model_source": "elsewhere"})
    assert not compare_baselines(as_baseline(make_run(1)), as_baseline(reworded)).stopped


def test_driver_mismatch_and_unknown_fields():
    newer = make_run(2, env={**ENV_H200, "driver_version": "590.1", "git_commit": "bbbb"})
    out = compare_baselines(as_baseline(make_run(1)), as_baseline(newer))
    assert out.stopped and [d.field for _, d in out.mismatches] == ["environment.driver_version"]
    assert [d.field for _, d in out.notes] == ["environment.git_commit"]
    unknown = make_run(2, env={**ENV_H200, "driver_version": None})
    out = compare_baselines(as_baseline(make_run(1)), as_baseline(unknown))
    assert not out.stopped and [d.field for _, d in out.notes] == ["environment.driver_version"]


def test_runs_pair_by_workload_and_unmatched_runs_are_reported():
    glm = make_run(5, workload={**WORKLOAD, "model": "glm-5", "num_layers": 78})
    glm["options"]["model"] = "glm-5"
    base = as_baseline(make_run(1), glm)
    assert base.labels == ["deepseek-v3.2", "glm-5"]
    new = as_baseline(make_run(6, workload={**WORKLOAD, "model": "glm-5", "num_layers": 78}), make_run(2))
    out = compare_baselines(base, new)
    assert not out.stopped and out.exit_code == 0
    assert {r.run for r in out.rows} == {"deepseek-v3.2", "glm-5"}
    only_ds = compare_baselines(base, as_baseline(make_run(2)))
    assert only_ds.stopped and only_ds.mismatches[0][0] == "glm-5"
    extra = compare_baselines(as_baseline(make_run(1)), new)
    assert not extra.stopped and extra.unmatched_new == ["glm-5"]


def test_missing_strategy_is_reported_not_gated_as_slower():
    new = make_run(2)
    for s in new["shapes"]:
        s["results"] = [r for r in s["results"] if r["strategy"] != "hoisted"]
    out = compare_baselines(as_baseline(make_run(1)), as_baseline(new))
    assert out.exit_code == 0
    assert {r.verdict for r in out.rows if r.strategy == "hoisted"} == {"missing"}


# ----------------------------------------------------------------------------- files


def test_save_load_replace_and_add(tmp_path):
    path = str(tmp_path / "b.json")
    assert bl.save_runs(path, [make_run(1)]) == ["added run 1 (deepseek-v3.2)"]
    with open(path) as fh:
        text = fh.read()
    assert '"samples_us": [' in text and "\n" not in text.split('"samples_us": [')[1].split("]")[0]
    loaded = bl.load(path)
    assert loaded.kind == bl.BASELINE_KIND and loaded.runs[0]["shapes"] == make_run(1)["shapes"]
    assert bl.save_runs(path, [make_run(2)]) == ["replaced run 1 (deepseek-v3.2)"]
    glm = make_run(3, workload={**WORKLOAD, "model": "glm-5"})
    assert bl.save_runs(path, [glm]) == ["added run 2 (glm-5)"]
    assert bl.load(path).labels == ["deepseek-v3.2", "glm-5"]
    other = make_run(4, env={**ENV_H200, "gpu": {**ENV_H200["gpu"], "name": "NVIDIA A100"}})
    with pytest.raises(bl.BaselineMismatch) as err:
        bl.save_runs(path, [other])
    assert (
        isinstance(err.value, bl.BaselineError) and "NVIDIA H200" in str(err.value) and "NVIDIA A100" in str(err.value)
    )


def test_a_profile_report_reads_as_a_one_run_baseline(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(make_run(1)))
    b = bl.load(str(path))
    assert b.kind == "kvaddr.profile" and len(b.runs) == 1
    # ... but saving over it is refused: it is not a baseline.
    assert "not a kvaddr baseline" in bl.save_target_problem(str(path))
    with pytest.raises(bl.BaselineError) as err:
        bl.save_runs(str(path), [make_run(1)])
    assert type(err.value) is bl.BaselineError  # a usage error: not a mismatch, not a write failure


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "is not JSON"),
        ('{"kind": "something"}', "neither a kvaddr baseline nor a kvaddr profile report"),
        ('{"kind": "kvaddr.baseline", "baseline_format": 2, "runs": []}', "baseline_format 2"),
        ('{"kind": "kvaddr.baseline", "baseline_format": 1, "runs": []}', "holds no runs"),
        ('{"kind": "kvaddr.profile", "schema_version": 9}', "schema_version 9"),
    ],
)
def test_bad_files_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(bl.BaselineError) as err:
        bl.load(str(path))
    assert type(err.value) is bl.BaselineError and message in str(err.value)  # exit 2 in the commands


def test_a_run_without_samples_is_refused(tmp_path):
    run = make_run(1)
    del run["shapes"][0]["results"][0]["samples_us"]
    with pytest.raises(bl.BaselineError, match="no raw samples"):
        as_baseline(run)
    with pytest.raises(bl.BaselineError, match="no such file"):
        bl.load(str(tmp_path / "missing.json"))


def _with_one_block(doc):
    """A run recorded after one-block joined: the same results plus a one-block row per measure."""
    doc = json.loads(json.dumps(doc))
    for shape in doc["shapes"]:
        extra = [dict(r, strategy="one-block") for r in shape["results"] if r["strategy"] == "fused"]
        shape["results"] = shape["results"] + extra
    return doc


@pytest.mark.parametrize("relative", [False, True])
def test_an_old_baseline_without_one_block_compares_with_a_new_run(relative):
    """Baselines recorded before one-block have no one-block rows: they are 'new', never a failure."""
    old, new = make_run(1), _with_one_block(make_run(2))
    outcome = compare_baselines(as_baseline(old), as_baseline(new, path="new.json"), relative=relative)
    assert not outcome.stopped and outcome.exit_code == 0 and not outcome.slower
    one_block = [r for r in outcome.rows if r.strategy == "one-block"]
    assert one_block and {r.verdict for r in one_block} == {"new"}
    assert all(r.sentence().endswith("(not in the baseline)") for r in one_block)
    assert {r.verdict for r in outcome.rows if r.strategy != "one-block"} <= {"same", "ambiguous"}
    # And the other way round: a new baseline against a run without one-block (a batch over 1024 requests).
    back = compare_baselines(as_baseline(new), as_baseline(old, path="old.json"), relative=relative)
    assert not back.stopped and not back.slower
    assert {r.verdict for r in back.rows if r.strategy == "one-block"} == {"missing"}
