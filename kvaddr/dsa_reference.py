"""NumPy reference of DeepSeek-V3.2 sparse attention (DSA) addressing: the oracle of its kernels.

The contract (docs/dsa.md has it with a worked example):

**Indexer K cache.** One per layer, paged with the same block table as the MLA cache, block
size ``B`` (64 in DeepSeek-V3.2, any ``B >= 1`` here). A block holds its ``B`` tokens'
indexer keys as ``V`` value bytes each (128 fp8 bytes), then ``B`` scales of ``S`` bytes each
(one fp32): ``[B * V | B * S]`` per block, not interleaved per token. For slot ``s``
(``blk = s // B``, ``off = s % B``) the byte offsets are (int64; -1 for a padding slot < 0)::

    value = blk * B * (V + S) + off * V
    scale = blk * B * (V + S) + B * V + S * off

**Per-step indexer metadata.** Requests in batch order, decodes first, then prefills. A
request with context length ``seq_len`` (after this step) and ``n`` query tokens holds the
positions ``seq_len - n .. seq_len - 1``. Over the prefills,
``cu_seq_lens = [0, cumsum(seq_len)]``; prefill ``i``'s query token ``t`` at position
``pos_t`` has ``ks[t] = cu_seq_lens[i]`` and ``ke[t] = ks[t] + pos_t + 1``. Decode ``b`` with
``n`` query tokens (``n = 1 +`` drafts, the same for every decode) has
``ctx[b, j] = seq_len[b] - n + 1 + j``. ``req_id_per_token[t]`` is token ``t``'s batch row.

**Top-k to slots.** ``topk`` int [T, K] holds request-local positions (-1: unused).
``slots[t, c] = table[req_id[t], topk[t, c] // B] * B + topk[t, c] % B`` and -1 where
``topk < 0``. Checks beyond the engines, each giving -1 and setting an error bit:

* :data:`ERR_PAST_CONTEXT` (4): ``topk[t, c] >= ctx[t]``, the token's context length;
* :data:`ERR_BLOCK_INDEX` (1): the block index is at or past the table's width;
* :data:`ERR_NEGATIVE_BLOCK` (2): the table's block id there is negative.

An entry has at most one bit: the context is checked first, then the width, then the id.
The first bad entry is the one with the smallest key ``token << 32 | column << 3 |
log2(bit)`` (:func:`topk_error_key`); :data:`NO_ERROR_KEY` (all ones) without errors.
``valid_counts[t]`` counts row ``t``'s slots >= 0; with ``compact=True`` each row's valid
slots come first in their order, then -1s (FlashMLA's ``topk_length`` reads the first
``valid_counts[t]`` entries). A [L, T, K] ``topk`` (L layers, the same ``req_id``, table and
``ctx``) gives every layer's result at once, each layer with its own error record.

**Decode context parallelism (DCP).** With ``cp_size`` ranks and interleave ``I``, position
``p`` belongs to rank ``(p // I) % cp_size``; this rank (``cp_rank``) keeps only its own
positions, mapped to the local position ``(p // (I * cp_size)) * I + p % I`` before the
lookup in its (rank-local) block table. Other ranks' positions give -1 without an error. The
context check applies to the global position, on every rank.

Only NumPy: this module belongs to the library core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from kvaddr.validation import check_int

__all__ = [
    "ERR_BLOCK_INDEX",
    "ERR_NEGATIVE_BLOCK",
    "ERR_PAST_CONTEXT",
    "NO_ERROR_KEY",
    "IndexerCacheOffsets",
    "IndexerMetadata",
    "LayeredTopkSlots",
    "TopkSlots",
    "decode_topk_error_key",
    "indexer_cache_offsets",
    "indexer_metadata",
    "topk_error_key",
    "topk_to_slots",
]

#: The block index ``position // B`` is at or past the block table's width.
ERR_BLOCK_INDEX = 1
#: The block table's id for a selected position is negative (unallocated).
ERR_NEGATIVE_BLOCK = 2
#: A selected position is at or past the token's context length.
ERR_PAST_CONTEXT = 4
#: Key of "no error" in the first-bad record (all ones).
NO_ERROR_KEY = (1 << 64) - 1

_INT32_MAX = int(np.iinfo(np.int32).max)
_COLUMN_SHIFT = 3  # log2(bit) in key bits 0..2
_COLUMN_BITS = 32 - _COLUMN_SHIFT  # column in key bits 3..31
_BITS = (ERR_BLOCK_INDEX, ERR_NEGATIVE_BLOCK, ERR_PAST_CONTEXT)


def topk_error_key(token: int, column: int, bit: int) -> int:
    """Key of a bad top-k entry: ``token << 32 | column << 3 | log2(bit)``.

    The smallest key over a layer's bad entries is its first-bad record.

    Parameters
    ----------
    token : int
        The entry's row of ``topk`` (0 <= token < 2**31).
    column : int
        The entry's column of ``topk`` (0 <= column < 2**29).
    bit : int
        One of :data:`ERR_BLOCK_INDEX`, :data:`ERR_NEGATIVE_BLOCK`, :data:`ERR_PAST_CONTEXT`.

    Examples
    --------
    >>> topk_error_key(3, 5, ERR_PAST_CONTEXT)
    12884901930
    >>> decode_topk_error_key(12884901930)
    (3, 5, 4)
    """
    token, column, bit = check_int("token", token, lo=0), check_int("column", column, lo=0), check_int("bit", bit, lo=1)
    if token > _INT32_MAX:
        raise ValueError(f"token must be < 2**31, got {token}")
    if column >= 1 << _COLUMN_BITS:
        raise ValueError(f"column must be < 2**{_COLUMN_BITS}, got {column}")
    if bit not in _BITS:
        raise ValueError(f"bit must be one of {_BITS}, got {bit}")
    return (token << 32) | (column << _COLUMN_SHIFT) | (bit.bit_length() - 1)


def decode_topk_error_key(key: int) -> tuple[int, int, int]:
    """Inverse of :func:`topk_error_key`: ``(token, column, bit)``.

    Examples
    --------
    >>> decode_topk_error_key(topk_error_key(0, 2, ERR_NEGATIVE_BLOCK))
    (0, 2, 2)
    """
    key = int(key)
    return key >> 32, (key >> _COLUMN_SHIFT) & ((1 << _COLUMN_BITS) - 1), 1 << (key & ((1 << _COLUMN_SHIFT) - 1))


# ----------------------------------------------------------------------------- input checks


def _ints(name: str, value: ArrayLike, ndims: tuple[int, ...]) -> np.ndarray:
    """An integer array of one of ``ndims`` dimensions, as int64."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {want} dimensions, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values beyond int64")
    return arr.astype(np.int64)


