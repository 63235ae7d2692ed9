"""StepPlanner(draft_steps=k) on the CPU: the MTP launch's arguments and geometry, the host
checks, and its outputs through a Python model of the kernel (tests/support/mtp_kernel_model.py)
against the NumPy reference substep by substep (hypothesis): random acceptance 0..k, idle rows,
bad values, several caches, attention metadata, more than one tile of requests. The planner
builds on NumPy buffers (tests/support/fake_cupy.py); tests/gpu/test_mtp_gpu.py runs the kernel."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr import dispatch, kernel_loader
from kvaddr.errors import NO_ERROR_KEY
from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_substep_lengths
from tests.support.fake_cupy import install_planner_fake
from tests.support.mtp_kernel_model import run_mtp

ALL = "flashinfer,varlen,page_table"


@pytest.fixture
def fake(monkeypatch):
    return install_planner_fake(monkeypatch)


def _planner(max_requests, capacity, sizes, k, **kw):
    from kvaddr import StepPlanner

    return StepPlanner(max_requests, capacity, sizes, draft_steps=k, **kw)


def test_one_launch_of_every_substep(fake):
    p = _planner(100, 600, [16, 5], 3)
    dec, acc = fake.array([5, 0, 9]), fake.array([2, 0, 3])
    t = fake.array(np.zeros((3, 8)))
    out = p.compute_draft_steps(dec, acc, t)
    assert len(fake.launches) == 1
    L = fake.launches[0]
    assert fake.kernel(L["fptr"]) == "mtp_step<long long>"
    launch = dispatch.mtp_launch(p.config)
    assert (L["grid"], L["grid_y"], L["block"]) == (launch.blocks, 3, launch.threads) == (3, 3, dispatch.THREADS)
    M = L["mtp"]
    assert (M.step.seq_lens_decoder, M.accept_num, M.step.bsz) == (dec.data.ptr, acc.data.ptr, 3)
    assert (M.num_substeps, M.max_requests) == (3, 100)
    assert M.step.cu_seqlens_q == p._draft.cu_seqlens_q.data.ptr
    assert M.step.slot_mapping == p._draft.slot_mapping.data.ptr
    assert M.step.error_records == p._records.data.ptr
    assert list(M.step.block_size)[:2] == [16, 5] and list(M.step.block_tables)[:2] == [t.data.ptr] * 2
    assert out.cu_seqlens_q.shape == (3, 4) and out.slot_mapping.shape == (3, 2, 600)
    assert out.substep(2).slot_mapping.shape == (2, 600) and out.substep(1).cu_seqlens_q.shape == (4,)
    # the records hold every warp of the grid
    assert p._records.size // 2 >= dispatch.mtp_records(p.config, 3) == 3 * 3 * dispatch.WARPS


def test_bound_launch_is_one_driver_call_with_the_bound_struct(fake):
    p = _planner(100, 600, [16, 5], 3)
    dec, acc = fake.array([5, 0, 9]), fake.array([2, 0, 3])
    t = fake.array(np.zeros((3, 8)))
    bound = p.bind_draft_steps(dec, acc, t, stream=0x77)
    out = bound.launch()
    fake.current.ptr = 0x52
    bound2 = p.bind_draft_steps(dec, acc, t)
    bound2.launch()
    bound2.launch(0x99)
    assert [x["stream"] for x in fake.launches] == [0x77, 0x52, 0x99]
    launch = dispatch.mtp_launch(p.config)
    for x in fake.launches:
        assert fake.kernel(x["fptr"]) == "mtp_step<long long>"
        assert (x["grid"], x["grid_y"], x["block"]) == (launch.blocks, 3, launch.threads)
        M = x["mtp"]
        assert (M.step.seq_lens_decoder, M.accept_num, M.step.bsz, M.num_substeps) == (dec.data.ptr, acc.data.ptr, 3, 3)
    assert out.cu_seqlens_q.shape == (3, 4)


def test_compute_is_the_core_step_beside_it(fake):
    p = _planner(8, 16, [4], 2)
    dec, q = fake.array([1, 2]), fake.array([1, 1])
    t = fake.array(np.zeros((2, 4)))
    p.compute(dec, q, t)
    p.compute_draft_steps(dec, q, t)
    p.compute(dec, q, t)
    names = [fake.kernel(x["fptr"]) for x in fake.launches]
    assert names[0] == names[2] == p.kernel_for(2)[0] and names[1].startswith("mtp_step")
    assert fake.launches[2]["params"].seq_lens_this_time == q.data.ptr


def test_host_checks_name_the_argument(fake):
    from kvaddr import StepPlanner

    p = _planner(4, 16, [4], 2)
    dec, t = fake.array([1, 2]), fake.array(np.zeros((2, 4)))
    with pytest.raises(TypeError, match="accept_num"):
        p.compute_draft_steps(dec, fake.array([1, 2], np.int64), t)
    with pytest.raises(ValueError, match="accept_num"):
        p.compute_draft_steps(dec, fake.array([1]), t)
    with pytest.raises(ValueError, match="max_requests"):
        p.compute_draft_steps(fake.array([0] * 5), fake.array([0] * 5), fake.array(np.zeros((5, 4))))
    with pytest.raises(ValueError, match="block_tables"):
        p.compute_draft_steps(dec, dec, fake.array(np.zeros((1, 4))))
    with pytest.raises(ValueError, match="draft_steps"):
        StepPlanner(4, 16, [4]).compute_draft_steps(dec, dec, t)
    with pytest.raises(ValueError, match="draft_steps"):
        StepPlanner(4, 16, [4], draft_steps=0)
    assert fake.launches == []


def _case(rng, bsz, k, sizes, bad):
    dec = rng.integers(0, 90, bsz).astype(np.int32)
    acc = rng.integers(0, k + 1, bsz).astype(np.int32)
    tables = []
    for B in sizes:
        W = -(-(90 + 2 * k + 2) // B)
        t = rng.integers(0, 1 << 20, (bsz + 2, W)).astype(np.int32)
        if bad:
            t[rng.random(t.shape) < 0.05] = -1
            t = np.ascontiguousarray(t[:, : max(1, W // 2)])
        tables.append(t)
    if bad and bsz:
        dec[rng.integers(0, bsz)] = -3
        acc[rng.integers(0, bsz)] = -2
    return dec, acc, tables


def _check(fake, dec, acc, tables, sizes, C, k, attention=None, N=None, pos_dtype=np.int64):
    bsz = dec.shape[0]
    p = _planner(max(bsz, 1) + 3, C, sizes, k, attention=attention, kv_indices_capacity=N, position_dtype=pos_dtype)
    d = p._draft
    for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping", "num_tokens"):
        getattr(d, name).a[...] = 0x5A5A5A5A  # unwritten elements show
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen"):
        if getattr(d, name) is not None:
            getattr(d, name).a[...] = 0x5A5A5A5A
    dt = [fake.array(t) for t in tables]
    d_dec, d_acc = fake.array(dec), fake.array(acc)  # alive while the model reads them
    out = p.compute_draft_steps(d_dec, d_acc, dt)
    L = fake.launches[-1]
    run_mtp(L["mtp"], L["grid"], L["grid_y"], pos_dtype)
    mask, key = 0, NO_ERROR_KEY
    for j in range(k):
        dj, qj = mtp_substep_lengths(dec, acc, j)
        ref = step_addressing(
            dj, qj, tables, sizes, C, position_dtype=pos_dtype, attention=attention, kv_indices_capacity=N
        )
        mask, key = mask | ref.error_mask, min(key, ref.error_key)
        got = out.substep(j)
        for f, want in ref.outputs.as_dict().items():
            np.testing.assert_array_equal(getattr(got, f).a, want, err_msg=f"substep {j} {f}")
        if attention:
            for f, want in ref.outputs.attention.as_dict().items():
                g = getattr(got.attention, f)
                if f == "page_table":
                    for x, y in zip(g, want):
                        np.testing.assert_array_equal(x.a, y)
                else:
                    np.testing.assert_array_equal(g.a, want, err_msg=f"substep {j} {f}")
    recs = p._records.a.reshape(-1, 2)
    got_mask = int(np.bitwise_or.reduce(recs[:, 0])) if recs.size else 0
    assert (got_mask, int(recs[:, 1].min())) == (mask, key)


def test_worked_example(fake):
    """Three requests, B = 4, k = 3: request 0 accepted 2, request 1 is idle, request 2 accepted 3."""
    tables = [np.array([[7, 2, 5, -1], [4, -1, -1, -1], [1, 3, 8, 6]], np.int32)]
    dec, acc = np.array([5, 0, 9], np.int32), np.array([2, 0, 3], np.int32)
    _check(fake, dec, acc, tables, [4], 8, 3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bsz=st.sampled_from([0, 1, 5, 31, 64]),
    k=st.integers(1, 4),
    sizes=st.sampled_from([(), (4,), (3, 16), (5, 1, 7)]),
    bad=st.booleans(),
    attention=st.sampled_from([None, "varlen", "flashinfer", ALL]),
    slack=st.integers(-5, 300),
    seed=st.integers(0, 2**32 - 1),
    pos32=st.booleans(),
)
def test_model_equals_the_reference_substep_by_substep(fake, bsz, k, sizes, bad, attention, slack, seed, pos32):
    if attention and ("flashinfer" in attention or "page_table" in attention) and not sizes:
        attention = "varlen"
    rng = np.random.default_rng(seed)
    dec, acc, tables = _case(rng, bsz, k, sizes, bad)
    C = max(1, int(np.maximum(acc, 0).sum()) + slack)
    N = int(rng.integers(1, 400)) if attention and "flashinfer" in attention else None
    _check(fake, dec, acc, tables, list(sizes), C, k, attention, N, np.int32 if pos32 else np.int64)


@pytest.mark.parametrize("attention", [ALL, "varlen", None])
@pytest.mark.parametrize("bad", [False, True])
def test_more_than_one_tile_of_requests(fake, attention, bad):
    """Three tiles of requests over many token blocks: each block scans its own range of
    requests and sums the others' (prefixes before, totals after)."""
    rng = np.random.default_rng(7)
    bsz = 2 * kernel_loader.constants()["KV_MTP_ITEMS"] * dispatch.THREADS + 37
    dec, acc, tables = _case(rng, bsz, 3, (16, 3), bad)
    C = int(np.maximum(acc, 0).sum()) + 100
    _check(fake, dec, acc, tables, [16, 3], C, 3, attention, 30000 if attention == ALL else None)


