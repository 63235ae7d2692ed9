"""The small-batch step with attention outputs (kvaddr_step1m_c{G}_*, docs/attention.md
"Small batches") on the GPU, against the NumPy reference: mixed batches (hypothesis: idle
requests, chunked-prefill continuations, speculative tokens, L = 0, L a multiple of B, 1-4
caches with different B, non powers of two, bad values, kv_indices capacity overflow), bsz 1,
255, 256 and 257 (the switch to kvaddr_step1wm*), every block count / block width the hooks
make (a warp per request, several requests per warp with the rows loaded again before the
barrier, blocks with only a pad range), every element rewritten (poisoned buffers, pad
values), nothing written past N, graph replay with the inputs' contents changed, a
BoundStep, the timing ablation followed by a clean step, and kernel switches that leave no
stale error record.

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
    check_ablation_then_clean,
    check_bound_step,
    check_graph_replay,
    check_guard_words,
    check_poisoned_buffers,
    step_and_check,
)
from tests.support.attention_gpu import reference as _reference
from tests.support.gpu import requires_gpu, to_device

pytestmark = requires_gpu


def _planner(case, groups=ALL_GROUPS, max_requests=None, **one_meta):
    from kvaddr import StepPlanner

    p = StepPlanner(
        max_requests=max_requests or max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
    )
    if one_meta:
        p._set_one_meta(**one_meta)
    return p


def _step_and_check(p, case, groups, label, *, kernel="kvaddr_step1m_"):
    return step_and_check(p, case, groups, label, kernel=kernel)


@settings(max_examples=80, deadline=None)
@given(
    mixed_cases(max_bsz=40),
    st.sampled_from(GROUP_SUBSETS),
    st.sampled_from([0, 1, 3]),
    st.sampled_from([0, 256]),
)
def test_mixed_batches_match_the_reference(case, groups, blocks, threads):
    p = _planner(case, groups, blocks=blocks, min_threads=threads)
    _step_and_check(p, case, groups, f"{groups}, blocks {blocks}, threads {threads}")


@pytest.mark.parametrize("bsz", [1, 255, 256, 257])
def test_batch_sizes_around_the_switch(bsz):
    """1-4 caches with different B (non powers of two), unallocated pages, narrow rows,
    negative lengths, capacity overflow; 257 requests run kvaddr_step1wm* (v9 across blocks)."""
    rng = np.random.default_rng(bsz)
    kernel = "kvaddr_step1m_" if bsz <= 256 else "kvaddr_step1wm"
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


@pytest.mark.parametrize("pad", [32768, 100])
def test_every_benchmarked_geometry(pad):
    """Metadata blocks per cache (automatic, 1, 5, 32; pad 100: automatic K set by the pad, up to
    32 blocks, some without requests) and block widths (v9's, 256): long rows (B = 1: more
    columns than those loaded before the barrier), several requests per warp (the rows loaded
    again before the barrier)."""
    rng = np.random.default_rng(100 + pad)
    cases = [
        make_case(rng, bsz=64, block_sizes=[1, 3], max_ctx=900, spare_capacity=2),
        make_case(rng, bsz=200, block_sizes=[16], max_ctx=3000, bad="unallocated", spare_capacity=2),
    ]
    for i, case in enumerate(cases):
        for blocks in (0, 1, 5, 32):
            for threads in (0, 256):
                p = _planner(case, blocks=blocks, min_threads=threads)
                p.one_meta_pad_entries = pad
                label = f"case {i}, pad {pad}, blocks {blocks}, threads {threads}"
                _step_and_check(p, case, ALL_GROUPS, label)


def test_poisoned_buffers_are_rewritten_and_nothing_past_n():
    """Every element of every attention buffer (the pad -1 included) is written on every call;
    kv_indices row g + 1 (and guard words in a wider buffer) are never written past N."""
    rng = np.random.default_rng(5)
    shapes = ((1, [4], 9), (64, [64, 64], 40000), (256, [16, 5, 1], 3), (33, [2], None))
    check_poisoned_buffers(_planner, rng, shapes, kernel="kvaddr_step1m_")
    # guard words: one cache whose kv_indices the kernel writes into a wider buffer (entries
    # past N must keep their guard value), over capacity and not
    check_guard_words(_planner, rng, 100, (None, 0, 5), kernel="kvaddr_step1m_")


def test_graph_replay_follows_changing_inputs():
    """A CUDA graph of one compute(), replayed after the inputs' contents change (a bad step
    among clean ones): every output and the error record follow."""
    check_graph_replay(_planner, np.random.default_rng(21), 64, [16, 3], kernel="kvaddr_step1m_c2_i64")


def test_bound_step_runs_the_same_kernels():
    big = make_case(np.random.default_rng(31), bsz=300, block_sizes=[16, 4], spare_capacity=3)
    check_bound_step(_planner, big, (1, 64, 256, 257, 300))


def test_ablations_run_then_a_clean_step_is_exact():
    """The timing ablation (outputs wrong by design) runs without fault; flags = 0 again
    gives the reference's outputs and a clean error record."""
    case = make_case(np.random.default_rng(41), bsz=64, block_sizes=[64, 16], max_ctx=3000, spare_capacity=2)
    check_ablation_then_clean(_planner(case), case, kernel="kvaddr_step1m_")


