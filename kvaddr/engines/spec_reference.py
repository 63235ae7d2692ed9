"""NumPy reference of speculative decoding's draft addressing in vLLM Model Runner V2.

The oracle of the draft-addressing kernel (``docs/spec-decode.md``). After the
verify step, for batch index b < num_reqs with row ``r = idx_mapping[b]``, the
verify step's tokens ``[qs, qe) = [qsl[b], qsl[b+1])``, its ``seq_lens_t[b]``
(tokens before the step + ``qe - qs``), ``num_rejected[b]`` (drafts scheduled
minus accepted; 0 for a request in chunked prefill) and ``num_sampled[b]``
(accepted + 1; 0 in chunked prefill):

* First draft forward: ``L_b = (qe - qs) - num_rejected[b]``,
  ``last_token_indices[b] = qs + L_b - 1`` (int64; 0 for every b >= num_reqs) and
  ``P_b = seq_lens_t[b] - num_rejected[b] - 1``, the position of the last
  accepted token. Its slot mappings are the verify step's; with
  ``mask_rejected=True`` the rejected rows ``[qs + L_b, qe)`` get -1 (a valid
  row never changes).
* Draft step j = 1 .. k-1 (one query token per request):
  ``query_start_loc_j[i] = min(i, num_reqs)`` for i in ``[0, max_num_reqs]``,
  ``pos_j[b] = min(P_b + j, M - 1)``,
  ``seq_lens_j[b] = min(seq_lens_t[b] - num_rejected[b] + j, M)`` (0 for
  b >= num_reqs) and, per KV-cache group g with block size ``B_g``,
  ``slot_j[g, b] = table_g[r, pos // B_g] * B_g + pos % B_g`` (-1 for b >= num_reqs).

Bad values set error bits (those of :mod:`kvaddr.engines.vllm_errors` where they
fit, plus :data:`VERR_NUM_REJECTED`) and a first-bad record. A *skipped* request
(bad row index, bad ``query_start_loc``, ``seq_lens_t[b] < qe - qs``, or bad
``num_rejected`` / ``num_sampled``) gets ``last_token_indices`` 0, positions 0,
seq_lens 0 and slots -1, and its first-forward rows are left as they are. A dummy
request (``r = -1``) owns its tokens (``last_token_indices`` as above) but no
row: positions 0, seq_lens 0, slots -1, no error.

The record key orders errors by draft step, then request, group and bit, in the
layout of :func:`~kvaddr.engines.vllm_errors.vllm_error_key`::

    key = step << 32 | request << 8 | group << 5 | log2(bit)

Per-request errors are keyed at step 0; a slot error of draft step j at step j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.engines.vllm_errors import (
    VERR_BLOCK_INDEX,
    VERR_CAPACITY,
    VERR_KV_INDICES_CAPACITY,
    VERR_NEGATIVE_BLOCK,
    VERR_NEGATIVE_COMPUTED,
    VERR_PAST_NUM_BLOCKS,
    VERR_QUERY_START_LOC,
    VERR_ROW_INDEX,
    VLLM_ERROR_REASONS,
    VLLM_NO_ERROR_KEY,
    decode_vllm_error_key,
    vllm_error_key,
)
from kvaddr.engines.vllm_reference import dcp_local_lengths, owner_search
from kvaddr.errors import KvaddrError
from kvaddr.validation import INT32_MAX, check_int

#: ``num_rejected[b]`` outside ``[0, qe - qs - 1]`` (more rejected than drafted), or
#: ``num_sampled[b]`` inconsistent with it (negative; > 0 with
#: ``num_sampled + num_rejected != qe - qs``, except 1 with ``num_rejected`` 0: a prefill's last
#: chunk, which samples one token and drafted none; 0 with ``num_rejected != 0``): request b is skipped.
VERR_NUM_REJECTED = 1024

#: The reasons of every bit the draft reference sets.
DRAFT_ERROR_REASONS = {
    VERR_BLOCK_INDEX: VLLM_ERROR_REASONS[VERR_BLOCK_INDEX],
    VERR_NEGATIVE_BLOCK: VLLM_ERROR_REASONS[VERR_NEGATIVE_BLOCK],
    VERR_CAPACITY: "query_start_loc past the verify step's slot mappings",
    VERR_QUERY_START_LOC: VLLM_ERROR_REASONS[VERR_QUERY_START_LOC],
    VERR_PAST_NUM_BLOCKS: VLLM_ERROR_REASONS[VERR_PAST_NUM_BLOCKS],
    VERR_ROW_INDEX: "idx_mapping entry outside [-1, rows of the block tables)",
    VERR_NEGATIVE_COMPUTED: "seq_lens smaller than the request's verify tokens (qe - qs)",
    VERR_NUM_REJECTED: "num_rejected larger than the request's drafts, negative, or inconsistent with num_sampled",
    VERR_KV_INDICES_CAPACITY: VLLM_ERROR_REASONS[VERR_KV_INDICES_CAPACITY],
}

#: Bits whose key names a KV-cache group.
DRAFT_GROUP_BITS = VERR_BLOCK_INDEX | VERR_NEGATIVE_BLOCK | VERR_PAST_NUM_BLOCKS | VERR_KV_INDICES_CAPACITY

#: Slot of a padding row or an unaddressable token.
PAD_SLOT_ID = -1


class DraftAddressingError(KvaddrError):
    """The draft addressing's inputs held bad values (raised by ``check()``).

    Attributes
    ----------
    mask : int
        OR of every error bit set (:data:`DRAFT_ERROR_REASONS`).
    step, request, group, bit : int
        The first bad value's draft step (0 for a per-request error), batch index,
        KV-cache group and bit.
    """

    def __init__(self, mask: int, key: int):
        self.mask = int(mask)
        self.key = int(key)
        self.step, self.request, self.group, self.bit = decode_vllm_error_key(key)
        reasons = ", ".join(f"{b} ({DRAFT_ERROR_REASONS[b]})" for b in sorted(DRAFT_ERROR_REASONS) if self.mask & b)
        where = f"draft step {self.step}, request {self.request}"
        if self.bit & DRAFT_GROUP_BITS:
            where += f", group {self.group}"
        reason = DRAFT_ERROR_REASONS.get(self.bit, f"bit {self.bit}")
        super().__init__(f"bad draft input: first bad value at {where}: {reason}; error bits {self.mask}: {reasons}")


@dataclass
class VllmDraftAddressing:
    """The draft forwards' addressing (:func:`vllm_draft_reference`).

    Attributes
    ----------
    last_token_indices : int64 [max_num_reqs]
        The first draft forward's sampled row per request; 0 past num_reqs.
    first_slot_mappings : int64 [G, T]
        The first draft forward's slot mappings (the verify step's, rejected rows -1
        with ``mask_rejected``).
    positions : int64 [k - 1, max_num_reqs]
        Draft step j's query position in row ``j - 1``; 0 past num_reqs.
    seq_lens : int32 [k - 1, max_num_reqs]
    query_start_loc : int32 [k - 1, max_num_reqs + 1]
    slot_mappings : int64 [k - 1, G, max_num_reqs]
        -1 past num_reqs, for a disabled group, another DCP rank's token and an
        unaddressable token.
    dcp_local_seq_lens : int32 [k - 1, max_num_reqs]
        This DCP rank's share of ``seq_lens`` (equal to it without DCP).
    kv_indptr, kv_indices, kv_last_page_len : int32 [k - 1, G, ...] or None
        FlashInfer's metadata of each draft step (``attention`` with "flashinfer"):
        ``[k-1, G, max_num_reqs + 1]``, ``[k-1, G, N]``, ``[k-1, G, max_num_reqs]``.
    cu_seqlens_k : int32 [k - 1, G, max_num_reqs + 1] or None
    max_seqlen_k : int32 [k - 1, G] or None
        FlashAttention varlen's (``attention`` with "varlen"; ``seqused_k`` is
        ``seq_lens``, or ``dcp_local_seq_lens`` for a sharded group).
    error_mask : int
    error_key : int
        See the module docstring; :data:`~kvaddr.engines.vllm_errors.VLLM_NO_ERROR_KEY` without errors.
    """

    last_token_indices: np.ndarray
    first_slot_mappings: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    slot_mappings: np.ndarray
    error_mask: int
    error_key: int
    dcp_local_seq_lens: np.ndarray | None = None
    kv_indptr: np.ndarray | None = None
    kv_indices: np.ndarray | None = None
    kv_last_page_len: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    max_seqlen_k: np.ndarray | None = None

    @property
    def first_bad(self) -> tuple[int, int, int, int] | None:
        """``(step, request, group, bit)`` of the first bad value, None without errors."""
        return decode_vllm_error_key(self.error_key) if self.error_mask else None

    def check(self) -> None:
        """Raise :class:`DraftAddressingError` if the inputs held bad values."""
        if self.error_mask:
            raise DraftAddressingError(self.error_mask, self.error_key)


def _int_array(name: str, value: ArrayLike, ndim: int, int64_ok: bool = False) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    arr = arr.astype(np.int64)
    hi = np.iinfo(np.int64).max if int64_ok else INT32_MAX
    if arr.size and (arr.min() < -INT32_MAX - 1 or arr.max() > hi):
        raise ValueError(f"{name} holds values out of the {'int64' if int64_ok else 'int32'} range")
    return arr


def _per_group(name: str, value, G: int | None) -> list:
    if isinstance(value, np.ndarray) or not isinstance(value, (list, tuple)):
        value = [value]
    if G is not None and len(value) != G:
        raise ValueError(f"{name} must hold one entry per KV-cache group ({G}), got {len(value)}")
    return list(value)


def vllm_draft_reference(
    idx_mapping: ArrayLike,
    query_start_loc: ArrayLike,
    seq_lens: ArrayLike,
    num_rejected: ArrayLike,
    num_sampled: ArrayLike,
    block_tables: ArrayLike | Sequence[ArrayLike],
    block_sizes: int | Sequence[int],
    verify_slot_mappings: ArrayLike,
    max_model_len: int,
    num_speculative_steps: int,
    *,
    num_blocks: ArrayLike | Sequence[ArrayLike] | None = None,
    max_num_reqs: int | None = None,
    mask_rejected: bool = False,
    slot_mapping_enabled: bool | Sequence[bool] = True,
    dcp_sharded: bool | Sequence[bool] = True,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    attention: str | Sequence[str] | None = None,
    kv_indices_capacity: int | None = None,
) -> VllmDraftAddressing:
    """Compute the draft forwards' addressing after a verify step, on the host.

    Parameters
    ----------
    idx_mapping : int32 or int64 [num_reqs]
        Batch index -> request-state row; -1 for a dummy request.
    query_start_loc : int32 [num_reqs + 1]
        The verify step's.
    seq_lens : int32 [>= num_reqs]
        The verify step's ``seq_lens_t`` (tokens before the step + ``qe - qs``).
    num_rejected : int32 [>= num_reqs]
        Drafts scheduled minus accepted; 0 for a request in chunked prefill.
    num_sampled : int32 [>= num_reqs]
        Accepted drafts + 1; 0 for a request in chunked prefill.
    block_tables : int32 [rows, width_g], one per KV-cache group (or one array for one group)
        Indexed by row ``idx_mapping[b]``.
    block_sizes : int or sequence of int
        ``B_g`` per group (each >= 1).
    verify_slot_mappings : int32 or int64 [G, T] (or [T] for one group)
        The verify step's slot mappings, T >= ``query_start_loc[num_reqs]``.
    max_model_len : int
        M (>= 1); positions are clamped to ``M - 1`` and seq_lens to M.
    num_speculative_steps : int
        k (>= 1): the first forward plus ``k - 1`` draft steps.
    num_blocks : int32 [rows] per group, optional
        Allocated blocks per row; a block index at or past it sets
        :data:`~kvaddr.engines.vllm_errors.VERR_PAST_NUM_BLOCKS`. None: the width.
    max_num_reqs : int, optional
        Length of the per-request outputs (>= num_reqs); default num_reqs.
    mask_rejected : bool
        Give -1 to the rejected rows of the first forward's slot mappings. A token's
        request is found as the vLLM step finds it (:func:`~kvaddr.engines.vllm_reference.owner_search`),
        which is its range for a non-decreasing ``query_start_loc``.
    slot_mapping_enabled, dcp_sharded : bool or sequence of bool, default True
        Per group: False gives the group -1 slots; False addresses it plainly on every DCP rank.
    cp_size, cp_rank, cp_interleave : int
        Decode context parallelism (docs/vllm.md): a sharded group's slot of another
        rank's position is -1 (no check), this rank's is its local slot.
    attention : str or sequence of str, optional
        "flashinfer" and/or "varlen": each draft step's attention metadata over its
        ``seq_lens`` (a sharded group's: ``dcp_local_seq_lens``) and each request's row.
    kv_indices_capacity : int, optional
        N, entries of each step's and group's ``kv_indices`` (required with "flashinfer").

    Returns
    -------
    VllmDraftAddressing

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type, dtype or shape (the message names it).
    """
    idx = _int_array("idx_mapping", idx_mapping, 1, int64_ok=True)
    n = idx.shape[0]
    qsl = _int_array("query_start_loc", query_start_loc, 1)
    if qsl.shape[0] != n + 1:
        raise ValueError(f"query_start_loc must have num_reqs + 1 = {n + 1} entries, got {qsl.shape[0]}")
    lens = {}
    for name, value in (("seq_lens", seq_lens), ("num_rejected", num_rejected), ("num_sampled", num_sampled)):
        a = _int_array(name, value, 1)
        if a.shape[0] < n:
            raise ValueError(f"{name} must have at least num_reqs = {n} entries, got {a.shape[0]}")
        lens[name] = a[:n]
    seq_t, rej, smp = lens["seq_lens"], lens["num_rejected"], lens["num_sampled"]
    sizes = [check_int("block_sizes", b, lo=1, hi=INT32_MAX) for b in _per_group("block_sizes", block_sizes, None)]
    G = len(sizes)
    if not 1 <= G <= 8:
        raise ValueError(f"block_sizes must name 1 to 8 KV-cache groups, got {G}")
    tables = [_int_array(f"block_tables[{g}]", t, 2) for g, t in enumerate(_per_group("block_tables", block_tables, G))]
    rows = tables[0].shape[0]
    for g, t in enumerate(tables):
        if t.shape[0] != rows:
            raise ValueError(f"block_tables[{g}] must have {rows} rows like block_tables[0], got {t.shape[0]}")
    if num_blocks is None:
        nbs = [np.full(rows, t.shape[1], dtype=np.int64) for t in tables]
    else:
        nbs = [_int_array(f"num_blocks[{g}]", a, 1) for g, a in enumerate(_per_group("num_blocks", num_blocks, G))]
        for g, a in enumerate(nbs):
            if a.shape[0] < rows:
                raise ValueError(f"num_blocks[{g}] must have at least {rows} entries, got {a.shape[0]}")
    vsm = _int_array("verify_slot_mappings", verify_slot_mappings, np.ndim(verify_slot_mappings), int64_ok=True)
    if vsm.ndim == 1:
        vsm = vsm[None, :]
    if vsm.ndim != 2 or vsm.shape[0] != G:
        raise ValueError(f"verify_slot_mappings must have shape (G = {G}, T), got {vsm.shape}")
    M = check_int("max_model_len", max_model_len, lo=1, hi=INT32_MAX)
    k = check_int("num_speculative_steps", num_speculative_steps, lo=1, hi=INT32_MAX)
    R = n if max_num_reqs is None else check_int("max_num_reqs", max_num_reqs, lo=n, hi=INT32_MAX)
    if not isinstance(mask_rejected, (bool, np.bool_)):
        raise TypeError(f"mask_rejected must be a bool, got {type(mask_rejected).__name__}")
    enabled = _flags("slot_mapping_enabled", slot_mapping_enabled, G)
    sharded_flag = _flags("dcp_sharded", dcp_sharded, G)
    cp = check_int("cp_size", cp_size, lo=1, hi=INT32_MAX)
    rank = check_int("cp_rank", cp_rank, lo=0, hi=cp - 1)
    il = check_int("cp_interleave", cp_interleave, lo=1, hi=INT32_MAX)
    sharded = [cp > 1 and f for f in sharded_flag]
    for g in range(G):
        if sharded[g] and sizes[g] % il:
            raise ValueError(f"cp_interleave ({il}) must divide block_sizes[{g}] ({sizes[g]}) of a sharded group")
    groups = normalize_attention(attention)
    if "page_table" in groups:
        raise ValueError(
            "attention for the draft steps takes 'flashinfer' and 'varlen' (their page table is the verify step's)"
        )
    N = check_kv_indices_capacity(groups, kv_indices_capacity)
    T = vsm.shape[1]

    keys: list[int] = []
    mask = 0

    def record(bit: int, where: np.ndarray, step: int = 0, group: int = 0) -> None:
        nonlocal mask
        hit = np.flatnonzero(where)
        if hit.size:
            mask |= bit
            keys.append(vllm_error_key(step, int(hit[0]), group, bit))

    qs, qe = qsl[:-1], qsl[1:]
    qlen = qe - qs
    dummy = idx == -1
    row_bad = (idx < -1) | (idx >= rows)
    qsl_bad = (qs < 0) | (qe < qs)
    short = ~qsl_bad & (seq_t < qlen)
    rej_bad = ~qsl_bad & (
        (rej < 0)
        | (rej > qlen - 1)
        | (smp < 0)
        | ((smp > 1) & (smp + rej != qlen))
        | ((smp == 1) & (rej != 0) & (rej + 1 != qlen))
        | ((smp == 0) & (rej != 0))
    )
    cap_bad = ~qsl_bad & (qe > T)
    record(VERR_ROW_INDEX, row_bad)
    record(VERR_QUERY_START_LOC, qsl_bad)
    record(VERR_NEGATIVE_COMPUTED, short)
    record(VERR_NUM_REJECTED, rej_bad)
    record(VERR_CAPACITY, cap_bad)
    skipped = row_bad | qsl_bad | short | rej_bad
    live = ~skipped & ~dummy  # requests whose draft steps are addressed

    L = qlen - rej
    last = np.zeros(R, dtype=np.int64)
    last[:n] = np.where(skipped, 0, qs + L - 1)
    first = vsm.copy()
    if mask_rejected and n:
        t = np.arange(T, dtype=np.int64)
        owner = owner_search(qsl, t, n)
        rejected = ~skipped[owner] & (qs[owner] <= t) & (t < qe[owner]) & (t >= qe[owner] - rej[owner])
        first[:, rejected] = PAD_SLOT_ID

    P = seq_t - rej - 1
    rr = np.where(live, idx, 0)
    steps = k - 1
    positions = np.zeros((steps, R), dtype=np.int64)
    out_lens = np.zeros((steps, R), dtype=np.int32)
    slots = np.full((steps, G, R), PAD_SLOT_ID, dtype=np.int64)
    local_lens = np.zeros((steps, R), dtype=np.int32)
    qsl_j = np.minimum(np.arange(R + 1, dtype=np.int32), n)
    fi, varlen = "flashinfer" in groups, "varlen" in groups
    kv_indptr = np.zeros((steps, G, R + 1), dtype=np.int32) if fi else None
    kv_indices = np.full((steps, G, N or 0), -1, dtype=np.int32) if fi else None
    kv_last = np.zeros((steps, G, R), dtype=np.int32) if fi else None
    cu_k = np.zeros((steps, G, R + 1), dtype=np.int32) if varlen else None
    max_k = np.zeros((steps, G), dtype=np.int32) if varlen else None
    for j in range(1, steps + 1):
        pos = np.minimum(P + j, M - 1)
        positions[j - 1, :n] = np.where(live, pos, 0)
        s_j = np.where(live, np.minimum(seq_t - rej + j, M), 0)
        out_lens[j - 1, :n] = s_j
        local_lens[j - 1, :n] = dcp_local_lengths(s_j, cp, rank, il)
        for g, (table, B, nb_all) in enumerate(zip(tables, sizes, nbs)):
            if groups:
                L_g = np.zeros(R, dtype=np.int64)
                L_g[:n] = dcp_local_lengths(s_j, cp, rank, il) if sharded[g] else s_j
                _draft_attention(
                    j,
                    g,
                    L_g,
                    B,
                    table,
                    nb_all,
                    rr,
                    n,
                    N,
                    fi,
                    varlen,
                    record,
                    kv_indptr,
                    kv_indices,
                    kv_last,
                    cu_k,
                    max_k,
                )
            if not enabled[g]:
                continue
            if sharded[g]:
                vbs = B * cp
                bi, vo = pos // vbs, pos % vbs
                local = (vo // il) % cp == rank
                off = (vo // (il * cp)) * il + vo % il
            else:
                bi, off = pos // B, pos % B
                local = np.ones(n, dtype=bool)
            e_idx = live & local & (bi >= table.shape[1])
            e_nb = live & local & ~e_idx & (bi >= nb_all[rr])
            read = live & local & ~e_idx & ~e_nb
            blk = np.full(n, -1, dtype=np.int64)
            blk[read] = table[rr[read], bi[read]]
            e_neg = read & (blk < 0)
            ok = read & (blk >= 0)
            slots[j - 1, g, :n] = np.where(ok, blk * B + off, PAD_SLOT_ID)
            record(VERR_BLOCK_INDEX, e_idx, j, g)
            record(VERR_PAST_NUM_BLOCKS, e_nb, j, g)
            record(VERR_NEGATIVE_BLOCK, e_neg, j, g)

    return VllmDraftAddressing(
        last_token_indices=last,
        first_slot_mappings=first,
        positions=positions,
        seq_lens=out_lens,
        query_start_loc=np.broadcast_to(qsl_j, (steps, R + 1)).copy(),
        slot_mappings=slots,
        error_mask=mask,
        error_key=min(keys) if keys else VLLM_NO_ERROR_KEY,
        dcp_local_seq_lens=local_lens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=kv_last,
        cu_seqlens_k=cu_k,
        max_seqlen_k=max_k,
    )


def _flags(name: str, value, G: int) -> list[bool]:
    vals = _per_group(name, value, G) if isinstance(value, (list, tuple)) else [value] * G
    for g, v in enumerate(vals):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name}[{g}] must be a bool, got {v!r}")
    return [bool(v) for v in vals]


def _draft_attention(
    j, g, L, B, table, nb_all, rr, n, N, fi, varlen, record, kv_indptr, kv_indices, kv_last, cu_k, max_k
) -> None:
    """Draft step j's attention metadata of group g from the rows' KV lengths L (int64 [R])."""
    pages = -(-L // B)
    sat = lambda x: np.minimum(np.concatenate(([0], np.cumsum(x))), INT32_MAX)  # noqa: E731
    if varlen:
        cu_k[j - 1, g] = sat(L)
        max_k[j - 1, g] = L.max(initial=0)
    if not fi:
        return
    xp = sat(pages)
    kv_indptr[j - 1, g] = xp
    kv_last[j - 1, g] = np.where(L > 0, (L - 1) % B + 1, 0)
    W = table.shape[1]
    has = pages[:n] > 0
    nb = np.where(has, nb_all[rr], 0)
    record(VERR_BLOCK_INDEX, has & (pages[:n] > W), j, g)
    record(VERR_PAST_NUM_BLOCKS, has & (pages[:n] <= W) & (pages[:n] > nb), j, g)
    start = xp[:n]
    record(VERR_KV_INDICES_CAPACITY, has & (start <= N) & (np.minimum(start + pages[:n], INT32_MAX) > N), j, g)
    neg = np.zeros(n, dtype=bool)
    for b in np.flatnonzero(has):
        c = np.arange(int(pages[b]), dtype=np.int64)
        c = c[start[b] + c < N]
        ok = (c < W) & (c < nb[b])
        v = np.full(c.shape[0], -1, dtype=np.int64)
        v[ok] = table[rr[b], c[ok]]
        neg[b] = bool((v[ok] < 0).any())
        kv_indices[j - 1, g, start[b] + c] = np.where(v < 0, -1, v)
    record(VERR_NEGATIVE_BLOCK, neg, j, g)