# ----------------------------------------------------------------------------- indexer K cache


@dataclass
class IndexerCacheOffsets:
    """Byte offsets of slots' indexer keys in a layer's indexer K cache.

    Attributes
    ----------
    value : numpy.ndarray
        int64, the slots' shape: offset of the ``V`` value bytes; -1 for a slot < 0.
    scale : numpy.ndarray
        int64, the slots' shape: offset of the ``S`` scale bytes; -1 for a slot < 0.
    """

    value: np.ndarray
    scale: np.ndarray


def indexer_cache_offsets(
    slots: ArrayLike, block_size: int, *, value_bytes: int = 128, scale_bytes: int = 4
) -> IndexerCacheOffsets:
    """Byte offsets of slots in the indexer K cache (``[B * V | B * S]`` per block).

    Parameters
    ----------
    slots : array_like of int
        Any shape. A slot < 0 is padding.
    block_size : int
        ``B``, tokens per block (>= 1).
    value_bytes : int, optional
        ``V``, bytes of one token's key values (default 128: fp8).
    scale_bytes : int, optional
        ``S``, bytes of one token's scale (default 4: fp32).

    Returns
    -------
    IndexerCacheOffsets
        ``value = blk * B * (V + S) + off * V`` and
        ``scale = blk * B * (V + S) + B * V + S * off`` (``blk = s // B``, ``off = s % B``),
        int64 of the slots' shape, -1 where the slot is negative.

    Examples
    --------
    >>> off = indexer_cache_offsets([38, -1], 4)
    >>> off.value.tolist(), off.scale.tolist()
    ([5008, -1], [5272, -1])
    """
    s = _ints("slots", slots, tuple(range(33)))
    b = check_int("block_size", block_size, lo=1)
    v = check_int("value_bytes", value_bytes, lo=1)
    sc = check_int("scale_bytes", scale_bytes, lo=1)
    pad = s < 0
    blk, off = np.divmod(np.where(pad, 0, s), b)
    base = blk * (b * (v + sc))
    value = np.where(pad, -1, base + off * v)
    scale = np.where(pad, -1, base + b * v + sc * off)
    return IndexerCacheOffsets(value=value.astype(np.int64), scale=scale.astype(np.int64))