@pytest.mark.parametrize("attention", [ALL, "varlen", None])
@pytest.mark.parametrize(("tiles", "capacity"), [(0.9, None), (2.9, 300), (2.4, 700)])
def test_request_windows(fake, attention, tiles, capacity):
    """A batch within one tile over several token blocks (each block scans it whole, no others'
    pass), and batches of several tiles over two or three token blocks (a block's requests span
    more than a tile: its window is scanned tile by tile, the capacity cutting the tokens)."""
    rng = np.random.default_rng(11)
    bsz = int(tiles * kernel_loader.constants()["KV_MTP_ITEMS"] * dispatch.THREADS)
    dec, acc, tables = _case(rng, bsz, 3, (16, 3), True)
    C = capacity or int(np.maximum(acc, 0).sum()) + 20
    _check(fake, dec, acc, tables, [16, 3], C, 3, attention, 9000 if attention == ALL else None)


@pytest.mark.parametrize("attention", [ALL, "varlen", None])
def test_blocks_past_the_last_request_write_only_padding(fake, attention):
    """Five requests over a capacity of six token blocks: the request ranges (a multiple of 4
    each) leave the last blocks none; they still pad their tokens and kv_indices entries."""
    rng = np.random.default_rng(3)
    dec, acc, tables = _case(rng, 5, 3, (4, 7), False)
    _check(fake, dec, acc, tables, [4, 7], 6 * dispatch.THREADS - 5, 3, attention, 500 if attention == ALL else None)


