"""The across-blocks step with attention outputs (``step_wide_attention``, docs/attention.md
"Batches of 257 to 4096") on the GPU, against the NumPy reference: mixed batches of the sizes the
dispatch table sends there (hypothesis: idle requests, chunked-prefill continuations, speculative
tokens, L = 0, L a multiple of B, 1-4 caches with different B, non powers of two, bad values,
kv_indices capacity overflow), 257, 1000, 2049 and 4096 requests (T up to 1024), unaligned length
arrays (scalar loads), block ids near 2^31, every element rewritten (poisoned buffers), nothing
written past N (several pad blocks too), graph replay with the inputs' contents changed, a
BoundStep, and 4097 requests on the multi-block kernel.

Skips, with the reason, without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.attention_cases import ALL_GROUPS, BLOCK_SIZES, make_case
from tests.support.attention_gpu import (
    GROUP_SUBSETS,
    check_bound_step,
    check_graph_replay,
    check_guard_words,
    check_poisoned_buffers,
    step_and_check,
)
from tests.support.attention_gpu import reference as _reference
from tests.support.gpu import assert_attention_equal, assert_outputs_equal, requires_gpu, to_device

pytestmark = requires_gpu

WIDE = "step_wide_attention"


def _planner(case, groups=ALL_GROUPS, max_requests=None):
    from kvaddr import StepPlanner

    return StepPlanner(
        max_requests=max_requests or max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
    )


def _step_and_check(p, case, groups, label, *, kernel=WIDE):
    return step_and_check(p, case, groups, label, kernel=kernel)


@settings(max_examples=min(60, int(os.environ.get("KVADDR_GPU_EXAMPLES", "60"))), deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([257, 300, 511, 513, 1025, 3000]),
    st.sampled_from(GROUP_SUBSETS),
    st.lists(st.sampled_from(BLOCK_SIZES), min_size=1, max_size=4),
    st.sampled_from(["none", "negative-length", "unallocated", "narrow-row"]),
    st.sampled_from([None, 0, 3, 40000]),
    st.sampled_from([None, 4096]),
)
def test_mixed_batches_match_the_reference(seed, bsz, groups, sizes, bad, spare, max_requests):
    rng = np.random.default_rng(seed)
    case = make_case(rng, bsz=bsz, block_sizes=sizes, bad=bad, spare_capacity=spare, max_ctx=300)
    p = _planner(case, groups, max_requests)
    _step_and_check(p, case, groups, f"{groups}, bsz {bsz}, {sizes}, {bad}, spare {spare}")


@pytest.mark.parametrize("bsz", [257, 1000, 2049, 4096])
def test_batch_sizes_the_planner_sends_there(bsz):
    """1-4 caches with different B (non powers of two), rows longer than the columns loaded
    before the barrier (B = 1), unallocated pages, narrow rows, negative lengths, capacity
    overflow; 4096 requests run blocks of 1024 threads (32 warps)."""
    rng = np.random.default_rng(bsz)
    cases = [
        make_case(rng, bsz=bsz, block_sizes=[16], spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[1, 4], max_ctx=700, spare_capacity=0),
        make_case(rng, bsz=bsz, block_sizes=[16, 5, 3], bad="unallocated", spare_capacity=2),
        make_case(rng, bsz=bsz, block_sizes=[2, 64, 7, 1], bad="narrow-row", spare_capacity=1),
        make_case(rng, bsz=bsz, block_sizes=[64, 3], bad="negative-length", spare_capacity=None),
    ]
    cases.append(dict(cases[1], kv_indices_capacity=max(1, cases[1]["kv_indices_capacity"] * 2 // 3)))
    for i, case in enumerate(cases):
        subsets = (ALL_GROUPS, ("varlen",), ("page_table",), ("flashinfer",)) if i in (0, 2) else (ALL_GROUPS,)
        for groups in subsets:
            p = _planner(case, groups)
            _step_and_check(p, case, groups, f"bsz {bsz}, case {i}, {groups}")


def test_unaligned_lengths_and_block_ids_near_2_31():
    """Length arrays one element into their buffers (not 16-byte aligned: the scalar loads) and
    block ids within 2^20 of 2^31 - 1 (copied as they are into kv_indices)."""
    import cupy

    rng = np.random.default_rng(61)
    for bsz in (300, 1000):
        case = make_case(rng, bsz=bsz, block_sizes=[16, 5], max_ctx=900, spare_capacity=3)
        for t in case["block_tables"]:
            t[t >= 0] += 2**31 - 1 - 2**20
        p = _planner(case)
        dev = to_device(case)
        d = cupy.zeros(bsz + 1, np.int32)
        q = cupy.zeros(bsz + 1, np.int32)
        d[1:] = dev["seq_lens_decoder"]
        q[1:] = dev["seq_lens_this_time"]
        out = p.compute(d[1:], q[1:], dev["block_tables"])
        cupy.cuda.get_current_stream().synchronize()
        ref = _reference(case)
        assert_attention_equal(out.attention, ref.outputs.attention, f"unaligned, bsz {bsz}")
        assert_outputs_equal(out, ref.outputs, f"unaligned, bsz {bsz}: addressing")
        assert p.errors() == (ref.error_mask, ref.error_key), f"unaligned, bsz {bsz}"


def test_poisoned_buffers_are_rewritten_and_nothing_past_n():
    rng = np.random.default_rng(62)
    shapes = ((257, [4], 9), (1000, [64, 64], 40000), (2049, [16, 5, 1], 3), (600, [2], None))
    check_poisoned_buffers(_planner, rng, shapes, kernel=WIDE)
    # guard words past N, with several pad blocks (a large pad)
    check_guard_words(_planner, rng, 700, (None, 0, 5, 70000), kernel=WIDE)


def test_graph_replay_follows_changing_inputs():
    check_graph_replay(_planner, np.random.default_rng(63), 1000, [16, 3], kernel=WIDE)


def test_bound_step_runs_the_same_kernels():
    big = make_case(np.random.default_rng(64), bsz=1500, block_sizes=[16, 4], spare_capacity=3)
    check_bound_step(_planner, big, (1, 256, 257, 1000, 1500))


def test_past_4096_requests_runs_the_multi_block_kernel():
    rng = np.random.default_rng(65)
    case = make_case(rng, bsz=4097, block_sizes=[16, 5], spare_capacity=3)
    p = _planner(case)
    _step_and_check(p, case, ALL_GROUPS, "4097", kernel="step_multiblock")
