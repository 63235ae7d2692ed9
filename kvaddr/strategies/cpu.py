"""The strategies on the CPU, in NumPy: the profiler's path without a GPU.

Same construction and ``step()`` as :mod:`kvaddr.strategies.gpu`, on NumPy arrays.
The fused strategy is the reference itself; the others run the position
computation once and then NumPy versions of the per-layer work, so the CPU
profile shows what repeating that work per layer costs on a host. ``one-block``
emulates FastDeploy's one-block kernel: every request's serial prefix (a
quadratic sum, as its threads do it), then a loop over the requests writing
each one's tokens; at most 1024 requests, like the kernel.

With ``attention=...`` (docs/attention.md) the fused strategy returns the
reference's attention metadata (one launch, like the fused kernel), and the
baselines build it the way engines do today, in separate steps once per step
(:func:`engine_attention_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.errors import ERR_CAPACITY, ERR_NEGATIVE_LENGTH, NO_ERROR_KEY, AddressingError, error_key
from kvaddr.outputs import PAD_PAGE_ID, PAD_SLOT_ID, AttentionOutputs, StepOutputs
from kvaddr.reference import as_int32, step_addressing
from kvaddr.strategies.names import CHAIN_OPS, STRATEGY_NAMES, check_bsz, check_name
from kvaddr.validation import (
    INT32_MAX,
    MAX_REQUESTS,
    check_block_sizes,
    check_host_array,
    check_int,
    check_lengths,
    normalize_tables,
)

__all__ = ["ENGINE_ATTENTION_OPS", "STRATEGY_NAMES", "engine_attention_metadata", "make_strategy"]

#: The separate operations (launches, on a GPU) engines run today to build each group's
#: metadata, once per step: "flashinfer" once per cache, "varlen" once.
ENGINE_ATTENTION_OPS = {
    "flashinfer": (
        "pages = (seq_lens + B - 1) // B",
        "kv_indptr[1:] = cumsum(pages)",
        "mask = arange(max_blocks) < pages[:, None]",
        "kv_indices[:n] = block_table[:bsz][mask]",
        "kv_indices[n:] = -1",
        "last_page_len = where(seq_lens > 0, (seq_lens - 1) % B + 1, 0)",
    ),
    "varlen": (
        "cu_seqlens_k[1:] = cumsum(seq_lens)",
        "max_seqlen_q = max(diff(cu_seqlens_q))",
        "max_seqlen_k = max(seq_lens)",
    ),
    "page_table": (),  # engines pass block_table[:bsz] itself
}


def engine_launches(groups, num_caches: int) -> int:
    """Launches :func:`engine_attention_metadata`'s steps stand for."""
    per_cache = len(ENGINE_ATTENTION_OPS["flashinfer"]) * num_caches if "flashinfer" in groups else 0
    return per_cache + (len(ENGINE_ATTENTION_OPS["varlen"]) if "varlen" in groups else 0)


