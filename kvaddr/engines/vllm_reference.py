"""NumPy reference of the vLLM step: the oracle of the kernel and the CPU path.

The contract (``docs/vllm.md``) in code. For batch index b < num_reqs with row
``r = idx_mapping[b]`` and tokens ``[qsl[b], qsl[b+1])``:

* ``positions[t] = num_computed_tokens[r] + (t - qsl[b])``; 0 for every other t < T.
* ``seq_lens[b] = num_computed_tokens[r] + (qsl[b+1] - qsl[b])`` (saturating at
  2**31 - 1); 0 for every other b < max_num_reqs.
* ``slot_mappings[g, t] = block_table_g[r, idx] * B_g + off`` with
  ``idx, off = divmod(pos, B_g)`` (DCP: the virtual block and local offset, -1 for
  a token another rank holds); -1 for a disabled group, for padding and for every
  t >= num_tokens.
* ``input_block_tables[g][b, j] = block_table_g[r, j]`` for
  ``j < clamp(num_blocks_g[r], 0, width_g)``, 0 after; sliding window: 0 for
  ``j < max(num_computed_tokens[r] - R_g, 0) // B_g``; every other row all 0.
* ``dcp_local_seq_lens[b] = (s // (I*cp)) * I + clamp(s % (I*cp) - c*I, 0, I)``
  with ``s = seq_lens[b]`` (``s`` itself without DCP).

A dummy request (``r = -1``) owns its tokens but no row: positions 0, slots -1,
seq_lens 0, a zero gathered row. A *skipped* request, one with a bad row index,
a negative ``num_computed_tokens`` or a decreasing / negative
``query_start_loc`` entry, is treated like a dummy and sets its error bit.

Which request owns token t: the search the kernel runs, replicated here
(:func:`owner_search`): the guess ``b = min(t, num_reqs - 1)`` if
``qsl[b] <= t < qsl[b+1]``, else the largest b with ``qsl[b] <= t`` by binary
search. For a non-decreasing ``query_start_loc`` that is simply the request whose
range holds t; for a decreasing one (an error) it is still well defined, and no
token reads out of bounds. A token whose found request does not hold it
(``t < qsl[0]``, or a bad ``query_start_loc``) is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvaddr.attention_reference import attention_metadata, check_kv_indices_capacity, normalize_attention
from kvaddr.engines.vllm_config import (
    INT32,
    INT64,
    VllmAttentionOutputs,
    VllmStepConfig,
    VllmStepOutputs,
    check_matrix,
    check_num_reqs_padded,
    check_vector,
    per_group,
)
from kvaddr.engines.vllm_errors import (
    VERR_BLOCK_INDEX,
    VERR_CAPACITY,
    VERR_KV_INDICES_CAPACITY,
    VERR_NEGATIVE_BLOCK,
    VERR_NEGATIVE_COMPUTED,
    VERR_NUM_BLOCKS,
    VERR_PAST_NUM_BLOCKS,
    VERR_QUERY_START_LOC,
    VERR_ROW_INDEX,
    VERR_SLOT_INT32,
    VLLM_NO_ERROR_KEY,
    VllmAddressingError,
    vllm_error_key,
)
from kvaddr.outputs import PAD_PAGE_ID, DsaOutputs
from kvaddr.validation import INT32_MAX, check_int, host_info

PAD_SLOT_ID = -1


@dataclass
class VllmReferenceResult:
    """The reference's outputs, the number of tokens it addressed and the error record."""

    outputs: VllmStepOutputs
    num_tokens: int
    error_mask: int
    error_key: int
    #: The attention metadata's records alone (mask, key), also folded into the two above.
    attention_errors: tuple = (0, VLLM_NO_ERROR_KEY)

    def check(self) -> None:
        """Raise :class:`~kvaddr.engines.vllm_errors.VllmAddressingError` on bad values."""
        if self.error_mask:
            raise VllmAddressingError(self.error_mask, self.error_key)


def _host(name: str, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__module__}.{type(x).__qualname__}")
    return host_info(x)


@dataclass
class CheckedInputs:
    """A step's inputs after the host checks (NumPy views, one per group)."""

    idx_mapping: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
    block_tables: list
    num_blocks: list
    num_reqs: int
    num_reqs_padded: int


