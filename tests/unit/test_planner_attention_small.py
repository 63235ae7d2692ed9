"""The small-batch step with attention outputs (``step_small_attention``, docs/attention.md "Small
batches") on the CPU: through tests/support/meta_small_model.py (a line-by-line model of its
metadata blocks reading the launch's KvStepParams and geometry), the outputs and error records
against the NumPy reference at the batch sizes the dispatch table sends there. The kernel itself
runs in tests/gpu/test_attention_one_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.attention_cases import ALL_GROUPS
from tests.unit.test_planner_attention import _planner, compute_and_check, fake_planner, hard_cases  # noqa: F401 (a fixture)


@pytest.mark.parametrize("bsz", [1, 33, 255, 256])
def test_wide_batches_long_rows_and_overflow(fake_planner, bsz):  # noqa: F811
    """Several warps (absolute prefixes across warp totals), rows longer than the columns
    loaded before the barrier (B = 1), unallocated pages, narrow rows, negative lengths,
    kv_indices capacity overflow, 1-3 caches with different B; a planner sized for more
    requests than the batch (the same kernel up to 256 requests)."""
    StepPlanner, launches, _ = fake_planner
    cases = hard_cases(np.random.default_rng(bsz), bsz, [1, 4])
    for i, case in enumerate(cases):
        for max_requests in (None, 5000):
            for groups in (ALL_GROUPS, ("varlen",), ("page_table",)):
                planner = _planner(StepPlanner, case, groups, max_requests)
                label = f"case {i}, {groups}, max_requests {max_requests}"
                compute_and_check(planner, launches, case, groups, label, family="step_small_attention")