def test_switching_kernels_leaves_no_stale_error_record():
    """One attention planner: erroneous steps in one kernel (kvaddr_step1m_* with several
    geometries, kvaddr_step_* with metadata blocks, bsz 257), then clean ones in another: the
    clean step's record is clean whichever kernel wrote the previous one."""
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
    geometries = [dict(blocks=0, min_threads=0), dict(blocks=32, min_threads=256)]
    sequence = [
        ("v9", geometries[0], "bad"),
        ("v8", None, "good"),
        ("v8", None, "bad"),
        ("v9", geometries[1], "good"),
        ("v9", geometries[1], "bad"),
        ("v9", geometries[0], "good"),
        ("v9", geometries[0], "big_bad"),
        ("v9", geometries[0], "good"),
        ("v9", geometries[1], "bad"),
        ("v9", geometries[1], "big"),
    ]
    for kernel, geometry, name in sequence:
        p.use_kernel(kernel)
        if geometry:
            p._set_one_meta(**geometry)
        case = cases[name]
        bsz = len(case["seq_lens_decoder"])
        want = "kvaddr_step_" if kernel == "v8" else "kvaddr_step1m_" if bsz <= 256 else "kvaddr_step1wm"
        _step_and_check(p, case, ALL_GROUPS, f"{kernel} {geometry} {name}", kernel=want)


def test_sticky_records_across_step1m_and_v8():
    """Sticky records (docs/spec.md, "Errors") with attention outputs, none read in between: a
    bad step on one kernel (kvaddr_step1m_* in two geometries, kvaddr_step_* with metadata
    blocks), a good one on another, then errors(): the bad step's; two bad steps on two
    kernels: the OR of the bits and the smaller key; then a good step alone: clean."""
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
    geometries = [dict(blocks=0, min_threads=0), dict(blocks=32, min_threads=256)]

    def launch(kernel, geometry, name):
        p.use_kernel(kernel)
        if geometry:
            p._set_one_meta(**geometry)
        dev = to_device(cases[name])
        p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        cupy.cuda.get_current_stream().synchronize()

    runs = [("v9", geometries[0]), ("v9", geometries[1]), ("v8", None)]
    for k1, g1 in runs:
        for k2, g2 in runs:
            label = f"{k1} {g1} then {k2} {g2}"
            launch(k1, g1, "bad")
            launch(k2, g2, "good")
            assert p.errors() == (refs["bad"].error_mask, refs["bad"].error_key), f"{label}: bad, good"
            assert p.errors() == (0, NO_ERROR_KEY), f"{label}: read twice"
            launch(k1, g1, "bad")
            launch(k2, g2, "big_bad")  # (257 requests: kvaddr_step1wm* under v9, kvaddr_step_* under v8)
            want = (
                refs["bad"].error_mask | refs["big_bad"].error_mask,
                min(refs["bad"].error_key, refs["big_bad"].error_key),
            )
            assert p.errors() == want, f"{label}: two bad steps"
            launch(k2, g2, "good")
            assert p.errors() == (0, NO_ERROR_KEY), f"{label}: good alone"
