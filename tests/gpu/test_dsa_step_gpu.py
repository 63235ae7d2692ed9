"""The core step's DSA outputs (docs/dsa.md, kvaddr/kernels/dsa_step.cuh) on the GPU, against the
NumPy reference (kvaddr.reference.step_addressing with ``dsa=True``): every kernel of the dispatch
table (step_small, step_wide, step_multiblock, each also with attention outputs) and the
multi-block kernel forced at every size; decode batches (B = 64 and not a power of two), MTP
decodes with n > 1, mixed decode / prefill steps, idle and bad requests, more than 1024 requests,
steps past the capacity; every element rewritten (poisoned buffers); the step's own outputs
unchanged by the second grid row; every kernel family (small, wide, multi-block, attention
variants) on decode, MTP, mixed and bad batches with padding; CUDA-graph replays with the inputs' contents changed; a
BoundStep. Skips, with the reason, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.outputs import DSA_FIELDS
from kvaddr.reference import step_addressing
from tests.support.dsa_cases import dsa_case
from tests.support.gpu import assert_attention_equal, assert_outputs_equal, force_multiblock, requires_gpu

pytestmark = requires_gpu

DSA_BUFFERS = ("dsa_value_offsets", "dsa_scale_offsets", "dsa_ks", "dsa_ke", "dsa_ctx", "dsa_cu_seq_lens")


def _planner(M, C, sizes, n=1, attention=None, N=None, **kw):
    from kvaddr import StepPlanner

    return StepPlanner(M, C, sizes, dsa=True, dsa_decode_len=n, attention=attention, kv_indices_capacity=N, **kw)


def _poison(p):
    for name in (*DSA_BUFFERS, "batch_id_per_token", "position_ids", "slot_mapping"):
        getattr(p, name).fill(0x5A5A5A5A)


def _run_and_check(p, dec, q, table, label, *, n=1, attention=None, N=None, multiblock=False):
    import cupy

    sizes = list(p.block_sizes)
    tables = [table] * len(sizes)
    ref = step_addressing(
        dec,
        q,
        tables,
        sizes,
        p.capacity,
        attention=attention,
        kv_indices_capacity=N,
        dsa=True,
        dsa_cache=p.dsa_cache,
        dsa_decode_len=n,
        dsa_value_bytes=p.dsa_value_bytes,
        dsa_scale_bytes=p.dsa_scale_bytes,
        max_requests=p.max_requests,
    )
    force_multiblock(p, multiblock)
    _poison(p)
    t = cupy.asarray(table)
    out = p.compute(cupy.asarray(dec), cupy.asarray(q), [t] * len(sizes))
    cupy.cuda.runtime.deviceSynchronize()
    assert_outputs_equal(out, ref.outputs, label)
    if attention:
        assert_attention_equal(out.attention, ref.outputs.attention, label)
    for f in DSA_FIELDS:
        g, w = getattr(out.dsa, f).get(), getattr(ref.outputs.dsa, f)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{label}: {f} {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if not np.array_equal(g, w):
            bad = int(np.argwhere(g != w)[0][0])
            raise AssertionError(f"{label}: {f} differs at {bad}: got {g[bad]}, want {w[bad]}")
    mask, _ = p.errors()
    assert mask == ref.error_mask, f"{label}: error mask {mask} != {ref.error_mask}"
    return out


@pytest.mark.parametrize("multiblock", [False, True], ids=["dispatch", "multiblock"])
@pytest.mark.parametrize("B", [64, 48, 100])
@pytest.mark.parametrize("bsz", [1, 64, 255, 300, 1030, 4096])
def test_decode_batches(bsz, B, multiblock):
    rng = np.random.default_rng(bsz * 7 + B)
    dec, q, table = dsa_case(rng, bsz, decodes=bsz, width=64, max_pos=B * 60)
    p = _planner(bsz, bsz, [B, B])
    _run_and_check(p, dec, q, table, f"decode {bsz}, B {B}", multiblock=multiblock)


@pytest.mark.parametrize("multiblock", [False, True], ids=["dispatch", "multiblock"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("bsz", [7, 64, 333, 1500])
def test_mtp_decodes(bsz, n, multiblock):
    rng = np.random.default_rng(bsz + n)
    dec, q, table = dsa_case(rng, bsz, n=n, decodes=bsz, max_pos=3000)
    p = _planner(bsz, bsz * n, [64], n=n)
    _run_and_check(p, dec, q, table, f"mtp {bsz} x {n}", n=n, multiblock=multiblock)


@pytest.mark.parametrize("multiblock", [False, True], ids=["dispatch", "multiblock"])
@pytest.mark.parametrize("bsz, C", [(3, 64), (40, 2048), (200, 8192), (1100, 16384), (4300, 16384)])
def test_mixed_steps(bsz, C, multiblock):
    rng = np.random.default_rng(bsz + C)
    dec, q, table = dsa_case(rng, bsz, n=2, idle=0.1, chunk=12, max_pos=2000)
    p = _planner(bsz, C, [64, 64], n=2)
    _run_and_check(p, dec, q, table, f"mixed {bsz}", n=2, multiblock=multiblock)


# (requests, the one request that is not a plain decode, its seq_lens_decoder): the DSA blocks'
# vote reads seq_lens_this_time alone past their first tile, 16 bytes a load when it is aligned
VOTE_CASES = [
    (4096, None, 0),  # a decode step
    (4095, 4094, 7),  # the only prefill the last request (bsz % 4 = 3)
    (4093, 4092, 7),  # bsz % 4 = 1
    (2000, 1500, 7),  # a prefill in the middle
    (3000, 2900, -3),  # a bad request with n > dsa_decode_len past the first tile
    (6000, 5999, 7),  # step_multiblock
]


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
@pytest.mark.parametrize("bsz, at, d", VOTE_CASES)
def test_vote_past_the_first_tile(bsz, at, d, aligned):
    """A decode step, or one prefill (or bad request) past the DSA blocks' first tile; the lengths
    also 4 bytes past a 16-byte boundary (the vote's scalar loads)."""
    import cupy

    rng = np.random.default_rng(bsz)
    dec, q, table = dsa_case(rng, bsz, decodes=bsz)
    if at is not None:
        dec[at], q[at] = d, 9
    C = bsz + 40
    p = _planner(bsz, C, [64, 64])
    ref = step_addressing(dec, q, [table] * 2, [64, 64], C, dsa=True, max_requests=bsz)
    _poison(p)
    shift = 0 if aligned else 1
    dev_dec = cupy.asarray(np.concatenate([np.zeros(shift, np.int32), dec]))[shift:]
    dev_q = cupy.asarray(np.concatenate([np.zeros(shift, np.int32), q]))[shift:]
    assert (dev_q.data.ptr % 16 == 0) == aligned
    out = p.compute(dev_dec, dev_q, [cupy.asarray(table)] * 2)
    cupy.cuda.runtime.deviceSynchronize()
    for f in DSA_FIELDS:
        np.testing.assert_array_equal(getattr(out.dsa, f).get(), getattr(ref.outputs.dsa, f), err_msg=f)
    assert p.errors()[0] == ref.error_mask


def test_many_requests_past_the_capacity():
    rng = np.random.default_rng(5)
    dec, q, table = dsa_case(rng, 5000, n=1, chunk=8)
    p = _planner(6000, 4000, [64])
    _run_and_check(p, dec, q, table, "past capacity")


@settings(max_examples=60, deadline=None)
@given(
    bsz=st.integers(0, 300),
    C=st.integers(1, 3000),
    n=st.integers(1, 4),
    B=st.sampled_from([1, 16, 48, 64, 100]),
    width=st.integers(1, 80),
    flags=st.sampled_from([(0.0, 0.0, 0.0), (0.2, 0.1, 0.05)]),
    vs=st.sampled_from([(128, 4), (64, 2)]),
    multiblock=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_hypothesis(bsz, C, n, B, width, flags, vs, multiblock, seed):
    """Any mix of decodes, prefills, idle and bad requests, short rows, negative block ids."""
    rng = np.random.default_rng(seed)
    idle, bad, neg = flags
    dec, q, table = dsa_case(rng, bsz, n=n, width=width, max_pos=B * width + 8, idle=idle, bad=bad, neg_block=neg)
    p = _planner(max(bsz, 1), C, [B], n=n, dsa_value_bytes=vs[0], dsa_scale_bytes=vs[1])
    _run_and_check(p, dec, q, table, "hypothesis", n=n, multiblock=multiblock)


@pytest.mark.parametrize("multiblock", [False, True], ids=["dispatch", "multiblock"])
@pytest.mark.parametrize("bsz", [20, 700])
def test_with_attention_outputs(bsz, multiblock):
    rng = np.random.default_rng(bsz)
    dec, q, table = dsa_case(rng, bsz, n=1, chunk=10, max_pos=2000)
    groups = ("flashinfer", "varlen", "page_table")
    N = 64 * (bsz + 1)
    p = _planner(bsz, 8192, [64, 64], attention=groups, N=N)
    _run_and_check(p, dec, q, table, f"attention {bsz}", attention=groups, N=N, multiblock=multiblock)


ATTENTION = ("flashinfer", "varlen", "page_table")
# (the kernel family the planner runs, requests, attention groups, every batch on step_multiblock)
FAMILIES = [
    ("step_small<", 40, None, False),
    ("step_wide<", 700, None, False),
    ("step_wide<", 3000, None, False),
    ("step_multiblock<", 40, None, True),  # its small-batch path
    ("step_multiblock<", 5000, None, False),  # its large-batch path (tickets)
    ("step_small_attention<", 40, ATTENTION, False),
    ("step_wide_attention<", 3000, ATTENTION, False),
    ("step_multiblock<", 5000, ATTENTION, False),
]
# (label, decode_len n, dsa_case arguments): a decode step (plain, MTP), decodes with prefills,
# bad requests (a negative length), short rows and negative block ids
KINDS = [
    ("decode", 1, dict(decodes=None)),
    ("mtp", 2, dict(decodes=None)),
    ("mixed", 2, dict(idle=0.1, chunk=12)),
    ("bad rows", 1, dict(bad=0.1, idle=0.1, neg_block=0.05, width=8, max_pos=64 * 10, chunk=9)),
]


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"{f[0].rstrip('<')}-{f[1]}-{'attn' if f[2] else 'plain'}")
def test_every_kernel_family(family, kind):
    """Every kernel family's DSA instantiation (the token writes' value / scale / ctx and the DSA
    blocks' ks / ke / cu_seq_lens) on decode, MTP, mixed and bad batches, with padding: the
    capacity exceeds the tokens."""
    prefix, bsz, attention, multiblock = family
    label, n, kw = kind
    rng = np.random.default_rng(bsz * 31 + len(label))
    kw = dict(kw)
    if kw.get("decodes", 0) is None:
        kw["decodes"] = bsz  # every request a decode of n tokens
    dec, q, table = dsa_case(rng, bsz, n=n, **kw)
    C = int(np.clip(q, 0, None).sum()) + 37
    N = 64 * (bsz + 1) if attention else None
    p = _planner(bsz, C, [64, 48], n=n, attention=attention, N=N)
    force_multiblock(p, multiblock)
    assert p.kernel_for(bsz)[0].startswith(prefix) and p.kernel_for(bsz)[0].endswith(", true>"), p.kernel_for(bsz)
    _run_and_check(p, dec, q, table, f"{prefix} {bsz} {label}", n=n, attention=attention, N=N, multiblock=multiblock)


@pytest.mark.parametrize("dsa_cache", [0, 1, 2])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"{f[0].rstrip('<')}-{f[1]}-{'attn' if f[2] else 'plain'}")
def test_every_kernel_family_with_the_indexer_cache_anywhere(family, dsa_cache):
    """Three caches of block sizes 48, 64 and 16: the token writes take the DSA offsets from the
    indexer cache's slot whichever cache it is."""
    prefix, bsz, attention, multiblock = family
    rng = np.random.default_rng(bsz + dsa_cache)
    dec, q, table = dsa_case(rng, bsz, n=1, idle=0.1, chunk=7, neg_block=0.02, width=300, max_pos=16 * 280)
    C = int(np.clip(q, 0, None).sum()) + 5
    N = 300 * (bsz + 1) if attention else None
    p = _planner(bsz, C, [48, 64, 16], attention=attention, N=N, dsa_cache=dsa_cache)
    force_multiblock(p, multiblock)
    assert p.kernel_for(bsz)[0].startswith(prefix), p.kernel_for(bsz)
    _run_and_check(
        p, dec, q, table, f"{prefix} {bsz} cache {dsa_cache}", attention=attention, N=N, multiblock=multiblock
    )


