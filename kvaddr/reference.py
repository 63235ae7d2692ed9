"""NumPy reference of step addressing: the oracle for every kernel and the CPU path.

Semantics are those of ``docs/spec.md``, with these choices where the spec is
silent (the kernels make the same ones):

* A request with a negative ``seq_lens_decoder`` or ``seq_lens_this_time`` sets
  error bit 8 and runs no tokens: it adds 0 to ``cu_seqlens_q`` and its
  ``seq_lens_kv`` is 0.
* ``cu_seqlens_q`` and ``seq_lens_kv`` saturate at 2**31 - 1 instead of wrapping.
* Tokens past the capacity C are dropped (error bit 4); ``cu_seqlens_q`` still
  holds the true prefix sums.
* Error bits 1 and 2 concern one cache; a token's slot in that cache is -1.
* The "first bad token" is the error with the smallest
  ``(token, request, cache, bit)``: for bit 8 the token is the request's
  ``cu_seqlens_q`` entry, for bit 4 it is token C (the first one dropped).
* With ``attention=...`` the step also returns the attention-backend metadata
  (:mod:`kvaddr.attention_reference`, docs/attention.md); its errors (bits 1 and
  2 of a request's pages, bit 16) are keyed at the request's ``cu_seqlens_q``
  entry (the key of :func:`kvaddr.errors.error_key` holds bit 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from kvaddr import attention_reference
from kvaddr.constants import INT32_MAX
from kvaddr.errors import (
    ERR_BLOCK_INDEX,
    ERR_CAPACITY,
    ERR_NEGATIVE_BLOCK,
    ERR_NEGATIVE_LENGTH,
    NO_ERROR_KEY,
    AddressingError,
    decode_error_key,
    error_key,
)
from kvaddr.outputs import PAD_SLOT_ID, DsaOutputs, StepOutputs
from kvaddr.validation import check_host_array, check_int, check_lengths, normalize_caches


@dataclass
class ReferenceResult:
    """The reference's outputs plus the step's error record."""

    outputs: StepOutputs
    error_mask: int
    error_key: int

    @property
    def first_bad(self) -> tuple[int, int, int, int] | None:
        """The first bad record ``(token, request, cache, bit)``, None without errors."""
        if not self.error_mask:
            return None
        return decode_error_key(self.error_key)

    def check(self) -> None:
        """Raise :class:`~kvaddr.errors.AddressingError` if the step had bad values."""
        if self.error_mask:
            raise AddressingError(self.error_mask, self.error_key)


def _as_int32(name, value):
    if isinstance(value, np.ndarray):
        return check_host_array(name, value, ndim=1)
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" and arr.size:
        raise TypeError(f"{name} must be int32 with shape (bsz,), got dtype {arr.dtype}")
    arr = np.asarray(arr, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be int32 with shape (bsz,), got shape {arr.shape}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > INT32_MAX):
        raise ValueError(f"{name} must be int32 with shape (bsz,): values out of int32 range")
    return arr.astype(np.int32)


#: The lengths' check and conversion of :func:`step_addressing` (lists or int32 arrays of shape (bsz,)).
as_int32 = _as_int32


def step_addressing(
    seq_lens_decoder: ArrayLike,
    seq_lens_this_time: ArrayLike,
    block_tables: ArrayLike | Sequence[ArrayLike],
    block_sizes: int | Sequence[int],
    capacity: int,
    *,
    seq_lens_encoder: ArrayLike | None = None,
    position_dtype: DTypeLike = np.int64,
    attention: str | Sequence[str] | None = None,
    kv_indices_capacity: int | None = None,
    dsa: bool = False,
    dsa_cache: int | None = None,
    dsa_decode_len: int = 1,
    dsa_value_bytes: int = 128,
    dsa_scale_bytes: int = 4,
    max_requests: int | None = None,
) -> ReferenceResult:
    """Compute one step's addressing on the host.

    Parameters
    ----------
    seq_lens_decoder : int32 [bsz]
        Tokens already in the KV cache per request.
    seq_lens_this_time : int32 [bsz]
        Tokens each request runs this step (0 for an idle slot).
    block_tables : int32 [rows >= bsz, max_blocks], or a sequence of them
        One table shared by every cache, or one per cache.
    block_sizes : int or sequence of int
        Tokens per block, one per cache (each >= 1); an empty sequence computes
        positions only (``slot_mapping`` has shape ``(0, C)``).
    capacity : int
        C, the most tokens the step may carry (>= 1).
    seq_lens_encoder : int32 [bsz], optional
        Checked for shape and dtype only; not needed for addressing.
    position_dtype : numpy dtype
        ``np.int64`` (default) or ``np.int32``.
    attention : str or sequence of str, optional
        Attention-metadata groups among ``("flashinfer", "varlen", "page_table")``
        (docs/attention.md); None (default) asks for none and changes nothing.
    kv_indices_capacity : int, optional
        N, the entries of each cache's ``kv_indices``; required with "flashinfer".
    dsa, dsa_cache, dsa_decode_len, dsa_value_bytes, dsa_scale_bytes : optional
        DSA outputs (``outputs.dsa``, :func:`dsa_step_outputs`), as
        :class:`~kvaddr.planner.StepPlanner` takes them.
    max_requests : int, optional
        Rows of ``outputs.dsa.cu_seq_lens`` minus one (the planner's ``max_requests``); bsz
        by default.

    Returns
    -------
    ReferenceResult
        ``outputs`` (a :class:`StepOutputs` of NumPy arrays; ``outputs.attention``
        the :class:`~kvaddr.outputs.AttentionOutputs` when asked for), ``error_mask``
        and ``error_key``; ``check()`` raises on errors.
    """
    dec = _as_int32("seq_lens_decoder", seq_lens_decoder)
    q = _as_int32("seq_lens_this_time", seq_lens_this_time)
    bsz = dec.shape[0]
    check_lengths(
        bsz,
        q=q.shape[0],
        enc=None if seq_lens_encoder is None else _as_int32("seq_lens_encoder", seq_lens_encoder).shape[0],
    )
    if isinstance(block_sizes, (list, tuple)) and len(block_sizes) == 0:
        tables, sizes = [], []  # positions only
    else:
        tables, sizes = normalize_caches(block_tables, block_sizes)
    tables = [
        check_host_array(f"block_tables[{g}]" if len(tables) > 1 else "block_tables", t, ndim=2, min_rows=bsz)
        for g, t in enumerate(tables)
    ]
    capacity = check_int("capacity", capacity, lo=1, hi=INT32_MAX - 1)
    position_dtype = np.dtype(position_dtype)
    if position_dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise TypeError(f"position_dtype must be int64 or int32, got {position_dtype}")
    groups = attention_reference.normalize_attention(attention)
    kv_indices_capacity = attention_reference.check_kv_indices_capacity(groups, kv_indices_capacity)
    if ("flashinfer" in groups or "page_table" in groups) and not sizes:
        raise ValueError("attention 'flashinfer' and 'page_table' need at least one cache (block_sizes is empty)")

    d64 = dec.astype(np.int64)
    q64 = q.astype(np.int64)
    bad = (d64 < 0) | (q64 < 0)
    n = np.where(bad, 0, q64)
    cu = np.zeros(bsz + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    cu_sat = np.minimum(cu, INT32_MAX)
    total = int(cu[-1])
    num_tokens = min(total, capacity)
    kv = np.where(bad, 0, np.minimum(d64 + q64, INT32_MAX)).astype(np.int32)

    t = np.arange(num_tokens, dtype=np.int64)
    b = np.searchsorted(cu[1:], t, side="right")
    pos = d64[b] + (t - cu[b])

    batch = np.full(capacity, -1, dtype=np.int32)
    batch[:num_tokens] = b
    positions = np.zeros(capacity, dtype=position_dtype)
    positions[:num_tokens] = pos.astype(position_dtype)
    slots = np.full((len(tables), capacity), PAD_SLOT_ID, dtype=np.int64)

    keys = []
    mask = 0
    bad_req = np.flatnonzero(bad)
    if bad_req.size:
        mask |= ERR_NEGATIVE_LENGTH
        keys.append(error_key(cu_sat[bad_req[0]], bad_req[0], 0, ERR_NEGATIVE_LENGTH))
    if total > capacity:
        mask |= ERR_CAPACITY
        owner = int(np.searchsorted(cu[1:], capacity, side="right"))
        keys.append(error_key(capacity, owner, 0, ERR_CAPACITY))
    for g, (table, bs) in enumerate(zip(tables, sizes)):
        idx = pos // bs
        in_row = idx < table.shape[1]
        blk = np.full(num_tokens, -1, dtype=np.int64)
        blk[in_row] = table[b[in_row], idx[in_row]]
        good = in_row & (blk >= 0)
        slots[g, :num_tokens] = np.where(good, blk * bs + pos % bs, PAD_SLOT_ID)
        for bit, where in ((ERR_BLOCK_INDEX, ~in_row), (ERR_NEGATIVE_BLOCK, in_row & (blk < 0))):
            hit = np.flatnonzero(where)
            if hit.size:
                mask |= bit
                keys.append(error_key(hit[0], b[hit[0]], g, bit))

    outputs = StepOutputs(
        cu_seqlens_q=cu_sat.astype(np.int32),
        num_tokens=np.array(num_tokens, dtype=np.int32),
        batch_id_per_token=batch,
        position_ids=positions,
        seq_lens_kv=kv,
        slot_mapping=slots,
    )
    if dsa:
        if not sizes:
            raise ValueError("dsa needs at least one cache (block_sizes is empty): the indexer cache's")
        last = len(sizes) - 1
        g = last if dsa_cache is None else check_int("dsa_cache", dsa_cache, lo=0, hi=last)
        outputs.dsa = dsa_step_outputs(
            dec,
            q,
            batch,
            positions,
            slots[g],
            sizes[g],
            bsz if max_requests is None else check_int("max_requests", max_requests, lo=max(bsz, 1)),
            decode_len=dsa_decode_len,
            value_bytes=dsa_value_bytes,
            scale_bytes=dsa_scale_bytes,
        )
    if not groups:
        return ReferenceResult(outputs, mask, min(keys) if keys else NO_ERROR_KEY)
    att = attention_reference.attention_metadata(outputs.cu_seqlens_q, kv, tables, sizes, groups, kv_indices_capacity)
    outputs.attention = att.outputs
    keys += [error_key(*r) for r in att.records]
    return ReferenceResult(outputs, mask | att.error_mask, min(keys) if keys else NO_ERROR_KEY)


def dsa_step_outputs(
    seq_lens_decoder: ArrayLike,
    seq_lens_this_time: ArrayLike,
    batch_id_per_token: ArrayLike,
    position_ids: ArrayLike,
    slots: ArrayLike,
    block_size: int,
    max_requests: int,
    *,
    decode_len: int = 1,
    value_bytes: int = 128,
    scale_bytes: int = 4,
) -> DsaOutputs:
    """DeepSeek-V3.2 sparse attention's per-step addressing from a step's outputs (docs/dsa.md).

    Parameters
    ----------
    seq_lens_decoder, seq_lens_this_time : int [bsz]
        The step's inputs; a request with a negative one runs no tokens.
    batch_id_per_token, position_ids : int [C]
        The step's outputs (-1 / 0 for padding).
    slots : int [C]
        The step's slot mapping of the indexer cache (-1 for padding and bad tokens).
    block_size : int
        B of the indexer cache.
    max_requests : int
        ``cu_seq_lens`` has ``max_requests + 1`` entries (>= bsz).
    decode_len : int, default 1
        n: a request running ``1 <= q <= n`` tokens is a decode, one running more a prefill.
    value_bytes, scale_bytes : int, default 128 and 4
        V and S of the indexer cache's ``[B * V | B * S]`` blocks.

    Returns
    -------
    DsaOutputs
        NumPy arrays (:class:`~kvaddr.outputs.DsaOutputs`).

    Examples
    --------
    A decode at position 6 and a prefill chunk at positions 2, 3, 4 (B = 4, slots from the
    table rows ``[5, 2]`` and ``[9, 3]``):

    >>> d = dsa_step_outputs([6, 2], [1, 3], [0, 1, 1, 1, -1], [6, 2, 3, 4, 0], [10, 38, 39, 12, -1], 4, 2)
    >>> d.ctx.tolist(), d.ks.tolist(), d.ke.tolist(), d.cu_seq_lens.tolist()
    ([7, 3, 4, 5, 0], [0, 0, 0, 0, 0], [0, 3, 4, 5, 0], [0, 5, 5])
    >>> d.value_offsets[:2].tolist(), d.scale_offsets[:2].tolist()
    ([1312, 5008], [1576, 5272])
    """
    from kvaddr.dsa_reference import indexer_cache_offsets

    dec = np.asarray(seq_lens_decoder, dtype=np.int64)
    q = np.asarray(seq_lens_this_time, dtype=np.int64)
    batch = np.asarray(batch_id_per_token, dtype=np.int64)
    pos = np.asarray(position_ids, dtype=np.int64)
    n = check_int("decode_len", decode_len, lo=1)
    M = check_int("max_requests", max_requests, lo=dec.shape[0])
    real = batch >= 0
    off = indexer_cache_offsets(slots, block_size, value_bytes=value_bytes, scale_bytes=scale_bytes)
    bad = (dec < 0) | (q < 0)
    prefill = ~bad & (q > n)
    lens = np.where(prefill, np.minimum(dec + q, INT32_MAX), 0)
    before = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # prefix over requests
    P = int(prefill.sum())
    cu = np.full(M + 1, min(int(before[-1]), INT32_MAX), dtype=np.int64)
    cu[:P] = before[:-1][prefill]
    ctx = np.where(real, np.minimum(pos + 1, INT32_MAX), 0)
    b = np.where(real, batch, 0)
    is_pre = real & prefill[b] if dec.size else np.zeros_like(real)
    ks = np.where(is_pre, np.minimum(before[b], INT32_MAX), 0)
    ke = np.where(is_pre, np.minimum(ks + ctx, INT32_MAX), 0)
    i32 = np.int32
    return DsaOutputs(
        value_offsets=off.value,
        scale_offsets=off.scale,
        ks=ks.astype(i32),
        ke=ke.astype(i32),
        ctx=ctx.astype(i32),
        cu_seq_lens=np.minimum(cu, INT32_MAX).astype(i32),
        req_id_per_token=batch.astype(i32),
    )
