"""StepPlanner's DSA outputs (docs/dsa.md) on the CPU: a fake CuPy whose device arrays are NumPy
buffers, and a launch that runs the DSA token writes of the step's blocks and the grid's second
row (the DSA blocks) through the step-by-step model of kvaddr/kernels/dsa_step.cuh
(tests/support/dsa_step_model.py), reading the launch's KvStepParams and geometry. Checks the struct fields, the second grid row, the output views and,
through the model, every DSA output against the NumPy reference (kvaddr.reference) and the DSA
oracle (kvaddr.dsa_reference.indexer_metadata). The kernel itself runs in tests/gpu."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr import kernel_loader
from kvaddr.dsa_reference import indexer_cache_offsets, indexer_metadata
from kvaddr.outputs import DSA_FIELDS
from kvaddr.reference import step_addressing
from tests.support.dsa_cases import dsa_case
from tests.support.dsa_step_model import run_dsa_blocks, run_dsa_token_writes
from tests.support.meta_kernel_model import _view


class FakeDeviceArray(np.ndarray):
    """A NumPy array that kvaddr.validation.describe takes for a CuPy array on device 0."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    def get(self, stream=None, out=None):
        return np.array(self)


FakeDeviceArray.__module__ = "cupy._fake"


def _dev(a):
    return np.ascontiguousarray(a).view(FakeDeviceArray)


class FakeStream:
    ptr = 0

    def synchronize(self):
        pass


@pytest.fixture
def fake_planner(monkeypatch):
    """(StepPlanner class, launches): each launch records (kernel, grid, threads, grid rows) and
    runs the DSA blocks' model on a two-row grid (the token outputs come from the reference)."""
    cp = types.ModuleType("cupy")
    cp.zeros = lambda shape, dtype=float: _dev(np.zeros(shape, dtype))
    cp.full = lambda shape, v, dtype=None: _dev(np.full(shape, v, dtype))
    cp.asarray = lambda a: _dev(np.asarray(a))
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {"multiProcessorCount": 4}
        ),
        get_current_stream=lambda: FakeStream(),
    )

    class Dev:
        def __init__(self, i=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cp.cuda.Device = Dev
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(kernel_loader, "get_function", lambda name, device_id=None: name)
    monkeypatch.setattr(kernel_loader, "load_kernels", lambda names, device_id=None: {n: n for n in names})
    launches = []

    class FakeLauncher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args
            self.driver = None

        def __call__(self, grid, block, stream, grid_y=1):
            P = self.args
            bsz = P.bsz
            dec = _view(P.seq_lens_decoder, bsz)
            q = _view(P.seq_lens_this_time, bsz)
            ref = step_addressing(dec.copy(), q.copy(), [np.zeros((max(bsz, 1), 1), np.int32)], [1], P.capacity)
            _view(P.batch_id_per_token, P.capacity)[:] = ref.outputs.batch_id_per_token
            if grid_y == 2:
                assert self.fn.endswith(", true>"), self.fn  # the kernel's DSA instantiation
                run_dsa_token_writes(P, ref.outputs.batch_id_per_token, ref.outputs.position_ids)
                writes = run_dsa_blocks(P, grid, block)
                assert (writes == 1).all(), np.flatnonzero(writes != 1)[:8]  # every token once
            launches.append((self.fn, grid, block, grid_y))

    monkeypatch.setattr(kernel_loader, "Launcher", FakeLauncher)
    from kvaddr.planner import StepPlanner

    return StepPlanner, launches


def _case(rng, bsz, *, B=64, **kw):
    return dsa_case(rng, bsz, **kw)


def _expect(dec, q, tables, sizes, C, M, **kw):
    return step_addressing(dec, q, tables, sizes, C, dsa=True, max_requests=M, **kw).outputs.dsa


def _compare(out, exp):
    for name in DSA_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), getattr(exp, name), err_msg=name)


def test_struct_fields_and_second_row(fake_planner):
    StepPlanner, launches = fake_planner
    p = StepPlanner(8, 16, [64, 64], dsa=True, dsa_cache=1, dsa_decode_len=2, dsa_value_bytes=96, dsa_scale_bytes=8)
    P = p._params
    assert (P.dsa, P.dsa_cache, P.dsa_decode_len, P.dsa_value_bytes, P.dsa_scale_bytes, P.dsa_cu_len) == (
        1,
        1,
        2,
        96,
        8,
        9,
    )
    assert P.dsa_value_offsets == p.dsa_value_offsets.data.ptr and P.dsa_cu_seq_lens == p.dsa_cu_seq_lens.data.ptr
    rng = np.random.default_rng(0)
    dec, q, table = _case(rng, 5, n=2)
    out = p.compute(_dev(dec), _dev(q), _dev(table))
    assert launches[-1][3] == 2
    assert out.dsa.req_id_per_token is p.batch_id_per_token
    assert out.dsa.value_offsets.dtype == np.int64 and out.dsa.ks.dtype == np.int32
    assert out.dsa.cu_seq_lens.shape == (9,)
    _compare(
        out.dsa,
        _expect(dec, q, [table, table], [64, 64], 16, 8, dsa_decode_len=2, dsa_value_bytes=96, dsa_scale_bytes=8),
    )


