"""NumPy reference of the attention-backend metadata (docs/attention.md): the oracle.

:func:`attention_metadata` computes, from a step's ``cu_seqlens_q`` and
``seq_lens_kv`` and the caches' block tables, what FlashInfer's paged-KV
``plan()`` (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``),
FlashAttention's varlen API with a paged KV cache (``cu_seqlens_k``,
``seqused_k``, ``max_seqlen_q``, ``max_seqlen_k``, the page table) and FlashMLA
(``cache_seqlens`` = ``seqused_k``) take. :func:`kvaddr.reference.step_addressing`
calls it when asked (``attention=...``).

Error records are ``(token, request, cache, bit)`` tuples, ordered as tuples (the
order of :func:`kvaddr.errors.error_key`, whose 3-bit bit field holds bit 16,
``kvaddr.errors.ERR_KV_INDICES_CAPACITY``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvaddr.errors import ERR_BLOCK_INDEX, ERR_KV_INDICES_CAPACITY, ERR_NEGATIVE_BLOCK
from kvaddr.outputs import ATTENTION_GROUPS, PAD_PAGE_ID, AttentionOutputs
from kvaddr.validation import INT32_MAX, check_int

__all__ = [
    "ERR_KV_INDICES_CAPACITY",
    "AttentionResult",
    "attention_metadata",
    "check_kv_indices_capacity",
    "naive_attention_metadata",
    "normalize_attention",
]


def normalize_attention(attention) -> tuple:
    """The attention groups asked for, in :data:`ATTENTION_GROUPS` order.

    ``None``, ``""`` or ``()`` ask for none; otherwise a comma-separated string
    (``"flashinfer,varlen"``) or a sequence of names from :data:`ATTENTION_GROUPS`.
    """
    if attention is None:
        return ()
    if isinstance(attention, str):
        names = [a.strip() for a in attention.split(",") if a.strip()]
    else:
        try:
            names = list(attention)
        except TypeError:
            raise TypeError(
                f"attention must be None, a comma-separated str or a sequence of {ATTENTION_GROUPS}, got {attention!r}"
            ) from None
    for a in names:
        if a not in ATTENTION_GROUPS:
            raise ValueError(f"attention must name groups among {ATTENTION_GROUPS}, got {a!r}")
    return tuple(g for g in ATTENTION_GROUPS if g in names)


def check_kv_indices_capacity(groups: tuple, kv_indices_capacity) -> int | None:
    """``kv_indices_capacity`` as an int (required with "flashinfer"; ignored without)."""
    if "flashinfer" not in groups:
        return None
    if kv_indices_capacity is None:
        raise ValueError(
            "kv_indices_capacity must be an int in [1, 2147483647] when attention includes 'flashinfer', got None"
        )
    return check_int("kv_indices_capacity", kv_indices_capacity, lo=1, hi=INT32_MAX)


@dataclass
class AttentionResult:
    """:func:`attention_metadata`'s outputs, error bits and error records."""

    outputs: AttentionOutputs
    error_mask: int = 0
    records: list = field(default_factory=list)  # (token, request, cache, bit), the first of each kind


