"""The across-blocks step with attention outputs (``step_wide_attention``, docs/attention.md
"Batches of 257 to 4096") on the CPU: through tests/support/meta_wide_model.py (a line-by-line
model of its metadata blocks reading the launch's KvStepParams and geometry), the outputs and
error records against the NumPy reference at the batch sizes the dispatch table sends there.
The kernel itself runs in tests/gpu/test_attention_wide_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.attention_cases import ALL_GROUPS, make_case
from tests.unit.test_planner_attention import _planner, compute_and_check, fake_planner, hard_cases  # noqa: F401 (a fixture)


@pytest.mark.parametrize("bsz", [257, 1000, 2049])
def test_batches_past_256_long_rows_and_bad_values(fake_planner, bsz):  # noqa: F811
    """Rows longer than the columns loaded before the barrier (B = 1), unallocated pages,
    narrow rows, negative lengths, kv_indices overflow, 1-3 caches with different B
    (non-powers of two)."""
    StepPlanner, launches, _ = fake_planner
    cases = hard_cases(np.random.default_rng(bsz * 17), bsz, [1, 16])
    for i, case in enumerate(cases):
        for groups in (ALL_GROUPS, ("varlen",), ("page_table",)):
            planner = _planner(StepPlanner, case, groups)
            label = f"case {i}, {groups}"
            compute_and_check(planner, launches, case, groups, label, family="step_wide_attention")


def test_4096_requests_two_caches(fake_planner):  # noqa: F811
    """The largest batch of the kernel: blocks of 1024 threads."""
    StepPlanner, launches, _ = fake_planner
    case = make_case(np.random.default_rng(4096), bsz=4096, block_sizes=[16, 64], max_ctx=300, spare_capacity=5)
    planner = _planner(StepPlanner, case, ALL_GROUPS)
    assert planner.kernel_for(4096)[2] == 1024
    compute_and_check(planner, launches, case, ALL_GROUPS, "4096 x 2 caches", family="step_wide_attention")
