"""kvaddr.dsa_reference (DeepSeek-V3.2 sparse attention addressing, docs/dsa.md): the worked
example, and every function against a per-element loop of its contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaddr.dsa_reference import (
    ERR_BLOCK_INDEX,
    ERR_NEGATIVE_BLOCK,
    ERR_PAST_CONTEXT,
    NO_ERROR_KEY,
    LayeredTopkSlots,
    TopkSlots,
    decode_topk_error_key,
    indexer_cache_offsets,
    indexer_metadata,
    topk_error_key,
    topk_to_slots,
)

# ----------------------------------------------------------------------------- worked example

EX_TOPK = [[6, 1, 3, 5], [0, 1, 2, -1], [0, 1, 2, 3], [4, 0, 2, 3]]
EX_REQ = [0, 1, 1, 1]
EX_TABLE = [[5, 2], [9, 3]]
EX_CTX = [7, 3, 4, 5]


def test_worked_example_metadata():
    m = indexer_metadata([7, 5], [1, 3], num_decodes=1)
    assert m.num_decodes == 1 and m.num_decode_tokens == 1
    assert m.decode_ctx.tolist() == [[7]]
    assert m.cu_seq_lens.tolist() == [0, 5]
    assert m.ks.tolist() == [0, 0, 0]
    assert m.ke.tolist() == [3, 4, 5]
    assert m.req_id_per_token.tolist() == EX_REQ
    assert m.positions.tolist() == [6, 2, 3, 4]
    assert m.ctx.tolist() == EX_CTX
    assert all(a.dtype == np.int32 for a in (m.decode_ctx, m.cu_seq_lens, m.ks, m.ke, m.ctx))


def test_worked_example_slots():
    # The formula alone, exactly: a context past every index checks nothing else.
    unchecked = topk_to_slots(EX_TOPK, EX_REQ, EX_TABLE, 4, [1 << 30] * 4)
    expect = [[10, 21, 23, 9], [36, 37, 38, -1], [36, 37, 38, 39], [12, 36, 38, 39]]
    assert unchecked.slots.tolist() == expect
    assert unchecked.slots.dtype == np.int32
    # With the tokens' real context lengths (7; 3, 4, 5) every index is inside: same slots.
    r = topk_to_slots(EX_TOPK, EX_REQ, EX_TABLE, 4, EX_CTX)
    assert isinstance(r, TopkSlots)
    assert r.slots.tolist() == expect
    assert r.valid_counts.tolist() == [4, 3, 4, 4]
    assert r.error_mask == 0 and r.error_key == NO_ERROR_KEY and r.first_bad is None
    # The step's slot mapping: each token's own position.
    own = topk_to_slots([[6], [2], [3], [4]], EX_REQ, EX_TABLE, 4, EX_CTX)
    assert own.slots[:, 0].tolist() == [10, 38, 39, 12]
    off = indexer_cache_offsets([38], 4)
    assert (off.value.tolist(), off.scale.tolist()) == ([5008], [5272])


def test_worked_example_one_short_context_is_flagged():
    ctx = [7, 3, 4, 4]  # token 3 with context 4 selected position 4
    r = topk_to_slots(EX_TOPK, EX_REQ, EX_TABLE, 4, ctx)
    assert r.slots[3].tolist() == [-1, 36, 38, 39]
    assert r.error_mask == ERR_PAST_CONTEXT
    assert r.first_bad == (3, 0, ERR_PAST_CONTEXT)
    assert r.error_key == (3 << 32) | (0 << 3) | 2


# ----------------------------------------------------------------------------- per-element oracles


def loop_offsets(slots, b, v, s):
    value, scale = [], []
    for x in slots:
        if x < 0:
            value.append(-1)
            scale.append(-1)
        else:
            blk, off = x // b, x % b
            value.append(blk * b * (v + s) + off * v)
            scale.append(blk * b * (v + s) + b * v + s * off)
    return value, scale


def loop_slots(topk, req, table, b, ctx, cp=1, rank=0, inter=1):
    """(slots, counts, mask, key) of one layer, entry by entry."""
    slots, mask, key = [], 0, NO_ERROR_KEY
    for t, row in enumerate(topk):
        out = []
        for c, p in enumerate(row):
            p = int(p)
            bit = 0
            value = -1
            if p >= 0:
                if p >= ctx[t]:
                    bit = ERR_PAST_CONTEXT
                elif (p // inter) % cp == rank:
                    q = (p // (inter * cp)) * inter + p % inter
                    blk = q // b
                    if blk >= len(table[req[t]]):
                        bit = ERR_BLOCK_INDEX
                    elif table[req[t]][blk] < 0:
                        bit = ERR_NEGATIVE_BLOCK
                    else:
                        value = int(table[req[t]][blk]) * b + q % b
            if bit:
                mask |= bit
                key = min(key, topk_error_key(t, c, bit))
            out.append(value)
        slots.append(out)
    counts = [sum(x >= 0 for x in row) for row in slots]
    return slots, counts, mask, key


@st.composite
def steps(draw, max_layers=1):
    b = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 16, 64]))
    rows = draw(st.integers(1, 8))
    width = draw(st.integers(0, 6))
    table = draw(st.lists(st.lists(st.integers(-3, 50), min_size=width, max_size=width), min_size=rows, max_size=rows))
    t = draw(st.integers(0, 200))
    k = draw(st.integers(1, 64))
    layers = draw(st.integers(1, max_layers))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    req = rng.integers(0, rows, size=t)
    ctx = rng.integers(0, b * (width + 1) + 2, size=t)
    hi = b * (width + 2) + 3
    topk = rng.integers(-1, hi, size=(layers, t, k))
    # short rows: some tail of each row unused
    cut = rng.integers(0, k + 1, size=(layers, t, 1))
    topk = np.where(np.arange(k)[None, None, :] >= cut, -1, topk)
    return topk, req, np.array(table, dtype=np.int64).reshape(rows, width), b, ctx


@given(steps())
def test_topk_to_slots_matches_the_loop(step):
    topk, req, table, b, ctx = step
    r = topk_to_slots(topk[0].astype(np.int32), req.astype(np.int32), table.astype(np.int32), b, ctx.astype(np.int32))
    slots, counts, mask, key = loop_slots(topk[0], req, table.tolist(), b, ctx)
    assert r.slots.tolist() == slots
    assert r.valid_counts.tolist() == counts
    assert (r.error_mask, r.error_key) == (mask, key)


@given(steps())
def test_compaction_keeps_the_valid_slots_first_in_order(step):
    topk, req, table, b, ctx = step
    plain = topk_to_slots(topk[0], req, table, b, ctx)
    packed = topk_to_slots(topk[0], req, table, b, ctx, compact=True)
    assert packed.valid_counts.tolist() == plain.valid_counts.tolist()
    assert (packed.error_mask, packed.error_key) == (plain.error_mask, plain.error_key)
    for row_p, row_c, n in zip(plain.slots, packed.slots, packed.valid_counts):
        assert row_c[:n].tolist() == [x for x in row_p.tolist() if x >= 0]
        assert (row_c[n:] == -1).all()


@given(steps(max_layers=4), st.booleans())
def test_layers_at_once_equal_each_layer(step, compact):
    topk, req, table, b, ctx = step
    r = topk_to_slots(topk, req, table, b, ctx, compact=compact)
    assert isinstance(r, LayeredTopkSlots)
    assert r.slots.shape == topk.shape and r.valid_counts.shape == topk.shape[:2]
    for i in range(topk.shape[0]):
        one = topk_to_slots(topk[i], req, table, b, ctx, compact=compact)
        got = r.layer(i)
        assert got.slots.tolist() == one.slots.tolist()
        assert got.valid_counts.tolist() == one.valid_counts.tolist()
        assert (got.error_mask, got.error_key) == (one.error_mask, one.error_key)


@given(steps(), st.integers(1, 4), st.integers(1, 5), st.data())
def test_dcp_matches_the_loop(step, cp, inter, data):
    topk, req, table, b, ctx = step
    rank = data.draw(st.integers(0, cp - 1))
    r = topk_to_slots(topk[0], req, table, b, ctx, cp_size=cp, cp_rank=rank, cp_interleave=inter)
    slots, counts, mask, key = loop_slots(topk[0], req, table.tolist(), b, ctx, cp, rank, inter)
    assert r.slots.tolist() == slots
    assert r.valid_counts.tolist() == counts
    assert (r.error_mask, r.error_key) == (mask, key)


@given(st.integers(1, 4), st.integers(1, 5), st.sampled_from([1, 3, 4, 64]), st.integers(0, 2**32 - 1))
def test_dcp_ranks_partition_the_valid_positions(cp, inter, b, seed):
    rng = np.random.default_rng(seed)
    t, k = int(rng.integers(1, 40)), int(rng.integers(1, 32))
    ctx = rng.integers(0, 300, size=t)
    topk = rng.integers(-1, 320, size=(t, k))
    width = 300 // b + 1
    table = np.arange(width)[None, :].repeat(1, axis=0)  # every block allocated, id = block index
    req = np.zeros(t, dtype=np.int64)
    inside = (topk >= 0) & (topk < ctx[:, None])
    owners = np.zeros((t, k), dtype=np.int64)
    for rank in range(cp):
        r = topk_to_slots(topk, req, table, b, ctx, cp_size=cp, cp_rank=rank, cp_interleave=inter)
        owners += r.slots >= 0
        # with the identity table a slot is the local position itself
        p = topk[r.slots >= 0]
        assert (r.slots[r.slots >= 0] == (p // (inter * cp)) * inter + p % inter).all()
        assert r.error_mask in (0, ERR_PAST_CONTEXT)
    assert (owners == inside).all()


@given(
    st.lists(st.integers(-5, 10**6), max_size=50),
    st.integers(1, 100),
    st.integers(1, 256),
    st.integers(1, 16),
)
def test_indexer_cache_offsets_match_the_loop(slots, b, v, s):
    off = indexer_cache_offsets(np.array(slots, dtype=np.int32), b, value_bytes=v, scale_bytes=s)
    value, scale = loop_offsets(slots, b, v, s)
    assert off.value.tolist() == value and off.scale.tolist() == scale
    assert off.value.dtype == np.int64 and off.scale.dtype == np.int64


def test_indexer_cache_offsets_keep_the_shape():
    off = indexer_cache_offsets(np.array([[0, 1], [64, -1]]), 64)
    assert off.value.tolist() == [[0, 128], [64 * 132, -1]]
    assert off.scale.tolist() == [[64 * 128, 64 * 128 + 4], [64 * 132 + 64 * 128, -1]]


@st.composite
def batches(draw):
    nd = draw(st.integers(0, 6))
    n = draw(st.integers(1, 4))
    np_ = draw(st.integers(0, 6))
    seq, q = [], []
    for _ in range(nd):
        seq.append(draw(st.integers(n, 500)))
        q.append(n)
    for _ in range(np_):
        s = draw(st.integers(1, 500))
        seq.append(s)
        q.append(draw(st.integers(1, min(s, 40))))
    return seq, q, nd


@given(batches())
def test_indexer_metadata_matches_the_loop(batch):
    seq, q, nd = batch
    m = indexer_metadata(seq, q, nd)
    req, pos, ks, ke, ctx = [], [], [], [], []
    cu = [0]
    for i in range(nd, len(seq)):
        cu.append(cu[-1] + seq[i])
    n = q[0] if nd else 0
    dctx = [[seq[b] - n + 1 + j for j in range(n)] for b in range(nd)]
    for r in range(len(seq)):
        for j in range(q[r]):
            p = seq[r] - q[r] + j
            req.append(r)
            pos.append(p)
            ctx.append(p + 1)
            if r >= nd:
                ks.append(cu[r - nd])
                ke.append(cu[r - nd] + p + 1)
    assert m.req_id_per_token.tolist() == req
    assert m.positions.tolist() == pos
    assert m.ctx.tolist() == ctx
    assert m.cu_seq_lens.tolist() == cu
    assert m.ks.tolist() == ks and m.ke.tolist() == ke
    assert m.decode_ctx.shape == (nd, n) and m.decode_ctx.tolist() == dctx
    assert m.num_decode_tokens == nd * n
    # decode contexts are the decode tokens' ctx
    assert m.decode_ctx.reshape(-1).tolist() == m.ctx[: m.num_decode_tokens].tolist()


# ----------------------------------------------------------------------------- keys and bad inputs


def test_error_key_round_trip():
    for token, column, bit in ((0, 0, 1), (7, 63, 2), (2**31 - 1, 2**29 - 1, 4)):
        assert decode_topk_error_key(topk_error_key(token, column, bit)) == (token, column, bit)
    assert topk_error_key(1, 2, 4) == (1 << 32) | (2 << 3) | 2
    with pytest.raises(ValueError, match="bit"):
        topk_error_key(0, 0, 8)
    with pytest.raises(ValueError, match="column"):
        topk_error_key(0, 2**29, 1)


def test_width_and_negative_block_bits():
    r = topk_to_slots([[0, 4, 8, -1]], [0], [[-1, 3]], 4, [100])
    assert r.slots.tolist() == [[-1, 12, -1, -1]]
    assert r.error_mask == ERR_NEGATIVE_BLOCK | ERR_BLOCK_INDEX
    assert r.first_bad == (0, 0, ERR_NEGATIVE_BLOCK)
    assert topk_to_slots([[0]], [0], np.zeros((1, 0), np.int32), 4, [5]).first_bad == (0, 0, ERR_BLOCK_INDEX)


def test_empty_step():
    r = topk_to_slots(np.zeros((0, 8), np.int32), np.zeros(0, np.int32), [[1]], 64, np.zeros(0, np.int32))
    assert r.slots.shape == (0, 8) and r.error_mask == 0 and r.error_key == NO_ERROR_KEY
    m = indexer_metadata([], [], 0)
    assert m.cu_seq_lens.tolist() == [0] and m.ctx.size == 0


GOOD = {"topk": [[0, 1]], "req_id": [0], "block_table": [[1]], "block_size": 4, "ctx": [2]}


@pytest.mark.parametrize(
    "change, exc, name",
    [
        ({"topk": [[0.5, 1.0]]}, TypeError, "topk"),
        ({"topk": [0, 1]}, ValueError, "topk"),
        ({"req_id": [0, 0]}, ValueError, "req_id"),
        ({"req_id": [1]}, ValueError, "req_id"),
        ({"req_id": [-1]}, ValueError, "req_id"),
        ({"block_table": [1]}, ValueError, "block_table"),
        ({"block_table": [["a"]]}, TypeError, "block_table"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 4.0}, TypeError, "block_size"),
        ({"block_size": True}, TypeError, "block_size"),
        ({"ctx": [-1]}, ValueError, "ctx"),
        ({"ctx": [1, 2]}, ValueError, "ctx"),
        ({"compact": 1}, TypeError, "compact"),
        ({"cp_size": 0}, ValueError, "cp_size"),
        ({"cp_size": 2, "cp_rank": 2}, ValueError, "cp_rank"),
        ({"cp_interleave": 0}, ValueError, "cp_interleave"),
        ({"block_table": [[2**30]]}, ValueError, "block_table"),
    ],
)
def test_topk_to_slots_bad_inputs(change, exc, name):
    with pytest.raises(exc, match=name):
        topk_to_slots(**{**GOOD, **change})


@pytest.mark.parametrize(
    "args, exc, name",
    [
        (([1], [1, 1], 0), ValueError, "query_lens"),
        (([1], [2], 0), ValueError, "query_lens"),
        (([1], [0], 0), ValueError, "query_lens"),
        (([3, 3], [1, 2], 2), ValueError, "query_lens"),
        (([1], [1], 2), ValueError, "num_decodes"),
        (([1], [1], -1), ValueError, "num_decodes"),
        (([1.0], [1], 0), TypeError, "seq_lens"),
        (([[1]], [[1]], 0), ValueError, "seq_lens"),
        (([2**31], [1], 0), ValueError, "seq_lens"),
    ],
)
def test_indexer_metadata_bad_inputs(args, exc, name):
    with pytest.raises(exc, match=name):
        indexer_metadata(*args)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"value_bytes": 0}, ValueError, "value_bytes"),
        ({"scale_bytes": 1.5}, TypeError, "scale_bytes"),
        ({"slots": [0.5]}, TypeError, "slots"),
    ],
)
def test_indexer_cache_offsets_bad_inputs(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        indexer_cache_offsets(**{"slots": [0], "block_size": 4, **kwargs})
