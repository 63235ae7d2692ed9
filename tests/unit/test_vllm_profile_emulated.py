"""run_vllm_profile end to end on the CPU: the fake GPU of the profiler's tests, with the
vLLM kernels emulated (tests/support/vllm_emulator.py), so the check-then-time flow, graph
capture of the planner and of the three launches, and the report all run for real."""

from __future__ import annotations

import io

import pytest

from kvaddr.measure.timing import Budget
from tests.support import vllm_emulator

pytestmark = pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


def test_profile_checks_then_times_both_and_reports(emulated_gpu):
    from rich.console import Console

    from kvaddr.measure.vllm_profile import (
        BOUND,
        FRESH,
        ONE,
        THREE,
        VllmProfileOptions,
        render_vllm,
        run_vllm_profile,
        savings,
        vllm_document,
    )

    opts = VllmProfileOptions(
        shapes=("decode:16", "mixed:8:64"), block_sizes=(16, 64), dummy_fraction=0.25, context=(10, 200), input_sets=2
    )
    results = run_vllm_profile(opts, budget=Budget(seconds=0.0, min_samples=2, max_samples=2))
    assert [r.shape for r in results] == ["decode:16", "mixed:8:64"]
    for r in results:
        assert r.checks["status"] == "passed"
        got = {(m.strategy, m.mode, m.clock) for m in r.measurements}
        for name in (ONE, THREE):
            assert {(name, "graph", "gpu"), (name, "eager", "host"), (name, "eager", "gpu")} <= got
        for name in (BOUND, FRESH):  # the host paths beside compute(): eager only, checked first
            assert {(name, "eager", "host"), (name, "eager", "gpu")} <= got
            assert (name, "graph", "gpu") not in got
        launches = {m.strategy: m.launches_per_step for m in r.measurements}
        assert launches[ONE] == 1 and launches[THREE] == 3 and launches[BOUND] == launches[FRESH] == 1
        assert len(savings(r)) == 3
    doc = vllm_document(results, opts, {"device": "cuda"})
    assert doc["shapes"][1]["input_sets"][0]["dummies"] == 2
    buf = io.StringIO()
    render_vllm(Console(file=buf, width=160), results, opts)
    assert "vLLM mixed:8:64" in buf.getvalue()


def test_profile_stops_on_a_wrong_result(emulated_gpu, monkeypatch):
    from kvaddr.measure.correctness import CheckFailed
    from kvaddr.measure.vllm_profile import VllmProfileOptions, run_vllm_profile
    from kvaddr.strategies import vllm_three_launch

    real = vllm_three_launch.VllmThreeLaunch.compute

    def broken(self, *args, **kw):
        out = real(self, *args, **kw)
        out.positions.a[0] += 1
        return out

    monkeypatch.setattr(vllm_three_launch.VllmThreeLaunch, "compute", broken)
    with pytest.raises(
        CheckFailed, match=r"vllm-three-launch \(eager, decode:16, input set 0\) differs .*positions\[0\]"
    ):
        run_vllm_profile(VllmProfileOptions(shapes=("decode:16",), input_sets=1), budget=Budget(seconds=0.0))