def test_off_is_one_row_and_no_outputs(fake_planner):
    StepPlanner, launches = fake_planner
    p = StepPlanner(8, 16, [64])
    assert p._params.dsa == 0 and p._params.dsa_value_offsets == 0
    dec, q, table = _case(np.random.default_rng(1), 4)
    out = p.compute(_dev(dec), _dev(q), _dev(table))
    assert launches[-1][3] == 1 and out.dsa is None
    assert not launches[-1][0].endswith(", true>")


def test_bad_options(fake_planner):
    StepPlanner, _ = fake_planner
    with pytest.raises(ValueError, match="dsa needs at least one cache"):
        StepPlanner(8, 16, [], dsa=True)
    with pytest.raises(ValueError, match="dsa_cache"):
        StepPlanner(8, 16, [64], dsa=True, dsa_cache=1)
    with pytest.raises(ValueError, match="dsa_decode_len"):
        StepPlanner(8, 16, [64], dsa=True, dsa_decode_len=0)
    with pytest.raises(TypeError, match="dsa must be a bool"):
        StepPlanner(8, 16, [64], dsa="yes")


def test_worked_example(fake_planner):
    """docs/dsa.md's worked example: a decode at position 6 (table [5, 2]) and a prefill chunk at
    positions 2, 3, 4 (table [9, 3]), B = 4."""
    StepPlanner, _ = fake_planner
    p = StepPlanner(2, 6, [4], dsa=True)
    dec = np.array([6, 2], np.int32)
    q = np.array([1, 3], np.int32)
    table = np.array([[5, 2], [9, 3]], np.int32)
    d = p.compute(_dev(dec), _dev(q), _dev(table)).dsa
    assert d.req_id_per_token.tolist() == [0, 1, 1, 1, -1, -1]
    assert d.ctx.tolist() == [7, 3, 4, 5, 0, 0]
    assert d.ks.tolist() == [0, 0, 0, 0, 0, 0] and d.ke.tolist() == [0, 3, 4, 5, 0, 0]
    assert d.cu_seq_lens.tolist() == [0, 5, 5]
    # slot 38 (token 2): value 9 * 528 + 2 * 128, scale 9 * 528 + 4 * 128 + 2 * 4
    assert d.value_offsets[1] == 5008 and d.scale_offsets[1] == 5272
    assert d.value_offsets[4:].tolist() == [-1, -1]


@pytest.mark.parametrize(
    "bsz, M, C, n, family",
    [
        (0, 4, 8, 1, "step_small"),  # empty batch: all padding
        (64, 64, 64, 1, "step_small"),  # decode 64
        (37, 40, 300, 3, "step_small"),  # MTP n = 3, mixed, non-power-of-two
        (300, 300, 2000, 1, "step_wide"),  # more requests than threads
        (1030, 1100, 4000, 2, "step_wide"),  # > 1024 requests
        (4200, 4300, 4400, 1, "step_multiblock"),  # two tiles of 4096 requests
        (9000, 9000, 9500, 1, "step_multiblock"),  # three
    ],
)
def test_batches_against_reference(fake_planner, bsz, M, C, n, family):
    StepPlanner, launches = fake_planner
    rng = np.random.default_rng(bsz + C)
    p = StepPlanner(M, C, [64, 64], dsa=True, dsa_decode_len=n)
    decodes = bsz if bsz * n + 1 >= C else None
    dec, q, table = _case(rng, bsz, n=n, decodes=decodes)
    # keep the tokens within a few capacities (some steps overflow C: those tokens are dropped)
    while q.sum() > 2 * C:
        q[q > n] = np.maximum(q[q > n] // 2, n + 1)
        if decodes is None and (q > n).sum():
            q[np.flatnonzero(q > n)[-1]] = n
    out = p.compute(_dev(dec), _dev(q), _dev(table))
    assert launches[-1][0].split("<")[0] == family, launches[-1]
    _compare(out.dsa, _expect(dec, q, [table, table], [64, 64], C, M, dsa_decode_len=n))


# (requests, the one request past the DSA blocks' first tile that is not a plain decode, its
# seq_lens_decoder): the vote reads seq_lens_this_time alone past the first tile
VOTE_CASES = [
    (4096, None, 0),  # a decode step: one round of 16-byte loads
    (4095, 4094, 7),  # the only prefill the last request, bsz % 4 = 3 (the part group of 4)
    (4093, 4092, 7),  # bsz % 4 = 1
    (2000, 1500, 7),  # a prefill in the middle
    (3000, 2900, -3),  # a bad request with n > dsa_decode_len: the vote says prefill, the outputs a decode step's
    (1030, 1029, -3),  # the same at the last request
]


@pytest.mark.parametrize("bsz, at, d", VOTE_CASES)
def test_vote_past_the_first_tile(fake_planner, bsz, at, d):
    StepPlanner, _ = fake_planner
    rng = np.random.default_rng(bsz)
    C = bsz + 40
    p = StepPlanner(bsz, C, [64, 64], dsa=True)
    dec, q, table = _case(rng, bsz, decodes=bsz)
    if at is not None:
        dec[at], q[at] = d, 9
    out = p.compute(_dev(dec), _dev(q), _dev(table))
    exp = _expect(dec, q, [table, table], [64, 64], C, bsz)
    _compare(out.dsa, exp)
    assert (exp.ke != 0).any() == (at is not None and d >= 0)  # a prefill's ke, or a decode step's zeros


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bsz=st.integers(0, 40),
    C=st.integers(1, 200),
    n=st.integers(1, 4),
    B=st.sampled_from([1, 3, 16, 64, 100]),
    width=st.integers(1, 12),
    idle=st.sampled_from([0.0, 0.3]),
    bad=st.sampled_from([0.0, 0.2]),
    neg=st.sampled_from([0.0, 0.2]),
    vs=st.sampled_from([(128, 4), (64, 2), (7, 3)]),
    seed=st.integers(0, 2**31),
)
def test_hypothesis_against_reference(fake_planner, bsz, C, n, B, width, idle, bad, neg, vs, seed):
    """Any mix of decodes, prefills, idle and bad requests, rows too short (block index past the
    width), negative block ids, steps past the capacity, block sizes not powers of two."""
    StepPlanner, _ = fake_planner
    rng = np.random.default_rng(seed)
    p = StepPlanner(max(bsz, 1), C, [B], dsa=True, dsa_decode_len=n, dsa_value_bytes=vs[0], dsa_scale_bytes=vs[1])
    dec, q, table = _case(rng, bsz, n=n, width=width, B=B, max_pos=B * width + 8, idle=idle, bad=bad, neg_block=neg)
    out = p.compute(_dev(dec), _dev(q), _dev(table))
    exp = _expect(dec, q, table, B, C, max(bsz, 1), dsa_decode_len=n, dsa_value_bytes=vs[0], dsa_scale_bytes=vs[1])
    _compare(out.dsa, exp)


