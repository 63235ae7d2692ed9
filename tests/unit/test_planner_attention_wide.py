"""v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*, docs/attention.md "Batches
of 257 to 4096") on the CPU: the planner's selection and geometry, the error-record sizing, and,
through tests/support/meta_wide_model.py (a line-by-line model of kernels.cu's kv_meta_wide
reading the launch's KvStepParams and geometry), the outputs and error records against the NumPy
reference. The kernel itself runs in tests/gpu/test_attention_wide_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr.errors import NO_ERROR_KEY
from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.unit.test_planner_attention import GROUPS, _dev, fake_planner  # noqa: F401 (a fixture)
from tests.unit.test_planner_attention_one import _compute_and_check, _planner, one_planner  # noqa: F401


def _wide(planner, *, per_thread=0, threads=None, small=True):
    """Route the planner's batches to kvaddr_step1wm*: from 1 request when ``small`` (the
    small-batch kernel limited to 0 requests), with R = ``per_thread`` (0: chosen) and the
    wide block aim ``threads``."""
    if threads is not None:
        planner.wide_meta_threads = threads
    planner.use_kernel("v9", max_requests=0 if small else None, wide_per_thread=per_thread)
    return planner


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mixed_cases(max_bsz=70),
    st.sampled_from(GROUPS),
    st.sampled_from([0, 4, 8, 16]),
    st.sampled_from([32, 64, 128]),
    st.sampled_from([32768, 7, 1]),
    st.sampled_from([0, 16]),
)
def test_wide_kernel_model_matches_the_reference(one_planner, case, groups, per_thread, threads, pad, flags):  # noqa: F811
    """Small batches routed to the wide kernel: blocks of 1 to 4 warps (request blocks of a few
    requests, threads holding 4 to 16 requests across warps), pad blocks from 1 to the cap."""
    StepPlanner, launches = one_planner
    planner = _wide(_planner(StepPlanner, case, groups), per_thread=per_thread, threads=threads)
    planner.one_meta_pad_entries = pad
    planner._set_one_meta(flags=flags)  # 16: row loads bounded by the pages (same outputs)
    bsz = len(case["seq_lens_decoder"])
    if bsz:
        assert planner.kernel_for(bsz)[0].startswith(f"kvaddr_step1wm{per_thread or ''}")
    _compute_and_check(
        planner, launches, case, groups, f"{groups}, R {per_thread}, T aim {threads}, pad {pad}, flags {flags}"
    )


@pytest.mark.parametrize("bsz", [257, 1000, 2049])
@pytest.mark.parametrize("per_thread", [0, 8, 16])
def test_batches_past_256_long_rows_and_bad_values(one_planner, bsz, per_thread):  # noqa: F811
    """The sizes the planner sends there by default (and with R forced: T up to 1024 threads, 32
    warps); rows longer than the columns loaded before the barrier (B = 1), unallocated pages,
    narrow rows, negative lengths, kv_indices overflow, 1-3 caches with different B (non-powers of
    two)."""
    StepPlanner, launches = one_planner
    rng = np.random.default_rng(bsz * 17 + per_thread)
    cases = [
        make_case(rng, bsz=bsz, block_sizes=[1, 16], max_ctx=700, spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[16, 5, 3], bad="unallocated", spare_capacity=0),
        make_case(rng, bsz=bsz, block_sizes=[2], bad="narrow-row", spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[64], bad="negative-length", spare_capacity=None),
    ]
    cases.append(dict(cases[0], kv_indices_capacity=max(1, cases[0]["kv_indices_capacity"] * 2 // 3)))
    for i, case in enumerate(cases):
        for groups in (ALL_GROUPS, "varlen", "page_table"):
            planner = _wide(_planner(StepPlanner, case, groups), per_thread=per_thread, small=False)
            assert planner.kernel_for(bsz)[0].startswith("kvaddr_step1wm")
            _compute_and_check(planner, launches, case, groups, f"case {i}, {groups}, R {per_thread}")


def test_4096_requests_two_caches(one_planner):  # noqa: F811
    StepPlanner, launches = one_planner
    case = make_case(np.random.default_rng(4096), bsz=4096, block_sizes=[16, 64], max_ctx=300, spare_capacity=5)
    planner = _planner(StepPlanner, case, ALL_GROUPS)
    name, _, threads = planner.kernel_for(4096)
    assert (name, threads) == ("kvaddr_step1wm4_c2_i64", 1024)
    _compute_and_check(planner, launches, case, ALL_GROUPS, "4096 x 2 caches")


def test_selection_and_geometry(one_planner):  # noqa: F811
    StepPlanner, _ = one_planner
    p = StepPlanner(4096, 4096, [64], attention=ALL_GROUPS, kv_indices_capacity=20000)
    # R = the smallest of 4, 8, 16 with R x 1024 >= bsz (wide_meta_threads); T = ceil(bsz / R) rounded
    # up to a warp; per cache ceil(bsz / (T / 32)) request blocks and ceil(N / 32768) pad blocks
    assert p.kernel_for(256)[0] == "kvaddr_step1m_c1_i64"
    assert p.kernel_for(257) == ("kvaddr_step1wm4_c1_i64", 4096 // 96 + 1 + 86 + 1, 96)
    assert p.kernel_for(1024) == ("kvaddr_step1wm4_c1_i64", 16 + 128 + 1, 256)
    assert p.kernel_for(4096) == ("kvaddr_step1wm4_c1_i64", 4 + 128 + 1, 1024)
    assert p.kernel_for(4096)[1] == p._wide_geometry(4096)[1]  # BoundStep launches _wide_plan: the same geometry
    p.wide_meta_threads = 128  # the token kernel's aim: R = 8 at 1024 requests
    assert p.kernel_for(1024) == ("kvaddr_step1wm8_c1_i64", 32 + 256 + 1, 128)
    assert p.kernel_for(4096) == ("kvaddr_step1wm16_c1_i64", 16 + 512 + 1, 256)
    p.one_meta_pad_entries = 1000
    assert p.kernel_for(1024)[1] == 32 + 256 + 20
    p.one_meta_pad_entries = 1
    assert p.kernel_for(1024)[1] == 32 + 256 + StepPlanner.WIDE_META_MAX_PAD
    two = StepPlanner(1024, 2048, [16, 32], position_dtype=np.int32, attention="flashinfer", kv_indices_capacity=9)
    assert two.kernel_for(1024) == ("kvaddr_step1wm4_c2_i32", 8 + 2 * (128 + 1), 256)
    pt = StepPlanner(1024, 2048, [16, 32], attention="page_table")  # no kv_indices: no pad blocks
    assert pt.kernel_for(1024) == ("kvaddr_step1wm4_c2_i64", 8 + 2 * 128, 256)
    v = StepPlanner(1024, 1024, [16], attention="varlen")  # varlen alone: one metadata block
    assert v.kernel_for(1024) == ("kvaddr_step1wm4_c1_i64", 4 + 1, 256)
    assert p.kernel_for(4097 - 1)[0].startswith("kvaddr_step1wm")
    big = StepPlanner(5000, 5000, [16], attention=ALL_GROUPS, kv_indices_capacity=100)
    assert big.kernel_for(4097)[0] == "kvaddr_step_i64"  # past KV_W_MAX: the multi-block kernel
    p.wide_attention = False
    p.use_kernel("v9")
    assert p.kernel_for(1024)[0] == "kvaddr_step_i64" and p.kernel_for(256)[0] == "kvaddr_step1m_c1_i64"
    p.wide_attention = True
    p.use_kernel("v8")
    assert p.kernel_for(1024)[0] == "kvaddr_step_i64"
    p.use_kernel("v9")
    p.one_block_attention = False  # the old path everywhere
    p.use_kernel("v9")
    assert p.kernel_for(1024)[0] == "kvaddr_step_i64"


@pytest.mark.parametrize("capacity", [1, 64, 257, 5000, 16384])
@pytest.mark.parametrize("caches", [1, 2, 4])
def test_records_cover_the_wide_kernel(one_planner, capacity, caches):  # noqa: F811
    """Every warp of kvaddr_step1wm* (any bsz it runs, any R, the most pad blocks) has a record
    inside the range kvaddr_step_* writes or clears, so each kernel rewrites every record the
    others may have left."""
    StepPlanner, _ = one_planner
    p = StepPlanner(4096, capacity, [16] * caches, attention=ALL_GROUPS, kv_indices_capacity=50 << 20)
    v8_cleared = (p._num_chunks + p._params.max_tiles) * 8
    assert p._records.size == 2 * (v8_cleared + p._num_meta * 8)
    for pad in (32768, 1):
        p.one_meta_pad_entries = pad
        for r in (0, 4, 8, 16):
            for aim in (32, 128, 1024):
                p.wide_meta_threads = aim
                p.use_kernel("v9", wide_per_thread=r)
                for bsz in (257, 300, 1000, 1024, 2049, 4095, 4096):
                    name, grid, T = p.kernel_for(bsz)
                    assert name.startswith("kvaddr_step1wm") and T <= 1024, (r, aim, bsz)
                    assert grid * T // 32 <= v8_cleared, (pad, r, aim, bsz)


@pytest.mark.parametrize("flags", [0, 8])
def test_empty_ablation_leaves_records_clean(one_planner, flags):  # noqa: F811
    StepPlanner, launches = one_planner
    case = make_case(np.random.default_rng(flags), bsz=300, block_sizes=[4, 2], spare_capacity=2)
    p = _planner(StepPlanner, case, ALL_GROUPS)
    p._set_one_meta(flags=flags)
    p.compute(_dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), [_dev(t) for t in case["block_tables"]])
    fn, grid, threads, records = launches[-1]
    token_blocks = -(-case["capacity"] // threads)
    assert fn == "kvaddr_step1wm4_c2_i64" and len(records) == (grid - token_blocks) * threads // 32
    if flags & StepPlanner.M1_EMPTY:
        assert all(m == 0 and k == NO_ERROR_KEY for _, m, k in records)
