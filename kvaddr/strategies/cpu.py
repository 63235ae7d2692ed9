"""The four strategies on the CPU, in NumPy: the profiler's path without a GPU.

Same construction and ``step()`` as :mod:`kvaddr.strategies.gpu`, on NumPy arrays.
The fused strategy is the reference itself; the others run the position
computation once and then NumPy versions of the per-layer work, so the CPU
profile shows what repeating that work per layer costs on a host.
"""

from __future__ import annotations

import numpy as np

from kvaddr.outputs import PAD_SLOT_ID, StepOutputs
from kvaddr.reference import step_addressing
from kvaddr.strategies.names import CHAIN_OPS, STRATEGY_NAMES, check_name
from kvaddr.validation import INT32_MAX, MAX_REQUESTS, check_block_sizes, check_host_array, check_int, normalize_tables

__all__ = ["STRATEGY_NAMES", "make_strategy"]


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
    ):
        self.max_requests = check_int("max_requests", max_requests, lo=1, hi=MAX_REQUESTS - 1)
        self.capacity = check_int("capacity", capacity, lo=1, hi=INT32_MAX - 1)
        self.block_sizes = check_block_sizes(block_sizes, max_caches=4)
        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.position_dtype = position_dtype
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
        return StepOutputs(o.cu_seqlens_q, o.num_tokens, o.batch_id_per_token, o.position_ids, o.seq_lens_kv, slots)

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
        )
        self.launches_per_step = 1
        return self._last.outputs

    def check(self, stream=None):
        self._last.check()


_CLASSES = {"per-layer": PerLayer, "per-layer-kernel": PerLayerKernel, "hoisted": Hoisted, "fused": Fused}


def make_strategy(
    name: str,
    *,
    max_requests: int,
    capacity: int,
    block_sizes,
    num_layers: int = 1,
    position_dtype=np.int64,
    device=None,
):
    """Build a CPU strategy by name (one of :data:`STRATEGY_NAMES`)."""
    return _CLASSES[check_name(name)](
        max_requests=max_requests,
        capacity=capacity,
        block_sizes=block_sizes,
        num_layers=num_layers,
        position_dtype=position_dtype,
    )