def engine_attention_metadata(cu_seqlens_q, seq_lens_kv, tables, block_sizes, groups, kv_indices_capacity):
    """Attention metadata built the way engines build it today: separate array ops, no checks.

    vLLM's FlashInfer backend style: ``kv_indptr`` by a cumsum of the page counts,
    ``kv_indices`` by a masked gather of the block table's rows (so it never reads
    past a row: an overflowing request gets fewer entries), ``kv_last_page_len``
    elementwise; varlen's ``cu_seqlens_k`` by a cumsum and the maxima by reductions.
    Equal to :func:`kvaddr.attention_reference.attention_metadata` on valid inputs;
    bad inputs set no error bits (negative block ids are copied as they are).
    The GPU baselines mirror it op for op (:data:`ENGINE_ATTENTION_OPS`).
    """
    L = np.asarray(seq_lens_kv, dtype=np.int64)
    cu = np.asarray(cu_seqlens_q)
    bsz = L.shape[0]
    out = AttentionOutputs()
    if "varlen" in groups:
        cuk = np.zeros(bsz + 1, dtype=np.int64)
        cuk[1:] = np.cumsum(L)
        out.cu_seqlens_k = np.minimum(cuk, INT32_MAX).astype(np.int32)
        out.seqused_k = L.astype(np.int32)
        out.max_seqlen_q = np.array(np.diff(cu.astype(np.int64)).max() if bsz else 0, dtype=np.int32)
        out.max_seqlen_k = np.array(L.max() if bsz else 0, dtype=np.int32)
    if "page_table" in groups:
        out.page_table = tuple(t[:bsz] for t in tables)
    if "flashinfer" in groups:
        G, N = len(block_sizes), kv_indices_capacity
        out.qo_indptr = np.asarray(cu, dtype=np.int32)
        out.kv_indptr = np.zeros((G, bsz + 1), dtype=np.int32)
        out.kv_indices = np.empty((G, N), dtype=np.int32)
        out.kv_last_page_len = np.empty((G, bsz), dtype=np.int32)
        for g, (t, B) in enumerate(zip(tables, block_sizes)):
            pages = (L + B - 1) // B
            out.kv_indptr[g, 1:] = np.minimum(np.cumsum(pages), INT32_MAX)
            mask = np.arange(t.shape[1]) < pages[:, None]
            gathered = t[:bsz][mask]
            n = min(gathered.shape[0], N)
            out.kv_indices[g, :n] = gathered[:n]
            out.kv_indices[g, n:] = PAD_PAGE_ID
            out.kv_last_page_len[g] = np.where(L > 0, (L - 1) % B + 1, 0)
    return out


class _CpuStrategy:
    name = ""

    def __init__(
        self,
        *,
        max_requests: int,
        capacity: int,
        block_sizes,
        num_layers: int = 1,
        position_dtype=np.int64,
        device=None,
        attention=None,
        kv_indices_capacity=None,
    ):
        self.max_requests = check_int("max_requests", max_requests, lo=1, hi=MAX_REQUESTS - 1)
        self.capacity = check_int("capacity", capacity, lo=1, hi=INT32_MAX - 1)
        self.block_sizes = check_block_sizes(block_sizes, max_caches=4)
        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.position_dtype = position_dtype
        self.attention = normalize_attention(attention)
        self.kv_indices_capacity = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        if ("flashinfer" in self.attention or "page_table" in self.attention) and not self.block_sizes:
            raise ValueError("attention 'flashinfer' and 'page_table' need at least one cache (block_sizes is empty)")
        self.launches_per_step = None

    def _positions(self, dec, q, enc, block_sizes=()):
        if np.shape(dec)[0] > self.max_requests:
            raise ValueError(
                f"seq_lens_decoder must have at most max_requests = {self.max_requests} entries, got {np.shape(dec)[0]}"
            )
        return step_addressing(
            dec, q, [], list(block_sizes), self.capacity, seq_lens_encoder=enc, position_dtype=self.position_dtype
        )

    def _tables(self, block_tables, bsz):
        tables = normalize_tables(block_tables, len(self.block_sizes))
        return [check_host_array("block_tables", t, ndim=2, min_rows=bsz) for t in tables]


def _chain(pos, batch, table, B):
    """The per-layer op chain in NumPy (the GPU chain's steps, as array ops)."""
    if table.shape[0] == 0:
        return np.full(pos.shape[0], PAD_SLOT_ID, dtype=np.int64)
    idx = pos // B  # pos // B
    blk = table[np.maximum(batch, 0), np.minimum(idx, table.shape[1] - 1)]  # gather, kept in the table
    slot = blk.astype(np.int64) * B + pos % B  # block * B + pos % B, int64
    slot[(batch < 0) | (idx >= table.shape[1]) | (blk < 0)] = PAD_SLOT_ID  # where(padding or bad)
    return slot


def _slots_one_kernel(pos, batch, table, B):
    """One pass per layer and cache with no masked copies (the 'one kernel' analogue)."""
    if table.shape[0] == 0:
        return np.full(pos.shape[0], PAD_SLOT_ID, dtype=np.int64)
    idx, off = np.divmod(pos, B)
    ok = (batch >= 0) & (idx < table.shape[1])
    blk = table[np.where(ok, batch, 0), np.where(ok, idx, 0)]
    return np.where(ok & (blk >= 0), blk.astype(np.int64) * B + off, PAD_SLOT_ID)


