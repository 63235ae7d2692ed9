"""The toy speculative-decoding loop (tests/support/draft_loop.py) on the CPU: NumPy caches and
attention, the draft addressing from the real VllmDraftPlanner host code with its kernel emulated
(tests/support/vllm_draft_emulator.py). Its GPU twin: tests/gpu/test_vllm_draft_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import vllm_draft_emulator
from tests.support.draft_loop import NumpyOps, run_loop
from tests.support.vllm_fake_cupy import FakeArray

pytestmark = pytest.mark.skipif(vllm_draft_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


class _Ops(NumpyOps):
    def host(self, a):
        return np.array(a.a) if isinstance(a, FakeArray) else np.asarray(a)


@pytest.mark.parametrize(("seed", "k", "B"), [(0, 3, 4), (1, 2, 5), (2, 4, 3), (3, 1, 4)])
def test_draft_loop_reads_back_what_it_wrote(monkeypatch, seed, k, B):
    from kvaddr.engines.vllm_draft import VllmDraftPlanner

    vllm_draft_emulator.install(monkeypatch)
    checks = run_loop(lambda s: VllmDraftPlanner(**s), _Ops(), seed=seed, k=k, B=B, cycles=15, to_device=FakeArray)
    assert checks == (k - 1) * 15 * 9