# ----------------------------------------------------------------------------- step metadata


@dataclass
class IndexerMetadata:
    """A step's indexer metadata (decodes first, then prefills).

    Attributes
    ----------
    num_decodes : int
        Decode requests (the first rows of the batch).
    num_decode_tokens : int
        Their query tokens (``num_decodes * n``).
    decode_ctx : numpy.ndarray
        int32 [num_decodes, n]: ``seq_len[b] - n + 1 + j``, the context of decode ``b``'s
        token ``j``.
    cu_seq_lens : numpy.ndarray
        int32 [P + 1]: ``[0, cumsum(seq_len)]`` over the P prefills.
    ks : numpy.ndarray
        int32 [prefill tokens]: ``cu_seq_lens[i]`` of the token's prefill ``i``.
    ke : numpy.ndarray
        int32 [prefill tokens]: ``ks + position + 1``.
    req_id_per_token : numpy.ndarray
        int32 [T]: every token's batch row.
    positions : numpy.ndarray
        int32 [T]: every token's position in its request.
    ctx : numpy.ndarray
        int32 [T]: every token's context length, ``position + 1`` (the ``ctx`` of
        :func:`topk_to_slots`).
    """

    num_decodes: int
    num_decode_tokens: int
    decode_ctx: np.ndarray
    cu_seq_lens: np.ndarray
    ks: np.ndarray
    ke: np.ndarray
    req_id_per_token: np.ndarray
    positions: np.ndarray
    ctx: np.ndarray


def indexer_metadata(seq_lens: ArrayLike, query_lens: ArrayLike, num_decodes: int) -> IndexerMetadata:
    """The indexer's per-step metadata.

    Parameters
    ----------
    seq_lens : array_like of int, shape (R,)
        Each request's context length after this step (its query tokens included).
    query_lens : array_like of int, shape (R,)
        Each request's query tokens this step, ``1 <= query_lens <= seq_lens``; the same for
        every decode.
    num_decodes : int
        The first ``num_decodes`` requests are decodes, the rest prefills.

    Returns
    -------
    IndexerMetadata

    Raises
    ------
    TypeError
        An argument is not an int / an integer array.
    ValueError
        Shapes differ, a length is out of range, decodes have different query lengths, or a
        sum passes int32.

    Examples
    --------
    A decode at position 6 and a prefill chunk at positions 2, 3, 4:

    >>> m = indexer_metadata([7, 5], [1, 3], num_decodes=1)
    >>> m.decode_ctx.tolist(), m.cu_seq_lens.tolist(), m.ks.tolist(), m.ke.tolist()
    ([[7]], [0, 5], [0, 0, 0], [3, 4, 5])
    >>> m.req_id_per_token.tolist(), m.ctx.tolist()
    ([0, 1, 1, 1], [7, 3, 4, 5])
    """
    sl = _ints("seq_lens", seq_lens, (1,))
    ql = _ints("query_lens", query_lens, (1,))
    if sl.shape != ql.shape:
        raise ValueError(f"query_lens must have the shape of seq_lens {sl.shape}, got {ql.shape}")
    r = sl.shape[0]
    nd = check_int("num_decodes", num_decodes, lo=0, hi=r)
    if r and (ql.min() < 1 or (ql > sl).any()):
        raise ValueError("query_lens must satisfy 1 <= query_lens <= seq_lens")
    if r and sl.max() > _INT32_MAX:
        raise ValueError("seq_lens must fit in int32")
    if nd and (ql[:nd] != ql[0]).any():
        raise ValueError(f"query_lens of the decodes must be equal, got {ql[:nd].tolist()}")
    n = int(ql[0]) if nd else 0
    total_tokens = int(ql.sum())
    prefill_total = int(sl[nd:].sum())
    if total_tokens > _INT32_MAX or prefill_total > _INT32_MAX:
        raise ValueError("the step's tokens and the prefills' seq_lens must sum within int32")

    req = np.repeat(np.arange(r, dtype=np.int64), ql)
    starts = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int64) if r else np.zeros(0, np.int64)
    within = np.arange(total_tokens, dtype=np.int64) - starts[req]
    positions = sl[req] - ql[req] + within
    decode_ctx = (sl[:nd, None] - n + 1 + np.arange(n, dtype=np.int64)[None, :]).reshape(nd, n)
    cu = np.concatenate([[0], np.cumsum(sl[nd:])]).astype(np.int64)
    nd_tokens = nd * n
    p_req = req[nd_tokens:] - nd
    ks = cu[p_req]
    ke = ks + positions[nd_tokens:] + 1
    i32 = np.int32
    return IndexerMetadata(
        num_decodes=nd,
        num_decode_tokens=nd_tokens,
        decode_ctx=decode_ctx.astype(i32),
        cu_seq_lens=cu.astype(i32),
        ks=ks.astype(i32),
        ke=ke.astype(i32),
        req_id_per_token=req.astype(i32),
        positions=positions.astype(i32),
        ctx=(positions + 1).astype(i32),
    )


