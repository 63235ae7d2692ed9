"""v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*, docs/attention.md "Batches
of 257 to 4096") on the GPU, against the NumPy reference: mixed batches routed there from one
request on (hypothesis: idle requests, chunked-prefill continuations, speculative tokens, L = 0,
L a multiple of B, 1-4 caches with different B, non powers of two, bad values, kv_indices
capacity overflow; blocks of 1 to 4 warps, R = 4, 8, 16, 1 to 64 pad blocks), the sizes the
planner sends there (257, 1000, 2049, 4096; R = 4, T up to 1024, and R forced to 16), unaligned length arrays
(scalar loads), block ids near 2^31, every element rewritten (poisoned buffers), nothing written
past N, graph replay with the inputs' contents changed, a BoundStep, the timing ablation
followed by a clean step, and 4097 requests on kvaddr_step_*.

Skips, with the reason, without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.attention_gpu import (
    GROUP_SUBSETS,
    check_ablation_then_clean,
    check_bound_step,
    check_graph_replay,
    check_guard_words,
    check_poisoned_buffers,
    step_and_check,
)
from tests.support.attention_gpu import reference as _reference
from tests.support.gpu import assert_attention_equal, assert_outputs_equal, requires_gpu, to_device

pytestmark = requires_gpu


def _planner(case, groups=ALL_GROUPS, *, per_thread=0, threads=None, small=False, max_requests=None):
    """A planner for ``case`` whose batches past the small-batch kernel run kvaddr_step1wm* (from
    one request on when ``small``), R = ``per_thread`` (0: chosen), block aim ``threads``."""
    from kvaddr import StepPlanner

    p = StepPlanner(
        max_requests=max_requests or max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
    )
    if threads is not None:
        p.wide_meta_threads = threads
    p.use_kernel("v9", max_requests=0 if small else None, wide_per_thread=per_thread)
    return p


def _step_and_check(p, case, groups, label, *, kernel="kvaddr_step1wm"):
    return step_and_check(p, case, groups, label, kernel=kernel)


@settings(max_examples=min(60, int(os.environ.get("KVADDR_GPU_EXAMPLES", "60"))), deadline=None)
@given(
    mixed_cases(max_bsz=70),
    st.sampled_from(GROUP_SUBSETS),
    st.sampled_from([0, 4, 16]),
    st.sampled_from([32, 128]),
    st.sampled_from([32768, 7]),
    st.sampled_from([0, 16]),
)
def test_mixed_batches_match_the_reference(case, groups, per_thread, threads, pad, flags):
    if len(case["seq_lens_decoder"]) == 0:
        return  # (bsz 0 runs the small-batch kernel)
    p = _planner(case, groups, per_thread=per_thread, threads=threads, small=True)
    p.one_meta_pad_entries = pad
    p._set_one_meta(flags=flags)  # 16: row loads bounded by the pages (same outputs)
    label = f"{groups}, R {per_thread}, aim {threads}, pad {pad}, flags {flags}"
    _step_and_check(p, case, groups, label, kernel="kvaddr_step1wm")


@pytest.mark.parametrize("bsz", [257, 1000, 2049, 4096])
@pytest.mark.parametrize("per_thread", [0, 8, 16])
def test_batch_sizes_the_planner_sends_there(bsz, per_thread):
    """1-4 caches with different B (non powers of two), rows longer than the columns loaded
    before the barrier (B = 1), unallocated pages, narrow rows, negative lengths, capacity
    overflow; R = 4 (the default) at 4096 requests is T = 1024 (32 warps)."""
    rng = np.random.default_rng(bsz + per_thread)
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
            for flags in (0, 16) if per_thread == 0 else (0,):  # 16: row loads bounded by the pages
                p = _planner(case, groups, per_thread=per_thread)
                p._set_one_meta(flags=flags)
                label = f"bsz {bsz}, R {per_thread}, case {i}, {groups}, flags {flags}"
                _step_and_check(p, case, groups, label, kernel="kvaddr_step1wm")


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
    check_poisoned_buffers(_planner, rng, shapes, kernel="kvaddr_step1wm")
    # guard words past N, with several pad blocks (a large pad)
    check_guard_words(_planner, rng, 700, (None, 0, 5, 70000), kernel="kvaddr_step1wm", pad_entries=1000)


def test_graph_replay_follows_changing_inputs():
    check_graph_replay(_planner, np.random.default_rng(63), 1000, [16, 3], kernel="kvaddr_step1wm4_c2_i64")


def test_bound_step_and_the_ablation():
    big = make_case(np.random.default_rng(64), bsz=1500, block_sizes=[16, 4], spare_capacity=3)
    p = check_bound_step(_planner, big, (1, 256, 257, 1000, 1500))
    check_ablation_then_clean(p, big, kernel="kvaddr_step1wm")


def test_past_4096_requests_runs_the_multi_block_kernel():
    rng = np.random.default_rng(65)
    case = make_case(rng, bsz=4097, block_sizes=[16, 5], spare_capacity=3)
    p = _planner(case)
    _step_and_check(p, case, ALL_GROUPS, "4097", kernel="kvaddr_step_")