def check_host_inputs(
    config: VllmStepConfig,
    idx_mapping,
    query_start_loc,
    num_computed_tokens,
    block_tables,
    num_blocks,
    num_reqs_padded=None,
) -> CheckedInputs:
    """The host checks of :class:`VllmStepPlanner`, on NumPy arrays."""
    M, G = config.max_num_reqs, config.num_groups
    idx = check_vector(
        "idx_mapping", _host("idx_mapping", idx_mapping), dtypes=(INT32, INT64), shape_text="(num_reqs,)"
    ).obj
    n = idx.shape[0]
    if n > M:
        raise ValueError(f"idx_mapping must have at most max_num_reqs = {M} entries, got {n}")
    qsl = check_vector(
        "query_start_loc",
        _host("query_start_loc", query_start_loc),
        length=n + 1,
        shape_text=f"(num_reqs + 1,) = ({n + 1},)",
    ).obj
    nct = check_vector(
        "num_computed_tokens",
        _host("num_computed_tokens", num_computed_tokens),
        min_length=M,
        shape_text=f"(rows >= max_num_reqs = {M},)",
    ).obj
    tables = []
    for g, t in enumerate(per_group("block_tables", block_tables, G, allow_stacked=False)):
        name = f"block_tables[{g}]" if G > 1 else "block_tables"
        W = config.widths[g]
        tables.append(
            check_matrix(name, _host(name, t), min_rows=M, cols=W, shape_text=f"(rows >= {M}, width = {W})").obj
        )
    nbs = per_group("num_blocks", num_blocks, G, allow_stacked=True)
    if len(nbs) == 1 and (G > 1 or len(getattr(nbs[0], "shape", ())) == 2):
        stacked = nbs[0]
        info = _host("num_blocks", stacked)
        if info.dtype != INT32 or len(info.shape) != 2 or info.shape[0] != G or info.shape[1] < M:
            raise ValueError(
                f"num_blocks must be int32 with shape ({G}, rows >= {M}) or a sequence of {G} arrays, "
                f"got dtype {info.dtype} shape {info.shape}"
            )
        nbs = [stacked[g] for g in range(G)]
    out_nbs = []
    for g, nb in enumerate(nbs):
        name = f"num_blocks[{g}]" if G > 1 else "num_blocks"
        out_nbs.append(
            check_vector(name, _host(name, nb), min_length=M, shape_text=f"(rows >= max_num_reqs = {M},)").obj
        )
    padded = check_num_reqs_padded(num_reqs_padded, n, M)
    return CheckedInputs(idx, qsl, nct, tables, out_nbs, n, padded)


def owner_search(qsl: np.ndarray, t: np.ndarray, n: int) -> np.ndarray:
    """The kernel's owner search for tokens ``t`` (int64) over ``qsl`` (int64, n + 1 entries)."""
    g = np.minimum(t, n - 1)
    hit = (qsl[g] <= t) & (t < qsl[g + 1])
    lo = np.zeros_like(t)
    hi = np.full_like(t, n - 1)
    hi[hit] = 0  # no search for a hit
    while True:
        live = lo < hi
        if not live.any():
            break
        mid = (lo + hi + 1) >> 1
        c = qsl[mid] <= t
        lo = np.where(live & c, mid, lo)
        hi = np.where(live & ~c, mid - 1, hi)
    return np.where(hit, g, lo)