# ----------------------------------------------------------------------------- top-k -> slots


@dataclass
class TopkSlots:
    """One layer's top-k slots and its error record.

    Attributes
    ----------
    slots : numpy.ndarray
        int32 [T, K]: cache slots, -1 for unused, bad or (DCP) other ranks' entries.
    valid_counts : numpy.ndarray
        int32 [T]: each row's slots >= 0.
    error_mask : int
        OR of the error bits found (0: none).
    error_key : int
        Smallest :func:`topk_error_key` over the bad entries; :data:`NO_ERROR_KEY` without.
    """

    slots: np.ndarray
    valid_counts: np.ndarray
    error_mask: int
    error_key: int

    @property
    def first_bad(self) -> tuple[int, int, int] | None:
        """The first bad entry ``(token, column, bit)``, None without errors."""
        if not self.error_mask:
            return None
        return decode_topk_error_key(self.error_key)


@dataclass
class LayeredTopkSlots:
    """L layers' top-k slots, each layer with its own error record.

    Attributes
    ----------
    slots : numpy.ndarray
        int32 [L, T, K].
    valid_counts : numpy.ndarray
        int32 [L, T].
    error_mask : numpy.ndarray
        int32 [L]: each layer's error bits.
    error_key : numpy.ndarray
        uint64 [L]: each layer's first-bad key (:data:`NO_ERROR_KEY` without errors).
    """

    slots: np.ndarray
    valid_counts: np.ndarray
    error_mask: np.ndarray
    error_key: np.ndarray

    def layer(self, index: int) -> TopkSlots:
        """Layer ``index``'s result, as :func:`topk_to_slots` gives it for that layer alone."""
        i = check_int("index", index, lo=0, hi=self.slots.shape[0] - 1)
        return TopkSlots(
            slots=self.slots[i],
            valid_counts=self.valid_counts[i],
            error_mask=int(self.error_mask[i]),
            error_key=int(self.error_key[i]),
        )