@pytest.mark.parametrize("attention", [ALL, "varlen"])
def test_requests_longer_than_a_block_of_tokens(fake, attention):
    """Substep 0 of requests of hundreds of accepted tokens: a tile's tokens span several token
    blocks, written by the owning block's threads in turn, over several blocks."""
    rng = np.random.default_rng(5)
    dec, acc, tables = _case(rng, 40, 3, (16,), False)
    acc[[3, 17, 30]] = [700, 513, 260]
    tables = [np.ascontiguousarray(np.tile(tables[0], (1, 12)))]
    C = int(acc.sum()) - 50  # the last request's tokens pass the capacity: error bit and clamp
    _check(fake, dec, acc, tables, [16], C, 2, attention, 4000 if attention == ALL else None)


@pytest.mark.parametrize("attention", [ALL, "varlen"])
def test_token_sums_past_int32(fake, attention):
    """Accepted counts summing past 2^31 - 1 over several blocks: cu_seqlens_q saturates, and
    max_seqlen_q is the largest saturated difference (not the largest count)."""
    rng = np.random.default_rng(9)
    dec, acc, tables = _case(rng, 60, 3, (16,), False)
    acc[[10, 20, 45]] = [2**30 + 5, 2**30 + 7, 2**30 + 9]
    _check(fake, dec, acc, tables, [16], 3 * dispatch.THREADS, 3, attention, 900 if attention == ALL else None)


