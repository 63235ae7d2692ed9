"""``vllm_step<true>``'s metadata blocks, their source text run on the CPU
(tests/support/vllm_attention_emulator.py: host threads, barriers, emulated shuffles) through
the real planner (fake CuPy, its automatic rows per block), against the NumPy reference: the
worked example, random batches (1-4 groups, DCP, dummies, sliding windows), capacity overflow,
corrupted inputs, a batch past pass 1's first chunk. Skips without a C++20 compiler."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_attention_emulator
from tests.support.vllm_attention_cases import WORKED, WORKED_DCP, assert_attention
from tests.support.vllm_cases import assert_same, corrupt, planner_kwargs, random_case, worked_example
from tests.support.vllm_fake_cupy import install, on_fake

pytestmark = pytest.mark.skipif(
    not vllm_attention_emulator.cxx20(), reason="no C++20 compiler with <barrier>: the kernel emulator cannot run"
)

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
BOTH = ("flashinfer", "varlen")


@pytest.fixture
def emu(monkeypatch):
    vllm_attention_emulator.library()
    return install(monkeypatch, on_launch=vllm_attention_emulator.on_launch)


def run(cfg, x, attention=BOTH, N=4096, padded=None):
    from kvaddr.engines.vllm import VllmStepPlanner

    pl = VllmStepPlanner(**planner_kwargs(cfg), attention=attention, kv_indices_capacity=N)
    a = pl.attention_outputs
    for buf in (a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_last_page_len, a.cu_seqlens_k):
        if buf is not None:
            buf.a.fill(777777)  # poisoned: every element must be written
    if a.cu_seqlens_k is not None:
        pl._max_seqlen.a.fill(777777)
    d = on_fake(x)
    out = pl.compute(*(d[k] for k in NAMES), num_reqs_padded=padded)
    want = vllm_step_reference(
        cfg,
        **x,
        num_reqs_padded=padded,
        attention=attention,
        kv_indices_capacity=N if "flashinfer" in attention else None,
    )
    got = {k: (tuple(t.a for t in v) if isinstance(v, tuple) else v.a) for k, v in out.as_dict().items()}
    assert_same(got, want.outputs.as_dict())
    w = want.outputs.attention
    ga = out.attention
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k"):
        if getattr(w, name) is None:
            assert getattr(ga, name) is None
            continue
        g = getattr(ga, name).a
        if not np.array_equal(g, getattr(w, name)):
            at = tuple(np.argwhere(g != getattr(w, name))[0])
            raise AssertionError(f"{name} differs at {at}: got {g[at]}, want {getattr(w, name)[at]}")
    if w.max_seqlen_q is not None:
        # (the fake's buf[0] is a copy, not CuPy's 0-d view: read the planner's buffer)
        assert pl._max_seqlen.a.tolist() == [int(w.max_seqlen_q), *w.max_seqlen_k.tolist()]
    rec = pl._records.a
    mask, key = int(np.bitwise_or.reduce(rec[:, 0])), int(rec[:, 1].min())
    assert (mask, key) == (want.error_mask, want.error_key), (hex(mask), hex(want.error_mask))
    return out, want


def test_worked_example(emu):
    cfg, x = worked_example()
    out, _ = run(cfg, x, N=8)  # (run() checks max_seqlen_q / _k against the reference)
    want = {k: v for k, v in WORKED.items() if not k.startswith("max_")}
    assert_attention(type("A", (), {k: getattr(out.attention, k).a for k in want})(), want)


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp(emu, rank):
    cfg, x = worked_example(cp_size=2, cp_rank=rank)
    out, _ = run(cfg, x, N=8)
    want = {k: v for k, v in {**WORKED, **WORKED_DCP[rank]}.items() if not k.startswith("max_")}
    assert_attention(type("A", (), {k: getattr(out.attention, k).a for k in want})(), want)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(emu, seed):
    rng = np.random.default_rng(seed)
    G = 1 + seed % 4
    bs = [(16,), (16, 64), (3, 24, 7), (1, 16, 5, 32)][G - 1]
    cp = (1, 2, 4)[seed % 3]
    M = (5, 70, 140)[seed % 3]
    sharded = [g % 2 == 0 for g in range(G)]
    reach = [0 if (cp > 1 and s) else (33 if g == 1 else 0) for g, s in enumerate(sharded)]
    cfg, x = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=M - seed % 3,
        block_sizes=bs,
        max_query=(1, 9)[seed % 2],
        max_context=400,
        dummy_fraction=0.2,
        cp_size=cp,
        cp_rank=cp - 1,
        cp_interleave=1,
        dcp_sharded=sharded,
        sliding_window_reach=reach,
    )
    run(cfg, x, N=1 << 14, padded=M)


@pytest.mark.parametrize("seed", range(4))
def test_long_and_short_rows(emu, seed):
    """Long rows (B = 1: up to 400 pages, past the columns each
    lane group loads before the barrier) and short ones, a sliding window."""
    rng = np.random.default_rng(50 + seed)
    cfg, x = random_case(
        rng,
        max_num_reqs=(20, 130)[seed % 2],
        num_reqs=(20, 120)[seed % 2],
        block_sizes=((1, 16), (3,), (64, 2), (16,))[seed],
        max_query=(1, 6)[seed % 2],
        max_context=400,
        dummy_fraction=0.1,
        sliding_window_reach=[(0, 40)[seed % 2]] * len(((1, 16), (3,), (64, 2), (16,))[seed]),
    )
    run(cfg, x, N=1 << 15)


@pytest.mark.parametrize("N", [1, 10, 300])
def test_capacity_overflow(emu, N):
    rng = np.random.default_rng(N)
    cfg, x = random_case(rng, max_num_reqs=90, num_reqs=85, block_sizes=(4, 16), max_query=3, max_context=100)
    _, want = run(cfg, x, N=N)
    assert want.error_mask & 512


@pytest.mark.parametrize("seed", range(6))
def test_corrupted_inputs(emu, seed):
    rng = np.random.default_rng(100 + seed)
    cfg, x = random_case(rng, max_num_reqs=80, num_reqs=75, block_sizes=(16, 7), max_query=5, cp_size=(1, 2)[seed % 2])
    x = corrupt(rng, cfg, x, rate=0.08)
    run(cfg, x, N=700)


@pytest.mark.parametrize("groups", [("flashinfer",), ("varlen",)])
def test_one_group_of_outputs(emu, groups):
    rng = np.random.default_rng(3)
    cfg, x = random_case(rng, max_num_reqs=40, num_reqs=33, block_sizes=(16, 3), max_query=4)
    run(cfg, x, attention=groups, N=2000)


def test_pass1_past_one_chunk(emu):
    """num_reqs 2500 > VLLM_META_R * VLLM_THREADS = 1024: pass 1's loop after its first chunk,
    2 groups, dummies."""
    rng = np.random.default_rng(256)
    cfg, x = random_case(
        rng, max_num_reqs=2600, num_reqs=2500, block_sizes=(16, 5), max_query=2, max_context=90, dummy_fraction=0.1
    )
    run(cfg, x, N=1 << 17, padded=2600)
