"""The small-batch step with attention outputs (``step_small_attention``, docs/attention.md
"Small batches") on the GPU, against the NumPy reference: mixed batches (hypothesis: idle
requests, chunked-prefill continuations, speculative tokens, L = 0, L a multiple of B, 1-4
caches with different B, non powers of two, bad values, kv_indices capacity overflow), bsz 1,
255, 256 and 257 (the switch to ``step_wide_attention``), long rows (more columns than those
loaded before the barrier), a planner sized for more requests than the batch, every element
rewritten (poisoned buffers, pad values), nothing written past N, graph replay with the inputs'
contents changed, a BoundStep, and kernel switches (the multi-block kernel forced on the same
planner) that leave no stale error record.

Skips, with the reason, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.attention_gpu import (
    GROUP_SUBSETS,
    check_bound_step,
    check_graph_replay,
    check_guard_words,
    check_poisoned_buffers,
    step_and_check,
)
from tests.support.attention_gpu import reference as _reference
from tests.support.gpu import force_multiblock, requires_gpu, to_device

pytestmark = requires_gpu

SMALL = "step_small_attention"


def _planner(case, groups=ALL_GROUPS, max_requests=None):
    from kvaddr import StepPlanner

    return StepPlanner(
        max_requests=max_requests or max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
    )


def _step_and_check(p, case, groups, label, *, kernel=SMALL):
    return step_and_check(p, case, groups, label, kernel=kernel)


@settings(max_examples=80, deadline=None)
@given(mixed_cases(max_bsz=40), st.sampled_from(GROUP_SUBSETS), st.sampled_from([None, 256, 5000]))
def test_mixed_batches_match_the_reference(case, groups, max_requests):
    p = _planner(case, groups, max_requests)
    _step_and_check(p, case, groups, f"{groups}, max_requests {max_requests}")


@pytest.mark.parametrize("bsz", [1, 255, 256, 257])
def test_batch_sizes_around_the_switch(bsz):
    """1-4 caches with different B (non powers of two), unallocated pages, narrow rows,
    negative lengths, capacity overflow; 257 requests run the across-blocks kernel."""
    rng = np.random.default_rng(bsz)
    kernel = SMALL if bsz <= 256 else "step_wide_attention"
    cases = [
        make_case(rng, bsz=bsz, block_sizes=[16], spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[1, 4], max_ctx=700, spare_capacity=0),
        make_case(rng, bsz=bsz, block_sizes=[16, 5, 3], bad="unallocated", spare_capacity=2),
        make_case(rng, bsz=bsz, block_sizes=[2, 64, 7, 1], bad="narrow-row", spare_capacity=1),
        make_case(rng, bsz=bsz, block_sizes=[64, 3], bad="negative-length", spare_capacity=None),
    ]
    cases.append(dict(cases[1], kv_indices_capacity=max(1, cases[1]["kv_indices_capacity"] * 2 // 3)))
    for i, case in enumerate(cases):
        p = _planner(case)
        _step_and_check(p, case, ALL_GROUPS, f"bsz {bsz}, case {i}", kernel=kernel)


def test_long_rows_and_a_large_pad():
    """Long rows (B = 1: more columns than those loaded before the barrier), a large kv_indices
    (several pad blocks per cache), capacity over and under the pages."""
    rng = np.random.default_rng(100)
    cases = [
        make_case(rng, bsz=64, block_sizes=[1, 3], max_ctx=900, spare_capacity=2),
        make_case(rng, bsz=200, block_sizes=[16], max_ctx=3000, bad="unallocated", spare_capacity=2),
        make_case(rng, bsz=20, block_sizes=[4], spare_capacity=200000),
    ]
    for i, case in enumerate(cases):
        _step_and_check(_planner(case), case, ALL_GROUPS, f"case {i}")


def test_poisoned_buffers_are_rewritten_and_nothing_past_n():
    """Every element of every attention buffer (the pad -1 included) is written on every call;
    kv_indices row g + 1 (and guard words in a wider buffer) are never written past N."""
    rng = np.random.default_rng(5)
    shapes = ((1, [4], 9), (64, [64, 64], 40000), (256, [16, 5, 1], 3), (33, [2], None))
    check_poisoned_buffers(_planner, rng, shapes, kernel=SMALL)
    # guard words: one cache whose kv_indices the kernel writes into a wider buffer (entries
    # past N must keep their guard value), over capacity and not
    check_guard_words(_planner, rng, 100, (None, 0, 5), kernel=SMALL)


def test_graph_replay_follows_changing_inputs():
    """A CUDA graph of one compute(), replayed after the inputs' contents change (a bad step
    among clean ones): every output and the error record follow."""
    check_graph_replay(_planner, np.random.default_rng(21), 64, [16, 3], kernel=SMALL)


def test_bound_step_runs_the_same_kernels():
    big = make_case(np.random.default_rng(31), bsz=300, block_sizes=[16, 4], spare_capacity=3)
    check_bound_step(_planner, big, (1, 64, 256, 257, 300))


def test_switching_kernels_leaves_no_stale_error_record():
    """One attention planner: erroneous steps on one kernel (the small kernel, the across-blocks
    kernel at 257 requests, the multi-block kernel forced), then clean ones on another: the clean
    step's record is clean whichever kernel wrote the previous one."""
    rng = np.random.default_rng(51)
    sizes = [16, 5]
    bad = make_case(rng, bsz=200, block_sizes=sizes, bad="unallocated", spare_capacity=None)
    bad["seq_lens_decoder"][199] = -1  # the last request (the last warp) too
    good = make_case(rng, bsz=200, block_sizes=sizes, spare_capacity=2)
    big_bad = make_case(rng, bsz=257, block_sizes=sizes, bad="narrow-row", spare_capacity=2)
    big = make_case(rng, bsz=257, block_sizes=sizes, spare_capacity=2)
    cap = max(c["capacity"] for c in (bad, good, big_bad, big))
    N = max(c["kv_indices_capacity"] for c in (bad, good, big_bad, big))
    cases = {
        k: dict(c, capacity=cap, kv_indices_capacity=N)
        for k, c in dict(bad=bad, good=good, big_bad=big_bad, big=big).items()
    }
    p = _planner(cases["good"], max_requests=257)
    sequence = [
        ("dispatch", "bad"),
        ("multiblock", "good"),
        ("multiblock", "bad"),
        ("dispatch", "good"),
        ("dispatch", "big_bad"),
        ("dispatch", "good"),
        ("multiblock", "big_bad"),
        ("dispatch", "big"),
    ]
    for kernel, name in sequence:
        force_multiblock(p, kernel == "multiblock")
        case = cases[name]
        bsz = len(case["seq_lens_decoder"])
        want = "step_multiblock" if kernel == "multiblock" else SMALL if bsz <= 256 else "step_wide_attention"
        _step_and_check(p, case, ALL_GROUPS, f"{kernel} {name}", kernel=want)


