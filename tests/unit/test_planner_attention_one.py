"""The small-batch step with attention outputs (kvaddr_step1m_c{G}_*, docs/attention.md "Small
batches") on the CPU: the planner's selection and geometry, the error-record sizing, the
benchmark hooks, and, through tests/support/meta_one_model.py (a line-by-line model of
kernels.cu's kv_meta_one reading the launch's KvStepParams and geometry), the outputs and
error records against the NumPy reference. The kernel itself runs in
tests/gpu/test_attention_one_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr import kernel_loader
from kvaddr.errors import NO_ERROR_KEY
from kvaddr.reference import step_addressing
from tests.support import meta_kernel_model
from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.meta_one_model import run_meta_one
from tests.support.meta_wide_model import run_meta_wide
from tests.unit.test_planner_attention import GROUPS, _dev, _reference, fake_planner  # noqa: F401 (a fixture)


@pytest.fixture
def one_planner(fake_planner, monkeypatch):  # noqa: F811
    """(StepPlanner, launches): launches record (kernel, grid, threads, metadata records)."""
    StepPlanner, _, _ = fake_planner
    monkeypatch.setattr(StepPlanner, "one_block_attention", True)
    launches = []

    class Launcher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args

        def __call__(self, grid, block, stream):
            P = self.args
            bsz = P.bsz
            dec = meta_kernel_model._view(P.seq_lens_decoder, bsz)
            q = meta_kernel_model._view(P.seq_lens_this_time, bsz)
            ref = step_addressing(dec.copy(), q.copy(), [np.zeros((max(bsz, 1), 1), np.int32)], [1], P.capacity)
            meta_kernel_model._view(P.cu_seqlens_q, bsz + 1)[:] = ref.outputs.cu_seqlens_q
            meta_kernel_model._view(P.seq_lens_kv, bsz)[:] = ref.outputs.seq_lens_kv
            if self.fn.startswith("kvaddr_step1m_"):
                records = run_meta_one(P, grid, block, P.num_caches)
            elif self.fn.startswith("kvaddr_step1wm"):
                r = int(self.fn[len("kvaddr_step1wm") :].split("_")[0])
                records = run_meta_wide(P, grid, block, P.num_caches, r)
            else:
                records = meta_kernel_model.run_meta_blocks2(P)
            launches.append((self.fn, grid, block, records))

    monkeypatch.setattr(kernel_loader, "Launcher", Launcher)
    return StepPlanner, launches


def _planner(StepPlanner, case, groups, **kw):
    return StepPlanner(
        max(len(case["seq_lens_decoder"]), 1),
        case["capacity"],
        case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
        **kw,
    )


def _compute_and_check(planner, launches, case, groups, label):
    tables = [_dev(t) for t in case["block_tables"]]
    out = planner.compute(_dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), tables)
    bsz = len(case["seq_lens_decoder"])
    fn, grid, threads, records = launches[-1]
    assert (fn, grid, threads) == planner.kernel_for(bsz), label
    ref = _reference(case, groups)
    want = ref.outputs.attention
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "seqused_k"):
        w, g = getattr(want, f), getattr(out.attention, f)
        assert (w is None) == (g is None), (label, f)
        if w is not None:
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{label}: {f}")
    for f in ("max_seqlen_q", "max_seqlen_k"):
        w, g = getattr(want, f), getattr(out.attention, f)
        assert (w is None) == (g is None) and (w is None or int(g) == int(w)), (label, f)
    plain = step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    mask, keys = plain.error_mask, [plain.error_key]
    n_rec = planner._records.size // 2
    seen = set()
    for rec, m, k in records:
        assert rec < n_rec, (label, "every metadata block's records are allocated")
        seen.add(rec)
        mask |= m
        keys.append(k)
    assert len(seen) == len(records)
    # the token blocks' records come first: [0, ceil(C / T) * T / 32)
    assert min(seen, default=n_rec) >= -(-case["capacity"] // threads) * threads // 32
    assert (mask, min(keys)) == (ref.error_mask, ref.error_key), label
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mixed_cases(max_bsz=40),
    st.sampled_from(GROUPS),
    st.sampled_from([0, 1, 2, 3, 32]),
    st.sampled_from([0, 64, 256]),
    st.sampled_from([32768, 7]),
)
def test_small_batch_kernel_model_matches_the_reference(one_planner, case, groups, blocks, threads, pad):
    """The geometries the planner makes (a warp per request) and the ones the hooks force
    (fewer blocks: several requests per warp, the rows loaded again before the barrier; more
    blocks for the pad: blocks without requests)."""
    StepPlanner, launches = one_planner
    planner = _planner(StepPlanner, case, groups)
    planner._set_one_meta(blocks=blocks, min_threads=threads)
    assert planner._params.one_meta_flags == 0
    planner.one_meta_pad_entries = pad  # automatic K: at least ceil(N / pad) blocks per cache
    label = f"{groups}, blocks {blocks}, threads {threads}, pad {pad}"
    _compute_and_check(planner, launches, case, groups, label)


@pytest.mark.parametrize("bsz", [1, 33, 255, 256])
@pytest.mark.parametrize("threads", [0, 256])
def test_wide_batches_long_rows_and_overflow(one_planner, bsz, threads):
    """Several warps (absolute prefixes across warp totals), rows longer than the columns
    loaded before the barrier (B = 1), several requests per warp, unallocated pages,
    kv_indices capacity overflow, 1-3 caches with different B."""
    StepPlanner, launches = one_planner
    rng = np.random.default_rng(bsz + threads)
    cases = [
        make_case(rng, bsz=bsz, block_sizes=[1, 4], max_ctx=700, spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[16, 5, 3], bad="unallocated", spare_capacity=0),
        make_case(rng, bsz=bsz, block_sizes=[2], bad="narrow-row", spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[64], bad="negative-length", spare_capacity=None),
    ]
    cases.append(dict(cases[0], kv_indices_capacity=max(1, cases[0]["kv_indices_capacity"] * 2 // 3)))
    for i, case in enumerate(cases):
        for blocks in (0, 1, 5):
            planner = _planner(StepPlanner, case, ALL_GROUPS)
            planner._set_one_meta(blocks=blocks, min_threads=threads)
            _compute_and_check(planner, launches, case, ALL_GROUPS, f"case {i}, blocks {blocks}, threads {threads}")


def test_selection_geometry_and_the_v8_switch(one_planner):
    StepPlanner, _ = one_planner
    p = StepPlanner(1000, 64, [64], attention=ALL_GROUPS, kv_indices_capacity=20000)
    assert StepPlanner.one_block_max_requests == 256
    # decode 64 (C = 64): v9's T = 64, 2 warps per block, a warp per request: 32 blocks for 64 requests
    assert p.kernel_for(64) == ("kvaddr_step1m_c1_i64", 1 + 32, 64)
    assert p.kernel_for(1) == ("kvaddr_step1m_c1_i64", 1 + 1, 64)  # T = max(bsz, min(C, 256), 32)
    assert p.kernel_for(256) == ("kvaddr_step1m_c1_i64", 1 + 32, 256)
    # 257 to 4096 requests: v9 across blocks with metadata blocks (tests/unit/test_planner_attention_wide.py)
    assert p.kernel_for(257)[0] == "kvaddr_step1wm4_c1_i64"
    assert p.kernel_for(1000)[0] == "kvaddr_step1wm4_c1_i64"
    p._set_one_meta(min_threads=256)  # 8 warps per block: 8 blocks
    assert p.kernel_for(64) == ("kvaddr_step1m_c1_i64", 1 + 8, 256)
    p._set_one_meta(min_threads=0)
    p.one_meta_pad_entries = 1000  # the pad: at least ceil(20000 / 1000) blocks per cache
    assert p.kernel_for(1) == ("kvaddr_step1m_c1_i64", 1 + 20, 64)
    p.one_meta_pad_entries = 32768
    p._set_one_meta(min_threads=256)
    p._set_one_meta(blocks=3)
    assert p.kernel_for(64) == ("kvaddr_step1m_c1_i64", 1 + 3, 256)
    two = StepPlanner(300, 16384, [16, 32], position_dtype=np.int32, attention="flashinfer", kv_indices_capacity=9)
    # the mixed batch: 64 token blocks of 256, 8 warps per block: 32 blocks per cache
    assert two.kernel_for(256) == ("kvaddr_step1m_c2_i32", 64 + 2 * 32, 256)
    assert two.kernel_for(0) == ("kvaddr_step1m_c2_i32", 64 + 2, 256)
    big_n = StepPlanner(64, 64, [16], attention="flashinfer", kv_indices_capacity=10 * 32768 + 1)
    assert big_n.kernel_for(1)[1] == 1 + 11  # the pad: at least ceil(N / one_meta_pad_entries) blocks
    v = StepPlanner(64, 64, [], attention="varlen")
    assert v.kernel_for(64) == ("kvaddr_step1m_c0_i64", 2, 64)  # varlen alone: one metadata block
    # the old path, selectable: use_kernel("v8") or one_block_attention = False
    p.use_kernel("v8")
    assert p.kernel_for(64) == ("kvaddr_step_i64", p.grid(64), 256)
    p.use_kernel("v9")
    assert p.kernel_for(64)[0] == "kvaddr_step1m_c1_i64"
    p.one_block_attention = False
    p.use_kernel("v9")
    assert p.kernel_for(64)[0] == "kvaddr_step_i64"
    q = StepPlanner(1000, 64, [64], attention=ALL_GROUPS, kv_indices_capacity=20000)
    q.use_kernel("v9", max_requests=16)
    assert q.kernel_for(16)[0] == "kvaddr_step1m_c1_i64" and q.kernel_for(17)[0] == "kvaddr_step1wm4_c1_i64"
    q.use_kernel("v9", max_requests=1024)  # the attention kernel's own limit is KV_THREADS requests
    assert q.kernel_for(256)[0] == "kvaddr_step1m_c1_i64" and q.kernel_for(257)[0] == "kvaddr_step1wm4_c1_i64"
    q.wide_attention = False  # batches past the small-batch kernel on kvaddr_step_*
    q.use_kernel("v9", max_requests=1024)
    assert q.kernel_for(256)[0] == "kvaddr_step1m_c1_i64" and q.kernel_for(257)[0] == "kvaddr_step_i64"


@pytest.mark.parametrize("capacity", [1, 64, 255, 257, 5000, 16384])
@pytest.mark.parametrize("caches", [1, 2, 4])
def test_records_cover_every_kernel_that_may_run(one_planner, capacity, caches):
    """Every warp of kvaddr_step1m_* (any bsz <= 256, any blocks, narrowest block) has a
    record, inside the range kvaddr_step_* writes or clears ([0, (num_chunks + max_tiles) x 8)),
    so each kernel rewrites every record the others may have left."""
    StepPlanner, _ = one_planner
    p = StepPlanner(4096, capacity, [16] * caches, attention=ALL_GROUPS, kv_indices_capacity=50 << 20)
    v8_cleared = (p._num_chunks + p._params.max_tiles) * 8
    assert p._records.size == 2 * (v8_cleared + p._num_meta * 8)
    for pad in (32768, 1):
        p.one_meta_pad_entries = pad  # 1: as many blocks per cache as allowed (ONE_META_MAX_BLOCKS)
        for blocks in (0, 1, 32):
            for threads in (0, 256):
                p._set_one_meta(blocks=blocks, min_threads=threads)
                for bsz in (0, 1, 31, 32, 33, 64, 255, 256):
                    _, grid, T = p.kernel_for(bsz)
                    assert T <= 256 and grid * T // 32 <= v8_cleared, (pad, blocks, threads, bsz)


def test_hooks_validate_and_reach_the_struct(one_planner):
    StepPlanner, _ = one_planner
    p = StepPlanner(64, 64, [16], attention=ALL_GROUPS, kv_indices_capacity=100)
    P = p._params
    assert (P.one_meta_lanes, P.one_meta_flags) == (32, 0)  # a warp per request; no ablation
    p._set_one_meta(flags=StepPlanner.M1_EMPTY)
    assert P.one_meta_flags == 8
    p._set_one_meta(flags=0)
    assert P.one_meta_flags == 0
    for ok in (StepPlanner.M1_ROWS_BY_PAGES, StepPlanner.M1_ROWS_BY_PAGES | StepPlanner.M1_EMPTY):
        p._set_one_meta(flags=ok)  # kvaddr_step1wm*'s row loads bounded by the pages (same outputs)
        assert P.one_meta_flags == ok
    p._set_one_meta(flags=0)
    q = StepPlanner(64, 64, [16], attention=ALL_GROUPS, kv_indices_capacity=100)
    assert q._params.one_meta_flags == 0 and p._params is not q._params
    with pytest.raises(TypeError):
        p._set_one_meta(lanes=16)  # since session 12 a warp copies a row: no lanes knob
    with pytest.raises(ValueError, match="blocks"):
        p._set_one_meta(blocks=33)
    with pytest.raises(ValueError, match="min_threads"):
        p._set_one_meta(min_threads=512)
    for bad in (1, 4, 32, 48, 64, -8, 8.0, True):
        with pytest.raises(ValueError, match="flags must be 0, 8"):
            p._set_one_meta(flags=bad)


@pytest.mark.parametrize("flags", [0, 8])
def test_ablations_run_and_leave_records_clean(one_planner, flags):
    """The timing ablation (outputs wrong by design) still writes every metadata record."""
    StepPlanner, launches = one_planner
    case = make_case(np.random.default_rng(flags), bsz=20, block_sizes=[4, 2], spare_capacity=2)
    p = _planner(StepPlanner, case, ALL_GROUPS)
    p._set_one_meta(flags=flags)
    p.compute(_dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), [_dev(t) for t in case["block_tables"]])
    fn, grid, threads, records = launches[-1]
    token_blocks = -(-case["capacity"] // threads)
    assert fn == "kvaddr_step1m_c2_i64" and len(records) == (grid - token_blocks) * threads // 32
    if flags & StepPlanner.M1_EMPTY:
        assert all(m == 0 and k == NO_ERROR_KEY for _, m, k in records)
