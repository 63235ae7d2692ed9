"""The toy MTP draft loop on the GPU (tests/support/mtp_e2e.py): StepPlanner addresses the verify
step (``compute``) and every draft substep in one launch (``compute_draft_steps``); PyTorch
caches and ``scaled_dot_product_attention``: attention over what each substep reads back through
its metadata equals attention over the contiguous K/V, and no draft write leaves its request's
blocks. Skips without a GPU or without PyTorch. The CPU twin is tests/unit/test_mtp_e2e.py."""

from __future__ import annotations

import pytest

from tests.support.gpu import requires_gpu
from tests.support.mtp_e2e import run_mtp_e2e
from tests.support.paged_attention import TorchBackend

pytestmark = requires_gpu

GROUPS = "flashinfer,varlen,page_table"


def _planner_fns(k, sizes, num_requests):
    import cupy

    from kvaddr import StepPlanner

    C = num_requests * (k + 1)
    p = StepPlanner(num_requests, C, list(sizes), attention=GROUPS, kv_indices_capacity=8192, draft_steps=k)

    def verify(dec, q, tables):
        out = p.compute(cupy.asarray(dec), cupy.asarray(q), [cupy.asarray(t) for t in tables])
        p.check()  # synchronises: torch reads the outputs next
        return out

    def draft(dec, acc, tables):
        out = p.compute_draft_steps(cupy.asarray(dec), cupy.asarray(acc), [cupy.asarray(t) for t in tables])
        p.check()
        return [out.substep(j) for j in range(k)]

    return verify, draft


@pytest.mark.parametrize(("k", "sizes", "num_requests"), [(3, (4, 3), 7), (1, (16,), 5), (4, (64, 5), 40)])
def test_draft_loop_on_the_gpu(k, sizes, num_requests):
    pytest.importorskip("torch", reason="PyTorch is not installed: the end-to-end MTP test needs SDPA")
    verify, draft = _planner_fns(k, sizes, num_requests)
    rep = run_mtp_e2e(
        verify, draft, k=k, block_sizes=sizes, num_requests=num_requests, cycles=6, backend=TorchBackend()
    )
    assert rep.ok, rep.failures[:5]