def test_sticky_records_across_kernels():
    """Sticky records (docs/spec.md, "Errors") with attention outputs, none read in between: a
    bad step on one kernel (the table's, or the multi-block kernel forced), a good one on another,
    then errors(): the bad step's; two bad steps on two kernels: the OR of the bits and the
    smaller key; then a good step alone: clean."""
    import cupy

    from kvaddr.errors import NO_ERROR_KEY

    rng = np.random.default_rng(52)
    sizes = [16, 5]
    bad = make_case(rng, bsz=200, block_sizes=sizes, bad="unallocated", spare_capacity=None)
    good = make_case(rng, bsz=200, block_sizes=sizes, spare_capacity=2)
    big_bad = make_case(rng, bsz=257, block_sizes=sizes, bad="narrow-row", spare_capacity=2)
    cap = max(c["capacity"] for c in (bad, good, big_bad))
    N = max(c["kv_indices_capacity"] for c in (bad, good, big_bad))
    cases = {
        k: dict(c, capacity=cap, kv_indices_capacity=N) for k, c in dict(bad=bad, good=good, big_bad=big_bad).items()
    }
    refs = {k: _reference(c) for k, c in cases.items()}
    assert refs["bad"].error_mask and refs["big_bad"].error_mask and not refs["good"].error_mask
    p = _planner(cases["good"], max_requests=257)

    def launch(kernel, name):
        force_multiblock(p, kernel == "multiblock")
        dev = to_device(cases[name])
        p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        cupy.cuda.get_current_stream().synchronize()

    runs = ("dispatch", "multiblock")
    for k1 in runs:
        for k2 in runs:
            label = f"{k1} then {k2}"
            launch(k1, "bad")
            launch(k2, "good")
            assert p.errors() == (refs["bad"].error_mask, refs["bad"].error_key), f"{label}: bad, good"
            assert p.errors() == (0, NO_ERROR_KEY), f"{label}: read twice"
            launch(k1, "bad")
            launch(k2, "big_bad")  # (257 requests: the across-blocks kernel, or the multi-block one)
            want = (
                refs["bad"].error_mask | refs["big_bad"].error_mask,
                min(refs["bad"].error_key, refs["big_bad"].error_key),
            )
            assert p.errors() == want, f"{label}: two bad steps"
            launch(k2, "good")
            assert p.errors() == (0, NO_ERROR_KEY), f"{label}: good alone"