@settings(max_examples=40, deadline=None)
@given(nd=st.integers(0, 12), npf=st.integers(0, 12), n=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_reference_matches_indexer_metadata(nd, npf, n, seed):
    """Decodes first (n tokens each), then prefills: the step's DSA outputs are the oracle's
    indexer_metadata and indexer_cache_offsets, token for token."""
    rng = np.random.default_rng(seed)
    bsz = nd + npf
    dec, q, table = _case(rng, bsz, n=n, decodes=nd, width=80, B=64, max_pos=2000)
    C = int(q.sum()) + 5
    r = step_addressing(dec, q, table, 64, C, dsa=True, dsa_decode_len=n)
    d, T = r.outputs.dsa, int(q.sum())
    seq = dec.astype(np.int64) + q
    m = indexer_metadata(seq, q, nd) if bsz else None
    if m is not None:
        np.testing.assert_array_equal(d.ctx[:T], m.ctx)
        if nd:
            np.testing.assert_array_equal(d.ctx[: nd * n].reshape(nd, n), m.decode_ctx)
        np.testing.assert_array_equal(d.ks[nd * n : T], m.ks)
        np.testing.assert_array_equal(d.ke[nd * n : T], m.ke)
        np.testing.assert_array_equal(d.cu_seq_lens[: npf + 1], m.cu_seq_lens)
        np.testing.assert_array_equal(d.req_id_per_token[:T], m.req_id_per_token)
    off = indexer_cache_offsets(r.outputs.slot_mapping[0], 64)
    np.testing.assert_array_equal(d.value_offsets, off.value)
    np.testing.assert_array_equal(d.scale_offsets, off.scale)
    assert (d.ks[: nd * n] == 0).all() and (d.ke[: nd * n] == 0).all()


@pytest.mark.parametrize("attention", [None, "varlen"])
@pytest.mark.parametrize("M", [1, 64, 256, 300, 1024, 2048, 4096, 5000])
@pytest.mark.parametrize("C", [1, 64, 4096, 65536])
def test_dispatch_keeps_the_dsa_kernels_within_their_launch_bounds(M, C, attention):
    """step_small and step_wide's DSA instantiations are compiled for at most
    KV_DSA_SMALL_THREADS threads per block (their launch bounds): the dispatch table never
    launches them wider, at any batch size."""
    from kvaddr import dispatch
    from kvaddr.attention_reference import normalize_attention

    limit = kernel_loader.constants()["KV_DSA_SMALL_THREADS"]
    groups = normalize_attention(attention)
    cfg = dispatch.StepConfig(2, True, C, M, groups, None, 132, dsa=True)
    for bsz in sorted({0, 1, M // 2, M - 1, M, 256, 257, 512, 513, 1024, 1025, 2048, 2049} & set(range(M + 1))):
        launch = dispatch.step_launch(cfg, bsz)
        assert launch.kernel.endswith(", true>"), launch
        if launch.kernel.startswith(("step_small<", "step_wide<")):
            assert launch.threads <= limit, (bsz, launch)
        assert launch.kernel in dispatch.step_kernels(cfg), launch