def topk_to_slots(
    topk: ArrayLike,
    req_id: ArrayLike,
    block_table: ArrayLike,
    block_size: int,
    ctx: ArrayLike,
    *,
    compact: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> TopkSlots | LayeredTopkSlots:
    """Map the indexer's top-k positions to cache slots, with checks.

    Parameters
    ----------
    topk : array_like of int, shape (T, K) or (L, T, K)
        Request-local positions; a negative entry is unused. With three dimensions, L layers'
        top-k at once (the same ``req_id``, table and ``ctx``).
    req_id : array_like of int, shape (T,)
        Each token's row of ``block_table`` (``0 <= req_id < rows``).
    block_table : array_like of int, shape (rows, W)
        Block ids in batch order (rank-local with DCP); a negative id is unallocated.
    block_size : int
        ``B``, tokens per block (>= 1).
    ctx : array_like of int, shape (T,)
        Each token's context length (>= 0): a position at or past it is an error.
    compact : bool, optional
        Move each row's valid slots first, in their order, then -1s.
    cp_size, cp_rank, cp_interleave : int, optional
        Decode context parallelism: keep only positions ``p`` with
        ``(p // cp_interleave) % cp_size == cp_rank``, looked up at the local position
        ``(p // (cp_interleave * cp_size)) * cp_interleave + p % cp_interleave``.

    Returns
    -------
    TopkSlots or LayeredTopkSlots
        :class:`TopkSlots` for a (T, K) ``topk``, :class:`LayeredTopkSlots` for (L, T, K).

    Raises
    ------
    TypeError
        An argument is not an int / an integer array / a bool.
    ValueError
        Shapes disagree, ``req_id`` is outside the table's rows, ``ctx`` is negative, an
        option is out of range, or a slot could pass int32.

    Examples
    --------
    >>> r = topk_to_slots([[6, 1, 3, 5], [4, 0, 2, -1]], [0, 1], [[5, 2], [9, 3]], 4, [7, 5])
    >>> r.slots.tolist(), r.valid_counts.tolist(), r.error_mask
    ([[10, 21, 23, 9], [12, 36, 38, -1]], [4, 3], 0)
    >>> r = topk_to_slots([[-1, 7, 2]], [0], [[5, 2]], 4, [7], compact=True)
    >>> r.slots.tolist(), r.valid_counts.tolist(), r.first_bad
    ([[22, -1, -1]], [1], (0, 1, 4))
    """
    tk = _ints("topk", topk, (2, 3))
    layered = tk.ndim == 3
    t3 = tk if layered else tk[None]
    n_layers, t, k = t3.shape
    rid = _ints("req_id", req_id, (1,))
    table = _ints("block_table", block_table, (2,))
    b = check_int("block_size", block_size, lo=1)
    cx = _ints("ctx", ctx, (1,))
    if not isinstance(compact, (bool, np.bool_)):
        raise TypeError(f"compact must be a bool, got {compact!r}")
    cp = check_int("cp_size", cp_size, lo=1)
    rank = check_int("cp_rank", cp_rank, lo=0, hi=cp - 1)
    inter = check_int("cp_interleave", cp_interleave, lo=1)
    if rid.shape != (t,):
        raise ValueError(f"req_id must have shape ({t},) (topk's tokens), got {rid.shape}")
    if cx.shape != (t,):
        raise ValueError(f"ctx must have shape ({t},) (topk's tokens), got {cx.shape}")
    rows, width = table.shape
    if t and (rid.min() < 0 or rid.max() >= rows):
        raise ValueError(f"req_id must index block_table's {rows} rows, got values in [{rid.min()}, {rid.max()}]")
    if t and cx.min() < 0:
        raise ValueError("ctx must be >= 0")
    if t > _INT32_MAX + 1 or k > 1 << _COLUMN_BITS:
        raise ValueError(f"topk has too many tokens or columns for the error key: shape {tk.shape}")
    if table.size and table.max() > (_INT32_MAX - (b - 1)) // b:
        raise ValueError(f"block_table holds a block id whose slots pass int32 with block_size {b}")

    used = t3 >= 0
    past = used & (t3 >= cx[None, :, None])
    look = used & ~past
    if cp > 1:
        owned = (t3 // inter) % cp == rank
        local = (t3 // (inter * cp)) * inter + t3 % inter
        look &= owned
    else:
        local = t3
    blk, off = np.divmod(np.where(look, local, 0), b)
    wide = look & (blk >= width)
    fetch = look & ~wide
    if width:
        rows3 = np.broadcast_to(table[rid][None], (n_layers, t, width))
        ids = np.take_along_axis(rows3, np.where(fetch, blk, 0), axis=2)
    else:
        ids = np.zeros_like(blk)
    neg = fetch & (ids < 0)
    good = fetch & ~neg
    slots = np.where(good, ids * b + off, -1).astype(np.int32)

    bits = (
        np.where(past, ERR_PAST_CONTEXT, 0) | np.where(wide, ERR_BLOCK_INDEX, 0) | np.where(neg, ERR_NEGATIVE_BLOCK, 0)
    )
    log2 = np.where(past, 2, 0) | np.where(neg, 1, 0)
    tok = np.arange(t, dtype=np.uint64)[None, :, None]
    col = np.arange(k, dtype=np.uint64)[None, None, :]
    keys = (tok << np.uint64(32)) | (col << np.uint64(_COLUMN_SHIFT)) | log2.astype(np.uint64)
    keys = np.where(bits != 0, keys, np.uint64(NO_ERROR_KEY))
    mask = np.bitwise_or.reduce(bits.reshape(n_layers, -1), axis=1).astype(np.int32)
    key = keys.reshape(n_layers, -1).min(axis=1) if t * k else np.full(n_layers, NO_ERROR_KEY, np.uint64)

    if compact:
        order = np.argsort(~good, axis=2, kind="stable")
        slots = np.take_along_axis(slots, order, axis=2)
    counts = good.sum(axis=2).astype(np.int32)
    if layered:
        return LayeredTopkSlots(slots=slots, valid_counts=counts, error_mask=mask, error_key=key.astype(np.uint64))
    return TopkSlots(slots=slots[0], valid_counts=counts[0], error_mask=int(mask[0]), error_key=int(key[0]))