@pytest.mark.parametrize("bsz", [64, 1030])
def test_graph_replay(bsz):
    """One compute() captured in a CUDA graph, replayed after the inputs' contents change
    (decode, mixed, a shorter step): every DSA output follows, padding included."""
    import cupy

    C, n = 4 * bsz, 2
    p = _planner(bsz, C, [64], n=n)
    width = 64
    d = cupy.zeros(bsz, np.int32)
    q = cupy.zeros(bsz, np.int32)
    t = cupy.zeros((bsz, width), np.int32)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p.compute(d, q, t, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        p.compute(d, q, t, stream=stream)
        graph = stream.end_capture()
    rng = np.random.default_rng(bsz)
    steps = [
        dsa_case(rng, bsz, n=n, decodes=bsz),
        dsa_case(rng, bsz, n=n, chunk=5),
        dsa_case(rng, bsz, n=n, decodes=bsz // 2, idle=0.7),
    ]
    for i, (dec, qq, table) in enumerate(steps):
        table = table[:, :width]
        ref = step_addressing(dec, qq, table, 64, C, dsa=True, dsa_decode_len=n, max_requests=bsz)
        with stream:
            d.set(dec, stream=stream)
            q.set(qq, stream=stream)
            t.set(np.ascontiguousarray(table), stream=stream)
            graph.launch(stream)
        stream.synchronize()
        out = p._outputs(bsz)
        for f in DSA_FIELDS:
            np.testing.assert_array_equal(getattr(out.dsa, f).get(), getattr(ref.outputs.dsa, f), err_msg=f"{i} {f}")
        p.clear_errors(stream)


def test_bound_step():
    import cupy

    rng = np.random.default_rng(9)
    dec, q, table = dsa_case(rng, 50, n=1, chunk=6)
    p = _planner(64, 512, [64])
    dd, qd, td = cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table)
    bound = p.bind(dd, qd, td)
    _poison(p)
    out = bound.launch(50)
    cupy.cuda.runtime.deviceSynchronize()
    ref = step_addressing(dec, q, table, 64, 512, dsa=True, max_requests=64)
    for f in DSA_FIELDS:
        np.testing.assert_array_equal(getattr(out.dsa, f).get(), getattr(ref.outputs.dsa, f), err_msg=f)


def test_doc_snippet_prints_what_it_says():
    import contextlib
    import io

    from tests.support.docs import DOCS, expected_prints, snippet

    code = snippet((DOCS / "dsa.md").read_text(), "dsa-step-gpu")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/dsa.md", "exec"), {})
    assert [line.strip() for line in buf.getvalue().splitlines()] == expected_prints(code, explanations=False)