class _PositionsThenSlots(_CpuStrategy):
    def step(self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None):
        res = self._positions(seq_lens_decoder, seq_lens_this_time, seq_lens_encoder)
        o = res.outputs
        tables = self._tables(block_tables, o.seq_lens_kv.shape[0])
        slots = self._slots(o.position_ids.astype(np.int64), o.batch_id_per_token, tables)
        self._last = res
        out = StepOutputs(o.cu_seqlens_q, o.num_tokens, o.batch_id_per_token, o.position_ids, o.seq_lens_kv, slots)
        if self.attention:
            out.attention = engine_attention_metadata(
                o.cu_seqlens_q, o.seq_lens_kv, tables, self.block_sizes, self.attention, self.kv_indices_capacity
            )
            self.launches_per_step += engine_launches(self.attention, len(self.block_sizes))
        return out

    def check(self, stream=None):
        self._last.check()


class PerLayer(_PositionsThenSlots):
    name = "per-layer"

    def _slots(self, pos, batch, tables):
        G = len(self.block_sizes)
        out = np.empty((G, self.capacity), dtype=np.int64)
        for _ in range(self.num_layers):
            for g, (t, B) in enumerate(zip(tables, self.block_sizes)):
                out[g] = _chain(pos, batch, t, B)
        self.launches_per_step = 1 + self.num_layers * G * len(CHAIN_OPS)
        return out


class PerLayerKernel(_PositionsThenSlots):
    name = "per-layer-kernel"

    def _slots(self, pos, batch, tables):
        G = len(self.block_sizes)
        out = np.empty((G, self.capacity), dtype=np.int64)
        for _ in range(self.num_layers):
            for g, (t, B) in enumerate(zip(tables, self.block_sizes)):
                out[g] = _slots_one_kernel(pos, batch, t, B)
        self.launches_per_step = 1 + self.num_layers * G
        return out


class Hoisted(_PositionsThenSlots):
    name = "hoisted"

    def _slots(self, pos, batch, tables):
        out = np.empty((len(self.block_sizes), self.capacity), dtype=np.int64)
        done: dict = {}
        for g, (t, B) in enumerate(zip(tables, self.block_sizes)):
            key = (id(t), B)
            if key not in done:
                done[key] = _chain(pos, batch, t, B)
            out[g] = done[key]
        self.launches_per_step = 1 + len(done) * len(CHAIN_OPS)
        return out


