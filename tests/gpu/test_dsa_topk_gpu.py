"""kvaddr.dsa.topk_to_slots on the GPU against the NumPy reference (kvaddr.dsa_reference): K = 2048
with T from 1 to 16k tokens, short requests (rows ending in -1s), indices past the context,
B = 64 and non-powers of two, the layers form, DCP, compaction, scalar rows (K % 4 != 0), padding
tokens, sticky records, CUDA-graph replay, and the baseline (the engines' design) on valid input."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.dsa_reference import ERR_PAST_CONTEXT, NO_ERROR_KEY, topk_error_key
from kvaddr.dsa_reference import topk_to_slots as reference
from tests.support.gpu import device_copy, requires_gpu

pytestmark = requires_gpu


def make(rng, t, k, b, *, layers=1, reqs=None, past=0.0, width_extra=0, bad_ids=False):
    """Host inputs: requests of 1..4k tokens of context, rows of short requests ending in -1s,
    a fraction ``past`` of entries at or past their token's context."""
    reqs = reqs or max(1, min(t, 64))
    max_ctx = 4096
    width = -(-max_ctx // b) + width_extra
    table = rng.integers(0, 1 << 20, size=(reqs, width)).astype(np.int32)
    if bad_ids:
        table[rng.random(table.shape) < 0.05] = -1
    req = rng.integers(0, reqs, size=t).astype(np.int32)
    ctx = rng.integers(1, max_ctx + 1, size=t).astype(np.int32)
    ctx[: max(1, t // 4)] = rng.integers(1, max(2, k // 2), size=max(1, t // 4))
    u = rng.random((layers, t, k))
    topk = (u * ctx[None, :, None]).astype(np.int64)
    n_valid = np.minimum(ctx, k)
    topk = np.where(np.arange(k)[None, None, :] < n_valid[None, :, None], topk, -1)
    if past:
        hit = rng.random(topk.shape) < past
        topk = np.where(hit, ctx[None, :, None] + rng.integers(0, 3 * b, size=topk.shape), topk)
    topk = topk.astype(np.int32)
    return (topk if layers > 1 else topk[0]), req, table, ctx


def run(topk, req, table, b, ctx, **kw):
    import cupy

    from kvaddr.dsa import topk_slot_errors, topk_to_slots

    d = [cupy.asarray(x) for x in (topk, req, table, ctx)]
    out = topk_to_slots(d[0], d[1], d[2], b, d[3], **kw)
    masks, keys = topk_slot_errors(out.errors)
    return cupy.asnumpy(out.slots), cupy.asnumpy(out.valid_counts), masks, keys


def assert_matches(topk, req, table, b, ctx, **kw):
    slots, counts, masks, keys = run(topk, req, table, b, ctx, **kw)
    want = reference(topk, req, table, b, ctx, **kw)
    np.testing.assert_array_equal(slots, want.slots)
    np.testing.assert_array_equal(counts, want.valid_counts)
    np.testing.assert_array_equal(masks, np.atleast_1d(want.error_mask))
    np.testing.assert_array_equal(keys, np.atleast_1d(np.asarray(want.error_key, dtype=np.uint64)))
    return want


@pytest.mark.parametrize("t", [1, 2, 63, 64, 1000, 1024, 4099, 8192, 16384])
@pytest.mark.parametrize("compact", [False, True])
def test_k2048_matches_the_reference(t, compact):
    rng = np.random.default_rng(t)
    topk, req, table, ctx = make(rng, t, 2048, 64, past=0.001 if t % 2 else 0.0)
    want = assert_matches(topk, req, table, 64, ctx, compact=compact)
    assert (want.valid_counts < 2048).any()  # short requests present


@pytest.mark.parametrize("k", [256, 2048])
def test_compact_rows_beside_rows_with_holes(k):
    """Good entries only: rows already compact (valid entries first), rows with -1s among them
    (one hole near each end of both halves of the row or at either end of a warp's columns, or 1
    in 16 entries), and blocks of each kind and of both kinds; no errors."""
    from kvaddr.dsa import topk_kernel

    shift, per_block = topk_kernel(k, 4)
    half = 4 << shift
    rng = np.random.default_rng(k)
    b, ctx_len = 64, 4 * k
    table = rng.permutation(1 << 16)[: 4 * (ctx_len // b)].reshape(4, ctx_len // b).astype(np.int32)
    rows = []
    cases = [(n, h) for n in (1, 5, half - 1, half, half + 1, k - 1, k) for h in (None, 0, n - 1, max(0, n - 3))]
    cases += [(n, 4 * ((n - 1) // 4)) for n in (5, half + 1, k)]  # the first entry of the last int4
    cases += [
        (n, h) for n in {min(half, k), k} for j in range(1, n // 128 + 1) for h in (128 * j - 1, 128 * j) if h < n
    ]  # a warp's ends
    for n, h in cases:
        row = np.full(k, -1)
        row[:n] = rng.permutation(ctx_len)[:n]
        if h is not None:
            row[h] = -1
        rows.append(row)
        for _ in range(per_block - 1):  # the rest of its block: already compact
            row = np.full(k, -1)
            m = int(rng.integers(0, k + 1))
            row[:m] = rng.permutation(ctx_len)[:m]
            rows.append(row)
    for _ in range(64 * per_block):  # rows with many holes or none, mixed in blocks
        row = rng.permutation(ctx_len)[:k]
        if rng.random() < 0.5:
            row[rng.random(k) < 1 / 16] = -1
        rows.append(row)
    topk = np.array(rows, dtype=np.int32)
    t = len(rows)
    req = rng.integers(0, 4, size=t).astype(np.int32)
    want = assert_matches(topk, req, table, b, np.full(t, ctx_len, np.int32), compact=True)
    assert want.error_mask == 0 and (want.valid_counts < k).any() and (want.valid_counts == k).any()


@pytest.mark.parametrize("b", [1, 13, 16, 64, 100])
@pytest.mark.parametrize("k", [1, 7, 64, 130, 512, 2048, 2051, 5000])
@pytest.mark.parametrize("compact", [False, True])
def test_block_sizes_and_widths(b, k, compact):
    rng = np.random.default_rng(b * 10007 + k)
    topk, req, table, ctx = make(rng, 300, k, b, past=0.01, width_extra=-3, bad_ids=True)
    assert_matches(topk, req, table, b, ctx, compact=compact)


@pytest.mark.parametrize("compact", [False, True])
def test_long_contexts_beside_short_ones(compact):
    # K = 2048, B = 64: a token's reachable table prefix (ceil(ctx / B) entries) fits the block's
    # shared memory up to 128k tokens of context and is read from global memory past it; both
    # kinds in one launch, with entries past the context and negative block ids.
    rng = np.random.default_rng(7)
    t, k, b, reqs = 600, 2048, 64, 16
    width = 300_000 // b
    table = rng.integers(0, 1 << 24, size=(reqs, width)).astype(np.int32)
    table[rng.random(table.shape) < 0.01] = -1
    req = rng.integers(0, reqs, size=t).astype(np.int32)
    ctx = rng.choice([100, 2047, 2048 * b, 2048 * b + 1, 299_999], size=t).astype(np.int32)
    topk = (rng.random((t, k)) * (ctx[:, None] + 50)).astype(np.int32)
    topk[rng.random((t, k)) < 0.1] = -1
    want = assert_matches(topk, req, table, b, ctx, compact=compact)
    assert want.error_mask & ERR_PAST_CONTEXT and (want.valid_counts > k // 2).any()


@pytest.mark.parametrize("compact", [False, True])
def test_layers_at_once(compact):
    rng = np.random.default_rng(61)
    topk, req, table, ctx = make(rng, 70, 2048, 64, layers=5, past=0.002)
    assert_matches(topk, req, table, 64, ctx, compact=compact)


@pytest.mark.parametrize("cp, inter", [(2, 1), (4, 8), (3, 64)])
@pytest.mark.parametrize("compact", [False, True])
def test_dcp_ranks(cp, inter, compact):
    rng = np.random.default_rng(cp * 100 + inter)
    topk, req, table, ctx = make(rng, 257, 2048, 64, past=0.001)
    total = np.zeros(257, np.int64)
    for rank in range(cp):
        want = assert_matches(topk, req, table, 64, ctx, compact=compact, cp_size=cp, cp_rank=rank, cp_interleave=inter)
        total += want.valid_counts
    inside = ((topk >= 0) & (topk < ctx[:, None])).sum(axis=1)
    assert (total == inside).all()


def test_padding_tokens_and_sticky_records():
    import cupy

    from kvaddr.dsa import topk_slot_errors, topk_to_slots

    topk = cupy.asarray(np.array([[0, 1, 2, 3], [9, 9, 9, 9], [8, 0, -1, 1]], np.int32))
    req = cupy.asarray(np.array([0, -1, 0], np.int32))
    table = cupy.asarray(np.array([[5, 2, 7]], np.int32))
    errors = cupy.asarray(np.array([[0, NO_ERROR_KEY]], np.uint64))
    out = topk_to_slots(topk, req, table, 4, cupy.asarray(np.array([4, 0, 5], np.int32)), errors=errors)
    topk_to_slots(topk, req, table, 4, cupy.asarray(np.array([4, 0, 9], np.int32)), errors=errors)
    assert cupy.asnumpy(out.valid_counts).tolist() == [4, 0, 2]
    assert cupy.asnumpy(out.slots)[1].tolist() == [-1] * 4
    masks, keys = topk_slot_errors(errors)
    assert masks.tolist() == [ERR_PAST_CONTEXT] and int(keys[0]) == topk_error_key(2, 0, ERR_PAST_CONTEXT)
    assert topk_slot_errors(errors)[0].tolist() == [0]


def test_graph_replay_rewrites_every_element():
    import cupy

    from kvaddr.strategies.dsa_topk import KvaddrTopkSlots

    rng = np.random.default_rng(5)
    topk, req, table, ctx = make(rng, 512, 2048, 64)
    conv = KvaddrTopkSlots(512, 2048, 64, compact=True)
    # after the construction: device_copy's wait also covers the error records it set on CuPy's current stream
    d = device_copy([topk, req, table, ctx])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = conv.compute(*d, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        conv.compute(*d, stream=stream)
        graph = stream.end_capture()
        out.slots.fill(0x5A5A5A5A)
        out.valid_counts.fill(0x5A5A5A5A)
        new = make(np.random.default_rng(6), 512, 2048, 64)
        for x, h in zip(d, new):
            x.set(h, stream=stream)  # same buffers, new values: the graph reads them
        graph.launch(stream)
        stream.synchronize()
    want = reference(*new[:3], 64, new[3], compact=True)
    np.testing.assert_array_equal(cupy.asnumpy(out.slots), want.slots)
    np.testing.assert_array_equal(cupy.asnumpy(out.valid_counts), want.valid_counts)


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_baseline_equals_the_reference_on_valid_input(t):
    import cupy

    from kvaddr.strategies.dsa_topk import BaselineTopkSlots

    rng = np.random.default_rng(t + 1)
    topk, req, table, ctx = make(rng, t, 2048, 64, layers=3)
    want = reference(topk, req, table, 64, ctx)
    assert not np.asarray(want.error_mask).any()
    base = BaselineTopkSlots(t, 2048, 64, num_layers=3)
    out = base.compute(*(cupy.asarray(x) for x in (topk, req, table, ctx)))
    np.testing.assert_array_equal(cupy.asnumpy(out.slots), want.slots)