def test_fastdeploy_baseline_launches_two_single_blocks_per_substep(fake, monkeypatch):
    """FastDeployMtp: per substep the length kernel then the one-block step, each one block of
    max(bsz, 1) threads, into substep j's rows of the [k, ...] buffers; at most 512 requests."""
    from kvaddr.errors import StrategyLimitExceeded
    from kvaddr.strategies.fastdeploy_mtp import FastDeployMtp

    syncs = []
    monkeypatch.setattr(type(fake.current), "synchronize", lambda self: syncs.append(self.ptr), raising=False)
    fd = FastDeployMtp(64, 32, [16, 5], 3)
    dec, acc = fake.array([5, 0, 9]), fake.array([2, 0, 3])
    t = fake.array(np.zeros((3, 8)))
    out = fd.run(dec, acc, t)
    L = fake.launches
    assert len(L) == 6 and [x["grid"] for x in L] == [1] * 6 and [x["block"] for x in L] == [3] * 6
    assert len(syncs) >= 3
    d = fd._planner._draft
    for j in range(3):
        a, P = fd._len_args[j], fd._step_args[j]
        assert (a.seq_lens_decoder, a.accept_num, a.bsz, a.substep) == (dec.data.ptr, acc.data.ptr, 3, j)
        assert (P.seq_lens_decoder, P.seq_lens_this_time) == (a.dec_out, a.q_out)
        assert P.slot_mapping == d.slot_mapping.data.ptr + 8 * j * 2 * 32
        assert P.cu_seqlens_q == d.cu_seqlens_q.data.ptr + 4 * j * 65
        assert list(P.block_tables)[:2] == [t.data.ptr] * 2 and P.bsz == 3
    assert out.slot_mapping.shape == (3, 2, 32)
    with pytest.raises(ValueError, match="max_requests"):
        FastDeployMtp(513, 32, [16], 3)
    big = FastDeployMtp(8, 32, [16], 3)
    with pytest.raises(StrategyLimitExceeded):
        big.run(fake.array([0] * 9), fake.array([0] * 9), fake.array(np.zeros((9, 8))))