class OneBlock(_CpuStrategy):
    """FastDeploy's one-block kernel in NumPy: per request a serial prefix, then its tokens.

    Same outputs as the reference for every input; records error bits 4 and 8
    (like the GPU kernel); at most 1024 requests per step
    (:class:`~kvaddr.errors.StrategyLimitExceeded` beyond that).
    """

    name = "one-block"

    def step(self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None):
        d = as_int32("seq_lens_decoder", seq_lens_decoder)
        n = as_int32("seq_lens_this_time", seq_lens_this_time)
        bsz = d.shape[0]
        enc = None if seq_lens_encoder is None else as_int32("seq_lens_encoder", seq_lens_encoder).shape[0]
        check_lengths(bsz, q=n.shape[0], enc=enc)
        if bsz > self.max_requests:
            raise ValueError(
                f"seq_lens_decoder must have at most max_requests = {self.max_requests} entries, got {bsz}"
            )
        check_bsz(self.name, bsz)
        tables = self._tables(block_tables, bsz)
        C, G = self.capacity, len(self.block_sizes)
        d64, n64 = d.astype(np.int64), n.astype(np.int64)
        bad = (d64 < 0) | (n64 < 0)
        n64[bad] = 0
        # Thread b's serial prefix: n[0] + ... + n[b-1], every thread on its own (quadratic, as in the kernel).
        earlier = np.arange(bsz)[None, :] < np.arange(bsz)[:, None]
        start = (earlier * n64[None, :]).sum(axis=1) if bsz else np.zeros(0, dtype=np.int64)
        end = start + n64
        cu = np.zeros(bsz + 1, dtype=np.int32)
        cu[1:] = np.minimum(end, INT32_MAX)
        kv = np.where(bad, 0, np.minimum(d64 + n64, INT32_MAX)).astype(np.int32)
        total = int(end[-1]) if bsz else 0
        num_tokens = min(total, C)
        batch = np.empty(C, dtype=np.int32)
        pos = np.empty(C, dtype=self.position_dtype)
        slots = np.empty((G, C), dtype=np.int64)
        for b in range(bsz):  # thread b's token loop
            lo, hi = min(int(start[b]), C), min(int(end[b]), C)
            if lo >= hi:
                continue
            p = d64[b] + np.arange(hi - lo, dtype=np.int64)
            batch[lo:hi] = b
            pos[lo:hi] = p.astype(self.position_dtype)
            for g, (t, B) in enumerate(zip(tables, self.block_sizes)):
                idx, off = np.divmod(p, B)
                ok = idx < t.shape[1]
                blk = np.full(hi - lo, -1, dtype=np.int64)
                blk[ok] = t[b, idx[ok]]
                slots[g, lo:hi] = np.where(ok & (blk >= 0), blk * B + off, PAD_SLOT_ID)
        # After the barrier: the padding tokens.
        batch[num_tokens:] = -1
        pos[num_tokens:] = 0
        slots[:, num_tokens:] = PAD_SLOT_ID
        mask, key = 0, NO_ERROR_KEY
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            mask, key = ERR_NEGATIVE_LENGTH, error_key(min(int(start[first]), INT32_MAX), first, 0, ERR_NEGATIVE_LENGTH)
        if total > C:
            owner = int(np.flatnonzero((start <= C) & (end > C))[0])
            mask, key = mask | ERR_CAPACITY, min(key, error_key(C, owner, 0, ERR_CAPACITY))
        self._errors = (mask, key)
        out = StepOutputs(cu, np.array(num_tokens, dtype=np.int32), batch, pos, kv, slots)
        self.launches_per_step = 1
        if self.attention:
            out.attention = engine_attention_metadata(
                cu, kv, tables, self.block_sizes, self.attention, self.kv_indices_capacity
            )
            self.launches_per_step += engine_launches(self.attention, G)
        return out

    def errors(self) -> tuple[int, int]:
        """The last step's ``(error_mask, first_bad_key)``: bits 4 and 8 only."""
        return self._errors

    def check(self, stream=None):
        mask, key = self._errors
        if mask:
            raise AddressingError(mask, key)


class Fused(_CpuStrategy):
    name = "fused"

    def step(self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None):
        if np.shape(seq_lens_decoder)[0] > self.max_requests:
            raise ValueError(
                f"seq_lens_decoder must have at most max_requests = {self.max_requests} entries, "
                f"got {np.shape(seq_lens_decoder)[0]}"
            )
        self._last = step_addressing(
            seq_lens_decoder,
            seq_lens_this_time,
            block_tables,
            list(self.block_sizes),
            self.capacity,
            seq_lens_encoder=seq_lens_encoder,
            position_dtype=self.position_dtype,
            attention=self.attention or None,
            kv_indices_capacity=self.kv_indices_capacity,
        )
        self.launches_per_step = 1
        return self._last.outputs

    def check(self, stream=None):
        self._last.check()


_CLASSES = {
    "per-layer": PerLayer,
    "per-layer-kernel": PerLayerKernel,
    "hoisted": Hoisted,
    "one-block": OneBlock,
    "fused": Fused,
}


def make_strategy(
    name: str,
    *,
    max_requests: int,
    capacity: int,
    block_sizes: int | Sequence[int],
    num_layers: int = 1,
    position_dtype: DTypeLike = np.int64,
    device: int | None = None,
    attention: str | Sequence[str] | None = None,
    kv_indices_capacity: int | None = None,
) -> Any:
    """Build a CPU strategy by name (one of :data:`STRATEGY_NAMES`).

    ``attention`` and ``kv_indices_capacity``: the attention metadata to add to
    every step (docs/attention.md); off by default.
    """
    return _CLASSES[check_name(name)](
        max_requests=max_requests,
        capacity=capacity,
        block_sizes=block_sizes,
        num_layers=num_layers,
        position_dtype=position_dtype,
        attention=attention,
        kv_indices_capacity=kv_indices_capacity,
    )