def dcp_local_lengths(s: np.ndarray, cp_size: int, cp_rank: int, interleave: int) -> np.ndarray:
    """This rank's share of each length ``s`` (int64 array)."""
    if cp_size == 1:
        return s.copy()
    span = interleave * cp_size
    return (s // span) * interleave + np.clip(s % span - cp_rank * interleave, 0, interleave)


def vllm_step_reference(
    config: VllmStepConfig,
    idx_mapping,
    query_start_loc,
    num_computed_tokens,
    block_tables,
    num_blocks,
    *,
    num_reqs_padded: int | None = None,
    attention=None,
    kv_indices_capacity: int | None = None,
    dsa: bool = False,
    dsa_cache: int | None = None,
    dsa_decode_len: int = 1,
    dsa_value_bytes: int = 128,
    dsa_scale_bytes: int = 4,
) -> VllmReferenceResult:
    """Compute a vLLM step on the host.

    Parameters
    ----------
    config : VllmStepConfig
    idx_mapping : int32 or int64 [num_reqs]
        Batch index -> request-state row; -1 for a dummy request.
    query_start_loc : int32 [num_reqs + 1]
    num_computed_tokens : int32 [rows >= max_num_reqs]
    block_tables : int32 [rows >= max_num_reqs, width_g], one per group (or one array for one group)
    num_blocks : int32 [rows >= max_num_reqs] per group, or one int32 [G, rows >= max_num_reqs]
    num_reqs_padded : int, optional
        ``num_reqs <= . <= max_num_reqs``; checked (the outputs do not depend on it).
    attention : str or sequence of str, optional
        Attention metadata groups (``"flashinfer"``, ``"varlen"``, ``"page_table"``), as
        :class:`~kvaddr.engines.vllm.VllmStepPlanner` takes them: ``outputs.attention``
        (:func:`vllm_attention_metadata`); None or empty: none.
    kv_indices_capacity : int, optional
        N, the entries of each group's ``kv_indices`` (required with "flashinfer").
    dsa : bool, default False
        Also compute the DSA outputs (``outputs.dsa``, :func:`vllm_dsa_reference`) with
        ``dsa_cache`` (the group; the last by default), ``dsa_decode_len``,
        ``dsa_value_bytes`` and ``dsa_scale_bytes``, as :class:`~kvaddr.engines.vllm.VllmStepPlanner`
        takes them.

    Returns
    -------
    VllmReferenceResult
    """
    groups = normalize_attention(attention)
    N = check_kv_indices_capacity(groups, kv_indices_capacity)
    c = check_host_inputs(
        config, idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, num_reqs_padded
    )
    M, T, G = config.max_num_reqs, config.max_num_batched_tokens, config.num_groups
    n = c.num_reqs
    qsl = c.query_start_loc.astype(np.int64)
    r = c.idx_mapping.astype(np.int64)
    nct_all = c.num_computed_tokens.astype(np.int64)

    dummy = r == -1
    row_bad = (r < -1) | (r >= M)
    rr = np.where(dummy | row_bad, 0, r)
    nct = nct_all[rr]
    neg = ~dummy & ~row_bad & (nct < 0)
    qsl_bad = (qsl[:-1] < 0) | (qsl[1:] < qsl[:-1])
    cap_bad = qsl[1:] > T
    good = ~dummy & ~row_bad & ~neg & ~qsl_bad
    qlen = qsl[1:] - qsl[:-1]
    tok = np.clip(qsl[:-1], 0, INT32_MAX)

    keys: list[int] = []
    mask = 0

    def record(bit, where, token, group=0):
        # The smallest key over every request with the error (the kernel min-reduces
        # keys; with a decreasing query_start_loc the first request need not hold it).
        nonlocal mask
        hit = np.flatnonzero(where)
        if hit.size:
            mask |= bit
            toks = np.full(hit.size, token, dtype=np.int64) if np.isscalar(token) else token[hit]
            first = int(np.lexsort((hit, toks))[0])
            keys.append(vllm_error_key(int(toks[first]), int(hit[first]), group, bit))

    record(VERR_ROW_INDEX, row_bad, tok)
    record(VERR_QUERY_START_LOC, qsl_bad, tok)
    record(VERR_CAPACITY, cap_bad, T)
    record(VERR_NEGATIVE_COMPUTED, neg, tok)

    seq = np.zeros(M, dtype=np.int64)
    seq[:n] = np.where(good, np.minimum(nct + qlen, INT32_MAX), 0)
    seq_lens = seq.astype(np.int32)
    dcp = dcp_local_lengths(seq, config.cp_size, config.cp_rank, config.cp_interleave).astype(np.int32)

    num_tokens = int(np.clip(qsl[-1], 0, T))
    t = np.arange(num_tokens, dtype=np.int64)
    if n:
        b = owner_search(qsl, t, n)
        valid = (qsl[b] <= t) & (t < qsl[b + 1]) & good[b]
    else:
        b = np.zeros(num_tokens, dtype=np.int64)
        valid = np.zeros(num_tokens, dtype=bool)
    pos = np.where(valid, nct[b] + t - qsl[b] if n else 0, 0)
    positions = np.zeros(T, dtype=np.int64)
    positions[:num_tokens] = pos

    slot_dtype = config.slot_dtype
    slots = np.full((G, T), PAD_SLOT_ID, dtype=slot_dtype)
    gathered = []
    for g in range(G):
        B, W = config.block_sizes[g], config.widths[g]
        table, nb_all = c.block_tables[g], c.num_blocks[g].astype(np.int64)
        if config.slot_mapping_enabled[g] and num_tokens and n:
            if config.sharded(g):
                cp, il, rank = config.cp_size, config.cp_interleave, config.cp_rank
                vbs = B * cp
                idx, vo = pos // vbs, pos % vbs
                active = valid & ((vo // il) % cp == rank)
                off = (vo // (il * cp)) * il + vo % il
            else:
                idx, off = pos // B, pos % B
                active = valid
            row = rr[b]
            nb = nb_all[row]
            e_idx = active & (idx >= W)
            e_nb = active & ~e_idx & (idx >= nb)
            read = active & ~e_idx & ~e_nb
            blk = np.full(num_tokens, -1, dtype=np.int64)
            blk[read] = table[row[read], idx[read]]
            e_neg = read & (blk < 0)
            ok = read & (blk >= 0)
            slot = blk * B + off
            e_32 = np.zeros(num_tokens, dtype=bool)
            if slot_dtype == INT32:
                e_32 = ok & (slot > INT32_MAX)
                ok &= ~e_32
            slots[g, :num_tokens] = np.where(ok, slot, PAD_SLOT_ID).astype(slot_dtype)
            for bit, where in (
                (VERR_BLOCK_INDEX, e_idx),
                (VERR_PAST_NUM_BLOCKS, e_nb),
                (VERR_NEGATIVE_BLOCK, e_neg),
                (VERR_SLOT_INT32, e_32),
            ):
                h = np.flatnonzero(where)
                if h.size:
                    mask |= bit
                    keys.append(vllm_error_key(int(t[h[0]]), int(b[h[0]]), g, bit))
        out = np.zeros((M, W), dtype=np.int32)
        if n:
            nb = nb_all[rr]
            record(VERR_NUM_BLOCKS, good & ((nb < 0) | (nb > W)), tok, g)
            nbc = np.clip(nb, 0, W)
            first = np.zeros(n, dtype=np.int64)
            R = config.sliding_window_reach[g]
            if R > 0:
                first = np.maximum(nct - R, 0) // B
            cols = np.arange(W, dtype=np.int64)[None, :]
            keep = good[:, None] & (cols < nbc[:, None]) & (cols >= first[:, None])
            out[:n] = np.where(keep, table[rr], 0)
        gathered.append(out)

    outputs = VllmStepOutputs(
        positions=positions,
        seq_lens=seq_lens,
        slot_mappings=slots,
        input_block_tables=tuple(gathered),
        dcp_local_seq_lens=dcp,
    )
    if dsa:
        g = G - 1 if dsa_cache is None else check_int("dsa_cache", dsa_cache, lo=0, hi=G - 1)
        tok_b = np.full(T, -1, dtype=np.int64)
        tok_b[:num_tokens] = np.where(valid, b, -1)
        outputs.dsa = vllm_dsa_reference(
            seq_lens[:n],
            qlen,
            good,
            tok_b,
            positions,
            slots[g],
            config.block_sizes[g],
            M,
            decode_len=dsa_decode_len,
            value_bytes=dsa_value_bytes,
            scale_bytes=dsa_scale_bytes,
        )
    attn_errors = (0, VLLM_NO_ERROR_KEY)
    if groups:
        outputs.attention, a_mask, a_key = vllm_attention_metadata(config, c, outputs, groups, N)
        attn_errors = (a_mask, a_key)
        mask |= a_mask
        if a_mask:
            keys.append(a_key)
    return VllmReferenceResult(outputs, num_tokens, mask, min(keys) if keys else VLLM_NO_ERROR_KEY, attn_errors)


def vllm_dsa_reference(
    seq_lens,
    query_lens,
    good,
    req_id_per_token,
    positions,
    slots,
    block_size: int,
    max_num_reqs: int,
    *,
    decode_len: int = 1,
    value_bytes: int = 128,
    scale_bytes: int = 4,
) -> DsaOutputs:
    """The vLLM step's DSA outputs (docs/dsa.md, "The vLLM step") from its inputs and outputs.

    Parameters
    ----------
    seq_lens, query_lens : int [num_reqs]
        The step's ``seq_lens[:num_reqs]`` and each request's ``qsl[b+1] - qsl[b]``.
    good : bool [num_reqs]
        A real request with good inputs (a real row, ``num_computed_tokens >= 0``, a good range).
    req_id_per_token : int [T]
        The owner b of each valid token (the step's owner search), -1 elsewhere.
    positions : int [T]
        The step's positions.
    slots : int [T]
        The step's slot mapping of the indexer cache's group (-1: none).
    block_size : int
        B of that group.
    max_num_reqs : int
        ``cu_seq_lens`` has ``max_num_reqs + 1`` entries.
    decode_len : int, default 1
        n: a good request running ``q <= n`` tokens is a decode, one running more a prefill.
    value_bytes, scale_bytes : int, default 128 and 4

    Returns
    -------
    DsaOutputs
        NumPy arrays; the offsets are :func:`kvaddr.dsa_reference.indexer_cache_offsets` of
        ``slots`` (valid tokens only), ``ctx = position + 1``, ``ks`` / ``ke`` over the
        prefills' ``cu_seq_lens``; invalid tokens -1, -1, 0, 0, 0, -1.
    """
    from kvaddr.dsa_reference import indexer_cache_offsets

    seq = np.asarray(seq_lens, dtype=np.int64)
    q = np.asarray(query_lens, dtype=np.int64)
    good = np.asarray(good, dtype=bool)
    req = np.asarray(req_id_per_token, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    n = check_int("decode_len", decode_len, lo=1)
    M = int(max_num_reqs)
    real = req >= 0
    sl = np.where(real, np.asarray(slots, dtype=np.int64), -1)
    off = indexer_cache_offsets(sl, block_size, value_bytes=value_bytes, scale_bytes=scale_bytes)
    prefill = good & (q > n)
    lens = np.where(prefill, seq, 0)
    before = np.minimum(np.concatenate([[0], np.cumsum(lens)]), INT32_MAX)  # saturating prefix
    P = int(prefill.sum())
    cu = np.full(M + 1, int(before[-1]), dtype=np.int64)
    cu[:P] = before[:-1][prefill]
    ctx = np.where(real, np.minimum(pos + 1, INT32_MAX), 0)
    b = np.where(real, req, 0)
    is_pre = real & prefill[b] if q.size else np.zeros_like(real)
    ks = np.where(is_pre, before[b] if q.size else 0, 0)
    ke = np.where(is_pre, np.minimum(ks + ctx, INT32_MAX), 0)
    i32 = np.int32
    return DsaOutputs(
        value_offsets=off.value,
        scale_offsets=off.scale,
        ks=ks.astype(i32),
        ke=ke.astype(i32),
        ctx=ctx.astype(i32),
        cu_seq_lens=cu.astype(i32),
        req_id_per_token=np.where(real, req, -1).astype(i32),
    )


def attention_lengths(config: VllmStepConfig, outputs: VllmStepOutputs, g: int) -> np.ndarray:
    """``L_bg`` (int32 [M]): group g's KV length of each batch row, the length its attention
    reads on this rank: ``dcp_local_seq_lens`` for a DCP-sharded group, else ``seq_lens``."""
    return outputs.dcp_local_seq_lens if config.sharded(g) else outputs.seq_lens


def vllm_attention_metadata(
    config: VllmStepConfig, c: CheckedInputs, outputs: VllmStepOutputs, groups: tuple, N: int | None
) -> tuple:
    """The attention metadata of a computed step (docs/vllm.md, "Attention metadata").

    Parameters
    ----------
    config : VllmStepConfig
    c : CheckedInputs
        The step's checked inputs (:func:`check_host_inputs`).
    outputs : VllmStepOutputs
        The step's outputs (``seq_lens``, ``dcp_local_seq_lens``, the gathered tables).
    groups : tuple of str
        :func:`~kvaddr.attention_reference.normalize_attention`'s groups.
    N : int or None
        ``kv_indices_capacity`` (with "flashinfer").

    Returns
    -------
    (VllmAttentionOutputs, error_mask, first_key)
        Bits 1 (pages beyond the row's width), 16 (pages beyond ``num_blocks``), 2 (a
        negative block id among the entries written) and 512 (more entries than N), each
        keyed at the request's first token ``(qsl[b], b, g, bit)``; flashinfer only.
    """
    M, G, n = config.max_num_reqs, config.num_groups, c.num_reqs
    qsl = c.query_start_loc.astype(np.int64)
    out = VllmAttentionOutputs()
    mask, keys = 0, []
    fi, varlen = "flashinfer" in groups, "varlen" in groups
    if "page_table" in groups:
        out.page_table = outputs.input_block_tables
    if not (fi or varlen):
        return out, 0, VLLM_NO_ERROR_KEY
    qo = np.empty(M + 1, dtype=np.int32)
    qo[: n + 1] = c.query_start_loc
    qo[n + 1 :] = c.query_start_loc[n]
    out.qo_indptr = qo
    Ls = [attention_lengths(config, outputs, g).astype(np.int64) for g in range(G)]
    if varlen:
        out.cu_seqlens_k = np.zeros((G, M + 1), dtype=np.int32)
        for g in range(G):
            out.cu_seqlens_k[g] = np.minimum(np.concatenate([[0], np.cumsum(Ls[g])]), INT32_MAX)
        out.seqused_k = tuple(attention_lengths(config, outputs, g) for g in range(G))
        q = np.clip(qsl[1:] - qsl[:-1], 0, INT32_MAX)
        out.max_seqlen_q = np.array(q.max() if n else 0, dtype=np.int32)
        out.max_seqlen_k = np.array([L.max() for L in Ls], dtype=np.int32)
    if not fi:
        return out, 0, VLLM_NO_ERROR_KEY
    out.kv_indptr = np.zeros((G, M + 1), dtype=np.int32)
    out.kv_indices = np.full((G, N), PAD_PAGE_ID, dtype=np.int32)
    out.kv_last_page_len = np.zeros((G, M), dtype=np.int32)
    tok = np.clip(qsl[:-1], 0, INT32_MAX)
    rr = np.clip(c.idx_mapping.astype(np.int64), 0, M - 1)
    for g in range(G):
        B, W, L = config.block_sizes[g], config.widths[g], Ls[g]
        # The metadata of the first num_reqs rows (the reference of the core step's attention):
        # kv_indptr, the entries of the gathered rows (-1 past the width, for a negative id
        # and past kv_indptr[g, n]), kv_last_page_len.
        res = attention_metadata(qsl[: n + 1], L[:n], [outputs.input_block_tables[g]], [B], "flashinfer", N)
        a = res.outputs
        out.kv_indptr[g, : n + 1] = a.kv_indptr[0]
        out.kv_indptr[g, n + 1 :] = a.kv_indptr[0, n]
        out.kv_indices[g] = a.kv_indices[0]
        out.kv_last_page_len[g, :n] = a.kv_last_page_len[0]
        # The checks, every request (the smallest key of each bit)
        pages = -(-L[:n] // B)
        start = np.concatenate([[0], np.cumsum(pages)])[:-1]
        nb = np.clip(c.num_blocks[g].astype(np.int64)[rr], 0, W)
        nb = np.where(pages > 0, nb, 0)
        first = np.zeros(n, dtype=np.int64)
        R = config.sliding_window_reach[g]
        if R > 0 and n:
            nct = c.num_computed_tokens.astype(np.int64)[rr]
            first = np.clip(np.maximum(nct - R, 0) // B, 0, W)
        e_w = pages > W
        e_nb = ~e_w & (pages > nb)
        e_cap = (start <= N) & (start + pages > N)
        e_neg = np.zeros(n, dtype=bool)
        for b in np.flatnonzero(pages > 0):
            hi = min(int(pages[b]), W, int(nb[b]), max(N - int(start[b]), 0))  # entries read and written
            lo = int(first[b])
            if hi > lo:
                e_neg[b] = bool((c.block_tables[g][rr[b], lo:hi] < 0).any())
        for bit, where in (
            (VERR_BLOCK_INDEX, e_w),
            (VERR_PAST_NUM_BLOCKS, e_nb),
            (VERR_NEGATIVE_BLOCK, e_neg),
            (VERR_KV_INDICES_CAPACITY, e_cap),
        ):
            hit = np.flatnonzero(where)
            if hit.size:
                mask |= bit
                keys.extend(vllm_error_key(int(tok[b]), int(b), g, bit) for b in hit)
    return out, mask, min(keys) if keys else VLLM_NO_ERROR_KEY
