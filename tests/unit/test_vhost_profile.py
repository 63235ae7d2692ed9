"""scripts/gpu/vhost_profile.py's timing and attribution, and bench_vllm.py's host_times, on the CPU.

Both time several functions interleaved, sample by sample, the order rotating every sample (each
function in turn first after the queue was drained), with the same number of samples of the same
number of calls for every function; the profile attributes the vLLM - core gap from its rows.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def profile():
    return _load(ROOT / "scripts" / "gpu" / "vhost_profile.py", "vhost_profile_under_test")


@pytest.fixture
def bench_vllm(monkeypatch):
    """benchmarks/bench_vllm.py imported with a stand-in ``cupy`` module (only host_times is used)."""
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    for name in ("bench_step", "bench_vllm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return _load(ROOT / "benchmarks" / "bench_vllm.py", "bench_vllm_under_test")


class Log:
    """Functions that record their calls in one shared log, and a drain that records itself."""

    def __init__(self):
        self.log = []

    def fn(self, name):
        return lambda: self.log.append(name)

    def drain(self):
        self.log.append("|")


def _samples(log: list) -> list:
    """The log after the warm-up, cut into runs of one function's calls (the drains dropped)."""
    runs, last = [], None
    for x in log:
        if x == "|":
            last = None
            continue
        if x != last:
            runs.append(x)
            last = x
    return runs


def test_time_rows_interleaves_rotates_and_drains_only_launching_rows(profile):
    L = Log()
    rows = {"a": (L.fn("a"), True), "b": (L.fn("b"), False), "c": (L.fn("c"), True)}
    res = profile.time_rows(rows, calls=4, samples=6, drain=L.drain)
    warm = L.log[: L.log.index("|") + 1]
    assert warm == ["a", "b", "c", "|"]  # one call each, then drained
    body = L.log[len(warm) :]
    assert [body.count(k) for k in "abc"] == [24, 24, 24]  # the same calls for every row
    order = _samples(body)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] * 2  # rotated: each first in turn
    # a drain after each sample of a launching row, none after the others
    for i, x in enumerate(body):
        if x != "|":
            continue
        assert body[i - 1] in "ac"
    assert body.count("|") == 2 * 6
    for k in "abc":
        v = res[k]
        assert len(v["samples"]) == 6 and v["best"] == min(v["samples"])
        assert v["best"] <= v["median"] <= max(v["samples"])
    assert res["b"]["drain_max"] is None and res["a"]["drain_max"] >= 0


def test_attribution_arithmetic(profile):
    med = {
        "vLLM compute()": 7.5,
        "core compute()": 6.0,
        "vLLM compute(), no driver": 2.0,
        "core compute(), no driver": 1.2,
        "vLLM raw launch": 4.6,
        "core raw launch": 4.4,
        "empty kernel 392 B, 1 block": 3.9,
        "empty kernel 272 B, 1 block": 3.8,
        "empty kernel 392 B, v2's grid": 3.95,
        "vLLM memo guard": 0.9,
        "core memo guard": 0.5,
        "signature: table": 0.15,
    }
    res = {k: dict(median=v, best=v, samples=[v], drain_max=None) for k, v in med.items()}
    got = {label.strip(): (value, unit) for label, value, unit in profile.attribute(res, extra_arrays=3)}
    assert got["vLLM - core: compute() (the gap)"] == pytest.approx((1.5, "us"))
    assert got["of which Python (no-driver rows)"][0] == pytest.approx(0.8)
    assert got["of which driver (raw launches)"][0] == pytest.approx(0.2)
    assert got["the rest (gap - Python - driver)"][0] == pytest.approx(0.5)
    assert got["driver: parameter block 392 B vs 272 B"][0] == pytest.approx(0.1)
    assert got["driver: v2's grid vs 1 block"][0] == pytest.approx(0.05)
    assert got["Python: memo guard, vLLM - core"][0] == pytest.approx(0.4)
    assert got["Python: 3 more distinct arrays x one table's signature"][0] == pytest.approx(0.45)
    assert got["core compute() - core raw launch (its Python, real)"][0] == pytest.approx(1.6)
    assert got["v2/core (target <= 1.2)"] == pytest.approx((1.25, "x"))
    text = profile.format_table("title", res, profile.attribute(res, extra_arrays=3))
    assert text.splitlines()[0] == "title" and "v2/core (target <= 1.2)" in text and "+1.500 us" in text
    # rows missing: only what can be computed
    part = profile.attribute({k: res[k] for k in ("vLLM compute()", "core compute()")})
    assert [label for label, _, _ in part] == ["vLLM - core: compute() (the gap)", "v2/core (target <= 1.2)"]


def test_bench_host_times_interleaved_rotated_same_samples(bench_vllm):
    L = Log()
    calls = {"one": L.fn("one"), "old": L.fn("old"), "core": L.fn("core")}
    stream = types.SimpleNamespace(synchronize=L.drain)
    best = {}
    med = bench_vllm.host_times(calls, stream, 5, 7, best=best)
    body = L.log[L.log.index("|") + 1 :]
    assert [body.count(k) for k in calls] == [35, 35, 35]
    runs = _samples(body)
    assert runs[:9] == ["one", "old", "core", "old", "core", "one", "core", "one", "old"]
    assert body.count("|") == 3 * 7  # drained after every sample of every function
    firsts = runs[::3]
    assert sorted(firsts.count(k) for k in calls) == [2, 2, 3]  # each first in turn
    assert set(med) == set(best) == set(calls) and all(best[k] <= med[k] for k in calls)