def _prefix_sum(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 true sums, int32 sums saturating at 2**31 - 1), both [len(x) + 1] from 0."""
    s = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=s[1:])
    return s, np.minimum(s, INT32_MAX).astype(np.int32)


def attention_metadata(
    cu_seqlens_q,
    seq_lens_kv,
    block_tables,
    block_sizes,
    attention,
    kv_indices_capacity=None,
) -> AttentionResult:
    """The attention metadata of a step whose addressing is known.

    Parameters
    ----------
    cu_seqlens_q : int32 [bsz + 1]
        The step's ``cu_seqlens_q`` (true prefix sums, saturating).
    seq_lens_kv : int32 [bsz]
        ``L_b``, the requests' KV lengths after the step (0 for a bad request).
    block_tables : sequence of int32 [rows >= bsz, max_blocks_g]
        One table per cache (the same object may repeat).
    block_sizes : sequence of int
        ``B_g`` of each cache.
    attention : str or sequence of str
        Groups among ``("flashinfer", "varlen", "page_table")``.
    kv_indices_capacity : int, optional
        N, the entries of each cache's ``kv_indices``; required with "flashinfer".

    Returns
    -------
    AttentionResult
        The :class:`~kvaddr.outputs.AttentionOutputs` (fields of groups not asked
        for are None), the error bits (1, 2, 16) and the first record of each
        kind of error as ``(token, request, cache, bit)``.
    """
    groups = normalize_attention(attention)
    N = check_kv_indices_capacity(groups, kv_indices_capacity)
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    L = np.asarray(seq_lens_kv, dtype=np.int64)
    bsz = L.shape[0]
    tables, sizes = list(block_tables), [int(b) for b in block_sizes]
    if ("flashinfer" in groups or "page_table" in groups) and not sizes:
        raise ValueError("attention 'flashinfer' and 'page_table' need at least one cache (block_sizes is empty)")
    out = AttentionOutputs()
    res = AttentionResult(out)

    def record(token, request, cache, bit):
        res.error_mask |= bit
        res.records.append((int(token), int(request), int(cache), bit))

    if "varlen" in groups:
        _, out.cu_seqlens_k = _prefix_sum(L)
        out.seqused_k = L.astype(np.int32)
        q = np.diff(cu) if bsz else np.zeros(0, np.int64)
        out.max_seqlen_q = np.array(q.max() if bsz else 0, dtype=np.int32)
        out.max_seqlen_k = np.array(L.max() if bsz else 0, dtype=np.int32)
    if "page_table" in groups:
        out.page_table = tuple(t[:bsz] for t in tables)
    if "flashinfer" not in groups and "page_table" not in groups:
        return res

    G = len(sizes)
    if "flashinfer" in groups:
        out.qo_indptr = np.minimum(cu, INT32_MAX).astype(np.int32)
        out.kv_indptr = np.zeros((G, bsz + 1), dtype=np.int32)
        out.kv_indices = np.full((G, N), PAD_PAGE_ID, dtype=np.int32)
        out.kv_last_page_len = np.zeros((G, bsz), dtype=np.int32)
    first_token = np.minimum(cu[:bsz], INT32_MAX)  # a request's errors are keyed at its first token
    for g, (table, B) in enumerate(zip(tables, sizes)):
        W = table.shape[1]
        pages = -(-L // B)  # ceil(L_b / B_g), 0 for L_b = 0
        over = np.flatnonzero(pages > W)
        if over.size:  # the row cannot hold the request's blocks
            record(first_token[over[0]], over[0], g, ERR_BLOCK_INDEX)
        if "flashinfer" not in groups:
            continue
        indptr, out.kv_indptr[g] = _prefix_sum(pages)
        out.kv_last_page_len[g] = np.where(L > 0, (L - 1) % B + 1, 0)
        n = int(min(indptr[-1], N))
        p = np.arange(n, dtype=np.int64)
        b = np.searchsorted(indptr[1:], p, side="right")
        j = p - indptr[b]
        in_row = j < W
        blk = np.full(n, PAD_PAGE_ID, dtype=np.int64)
        blk[in_row] = table[b[in_row], j[in_row]]
        neg = np.flatnonzero(in_row & (blk < 0))
        if neg.size:
            record(first_token[b[neg[0]]], b[neg[0]], g, ERR_NEGATIVE_BLOCK)
        out.kv_indices[g, :n] = np.where(blk >= 0, blk, PAD_PAGE_ID)
        if indptr[-1] > N:
            first = int(np.searchsorted(indptr[1:], N, side="right"))  # first request with kv_indptr[b + 1] > N
            record(first_token[first], first, g, ERR_KV_INDICES_CAPACITY)
    return res


def naive_attention_metadata(cu_seqlens_q, seq_lens_kv, block_tables, block_sizes, kv_indices_capacity):
    """A per-request Python loop over every group: an independent oracle for :func:`attention_metadata`.

    Returns a dict of plain lists (all groups) plus ``error_mask`` and ``records``
    (the smallest record of each bit, as tuples)."""
    cu = [int(x) for x in cu_seqlens_q]
    L = [int(x) for x in seq_lens_kv]
    bsz, N = len(L), kv_indices_capacity
    want: dict = {"qo_indptr": [min(c, INT32_MAX) for c in cu], "seqused_k": L}
    acc, cuk = 0, [0]
    for x in L:
        acc += x
        cuk.append(min(acc, INT32_MAX))
    want["cu_seqlens_k"] = cuk
    want["max_seqlen_q"] = max([cu[b + 1] - cu[b] for b in range(bsz)], default=0)
    want["max_seqlen_k"] = max(L, default=0)
    want["kv_indptr"], want["kv_indices"], want["kv_last_page_len"] = [], [], []
    records: dict = {}

    def rec(key):
        bit = key[3]
        records[bit] = min(records.get(bit, key), key)

    for g, (table, B) in enumerate(zip(block_tables, block_sizes)):
        W = len(table[0]) if len(table) else np.shape(table)[1]
        indptr, indices, last = [0], [], []
        for b in range(bsz):
            pages = (L[b] + B - 1) // B
            if pages > W:
                rec((min(cu[b], INT32_MAX), b, g, ERR_BLOCK_INDEX))
            for j in range(pages):
                if len(indices) >= N:
                    rec((min(cu[b], INT32_MAX), b, g, ERR_KV_INDICES_CAPACITY))
                    break
                v = int(table[b][j]) if j < W else PAD_PAGE_ID
                if j < W and v < 0:
                    rec((min(cu[b], INT32_MAX), b, g, ERR_NEGATIVE_BLOCK))
                indices.append(v if v >= 0 else PAD_PAGE_ID)
            indptr.append(min(indptr[-1] + pages, INT32_MAX))
            last.append((L[b] - 1) % B + 1 if L[b] > 0 else 0)
        want["kv_indptr"].append(indptr)
        want["kv_indices"].append(indices + [PAD_PAGE_ID] * (N - len(indices)))
        want["kv_last_page_len"].append(last)
    mask = 0
    for bit in records:
        mask |= bit
    want["error_mask"] = mask
    want["records"] = sorted(records.values())
    return want
