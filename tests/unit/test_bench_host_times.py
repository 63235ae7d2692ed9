"""benchmarks/bench_vllm.py's host_times on the CPU: several functions timed interleaved, sample by
sample, the order rotating every sample (each function in turn first after the queue was drained),
with the same number of samples of the same number of calls for every function.
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
