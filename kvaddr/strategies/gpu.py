"""The step-addressing strategies of the spec, on the GPU (CuPy).

Each is built with the planner's sizes plus the model's layer count and has the
same ``step()``; all return identical :class:`~kvaddr.outputs.StepOutputs`.

================  ======================================================  ==================
strategy          what one decode step runs (L layers, G caches)          launches per step
================  ======================================================  ==================
per-layer         position kernel, then per layer and cache the op chain  1 + 9 L G
per-layer-kernel  position kernel, then one slot kernel per layer, cache  1 + L G
hoisted           position kernel, one op chain per distinct (table, B)   1 + 9 D (+ copies)
one-block         one block, a thread per request: serial prefix, tokens  1 (bsz <= 1024)
fused             one launch for every output (:class:`StepPlanner`)      1
================  ======================================================  ==================

The op chain is FastDeploy's framework ops before PR #7367 (``pos // B``, gather
from the table, ``pos % B``, multiply, add, cast to int64), written with CuPy
ufuncs into preallocated buffers (``out=``), so no baseline pays for allocation,
plus what makes it safe for any input: the gather's flat index is built and
clipped to the table, and a final ``where`` gives padding and bad tokens -1
(kvaddr_where_pad): 9 launches a call (:data:`~kvaddr.strategies.names.CHAIN_OPS`).
The position kernel is kvaddr's fused kernel with no caches (it scales past 1024
requests, unlike FastDeploy's one-block kernel). ``one-block`` is that kernel
(``kvaddr_one_block_i64`` / ``_i32``: ``<<<1, bsz>>>``, thread b adds up the
earlier requests' lengths serially, then loops over its tokens), written from
FastDeploy's description plus the padding and bad-value handling the spec asks
for; a step of more than 1024 requests raises
:class:`~kvaddr.errors.StrategyLimitExceeded`. Only the fused strategy records
error bits 1 and 2; the others record bits 4 and 8 (through their position
kernel; one-block in its own kernel).

With ``attention=...`` (docs/attention.md) the fused strategy's one launch also
writes the attention metadata; the baselines build it the way engines do today,
once per step in separate launches (:class:`EngineAttention`: per cache the page
counts, a cumsum, a per-request copy of row prefixes, the -1 tail and the last
page lengths; for varlen a cumsum and two max reductions), so the saving the
profiler reports includes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from kvaddr import kernel_loader
from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.device import require_cuda
from kvaddr.errors import NO_ERROR_KEY, AddressingError
from kvaddr.outputs import PAD_PAGE_ID, AttentionOutputs, StepOutputs
from kvaddr.planner import StepPlanner
from kvaddr.strategies.names import CHAIN_OPS, STRATEGY_NAMES, check_bsz, check_name
from kvaddr.validation import (
    check_block_sizes,
    check_info,
    check_int,
    cupy_stream,
    describe,
    normalize_tables,
    stream_handle,
)

__all__ = [
    "STRATEGY_NAMES",
    "EngineAttention",
    "Fused",
    "Hoisted",
    "OneBlock",
    "PerLayer",
    "PerLayerKernel",
    "make_strategy",
]

_i64 = np.int64
_i32 = np.int32
_u64 = np.uint64

#: Launches of :class:`EngineAttention` per step: per cache for "flashinfer"
#: (pages, cumsum, copy_pages, pad_pages, last_page), once for "varlen" (cumsum, 2 x max).
ENGINE_LAUNCHES = {"flashinfer": 5, "varlen": 3, "page_table": 0}


class EngineAttention:
    """Attention metadata (docs/attention.md) built the way engines build it today.

    Separate launches once per step, into buffers allocated here (nothing allocated
    or synchronised per call, so a step captures into a CUDA graph): per cache
    ``kvaddr_engine_pages``, ``kvaddr_engine_cumsum`` (kv_indptr),
    ``kvaddr_engine_copy_pages`` (one block per request copies its row prefix into
    kv_indices; what vLLM's FlashInfer backend does), ``kvaddr_engine_pad_pages``
    (-1 past kv_indptr[bsz]) and ``kvaddr_engine_last_page``; for varlen
    ``kvaddr_engine_cumsum`` (cu_seqlens_k) and two ``kvaddr_engine_max``. No checks:
    equal to the fused outputs on valid inputs (a row too short for its pages gives
    -1 entries, a negative block id is copied as it is).

    Parameters
    ----------
    groups : tuple of str
        Normalised attention groups (:func:`kvaddr.attention_reference.normalize_attention`).
    kv_indices_capacity : int or None
        N (required with "flashinfer").
    max_requests : int
    block_sizes : tuple of int
    device : int
    """

    def __init__(self, groups, kv_indices_capacity, max_requests: int, block_sizes, device: int):
        import cupy

        self.groups = tuple(groups)
        self.N = kv_indices_capacity
        self.block_sizes = tuple(block_sizes)
        G = len(self.block_sizes)
        self.launches = ENGINE_LAUNCHES["flashinfer"] * G * ("flashinfer" in groups) + ENGINE_LAUNCHES["varlen"] * (
            "varlen" in groups
        )
        fn = lambda name: kernel_loader.get_function(name, device)  # noqa: E731
        self._fn = {k: fn(f"kvaddr_engine_{k}") for k in ("pages", "cumsum", "copy_pages", "pad_pages", "last_page")}
        self._fn["max"] = fn("kvaddr_engine_max")
        self._threads = kernel_loader.constants()["KV_THREADS"]
        R = max_requests
        with cupy.cuda.Device(device):
            if "flashinfer" in groups:
                self.pages = cupy.zeros((G, R), dtype=np.int32)
                self.kv_indptr = cupy.zeros((G, R + 1), dtype=np.int32)
                self.kv_indices = cupy.full((G, self.N), PAD_PAGE_ID, dtype=np.int32)
                self.kv_last_page_len = cupy.zeros((G, R), dtype=np.int32)
            if "varlen" in groups:
                self.cu_seqlens_k = cupy.zeros(R + 1, dtype=np.int32)
                self.max_seqlen = cupy.zeros(2, dtype=np.int32)
            cupy.cuda.get_current_stream().synchronize()  # see StepPlanner.__init__
        self._views: dict = {}

    def _launch(self, name, grid, args, handle):
        self._fn[name]((max(int(grid), 1),), (self._threads,), args, 0, kernel_loader.raw_stream(handle))

    def build(self, pos, tables, infos, handle) -> AttentionOutputs:
        """Launch the metadata ops for a step whose positions kernel wrote ``pos``."""
        bsz = pos.seq_lens_kv.shape[0]
        T = self._threads
        L = pos.seq_lens_kv  # [bsz], int32
        nb = -(-bsz // T)
        if "flashinfer" in self.groups:
            N = self.N
            for g, (info, B) in enumerate(zip(infos, self.block_sizes)):
                pages, indptr = self.pages[g], self.kv_indptr[g]
                out, last = self.kv_indices[g], self.kv_last_page_len[g]
                if bsz:
                    self._launch("pages", nb, (L, _i32(bsz), _i32(B), pages), handle)
                self._launch("cumsum", 1, (pages, _i32(bsz), indptr), handle)
                if bsz:
                    self._launch(
                        "copy_pages",
                        bsz,
                        (indptr, _u64(info.ptr), _i64(info.strides[0]), _i32(info.shape[1]), _i32(N), out),
                        handle,
                    )
                self._launch("pad_pages", -(-N // T), (indptr, _i32(bsz), _i32(N), out), handle)
                if bsz:
                    self._launch("last_page", nb, (L, _i32(bsz), _i32(B), last), handle)
        if "varlen" in self.groups:
            self._launch("cumsum", 1, (L, _i32(bsz), self.cu_seqlens_k), handle)
            self._launch("max", 1, (pos.cu_seqlens_q, _i32(bsz), _i32(1), self.max_seqlen[0:1]), handle)
            self._launch("max", 1, (L, _i32(bsz), _i32(0), self.max_seqlen[1:2]), handle)
        a = self._views.get(bsz)
        if a is None:
            a = self._views[bsz] = AttentionOutputs()
            if "flashinfer" in self.groups:
                a.qo_indptr = pos.cu_seqlens_q
                a.kv_indptr = self.kv_indptr[:, : bsz + 1]
                a.kv_indices = self.kv_indices
                a.kv_last_page_len = self.kv_last_page_len[:, :bsz]
            if "varlen" in self.groups:
                a.cu_seqlens_k = self.cu_seqlens_k[: bsz + 1]
                a.seqused_k = pos.seq_lens_kv
                a.max_seqlen_q = self.max_seqlen[0]
                a.max_seqlen_k = self.max_seqlen[1]
        if "page_table" in self.groups:
            a.page_table = tuple(t[:bsz] for t in tables)
        return a


class Fused:
    """kvaddr: one launch writes every output of the step for all caches."""

    name = "fused"

    def __init__(
        self,
        *,
        max_requests: int,
        capacity: int,
        block_sizes,
        num_layers: int = 1,
        position_dtype=np.int64,
        device: int | None = None,
        attention=None,
        kv_indices_capacity: int | None = None,
    ):
        require_cuda(device)
        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.planner = StepPlanner(
            max_requests,
            capacity,
            block_sizes,
            position_dtype=position_dtype,
            device=device,
            attention=attention,
            kv_indices_capacity=kv_indices_capacity,
        )
        self.attention = self.planner.attention
        self.launches_per_step = 1

    def step(
        self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None
    ) -> StepOutputs:
        """The whole step's addressing (all layers share it)."""
        return self.planner.compute(
            seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder=seq_lens_encoder, stream=stream
        )

    def check(self, stream=None) -> None:
        self.planner.check(stream)


class OneBlock:
    """FastDeploy's one-block step (after PR #7367): one launch of one block, a thread per request.

    Thread b adds up ``seq_lens_this_time[0..b)`` serially (its ``cu_seqlens_q``
    start), then loops over its own tokens writing batch id, position and every
    cache's slot; after one barrier the block writes the padding tokens. Outputs
    equal the reference's for every input; error bits 4 and 8 are recorded (not
    1 and 2, like the other baselines). At most 1024 requests per step (one block
    of 1024 threads); :meth:`step` raises :class:`~kvaddr.errors.StrategyLimitExceeded`
    beyond that. The output buffers, their views and the input checks are a
    :class:`StepPlanner`'s (never launched).
    """

    name = "one-block"

    def __init__(
        self,
        *,
        max_requests: int,
        capacity: int,
        block_sizes,
        num_layers: int = 1,
        position_dtype=np.int64,
        device: int | None = None,
        attention=None,
        kv_indices_capacity: int | None = None,
    ):
        require_cuda(device)
        import cupy

        self.num_layers = check_int("num_layers", num_layers, lo=1)
        pl = self._buffers = StepPlanner(
            max_requests, capacity, block_sizes, position_dtype=position_dtype, device=device
        )
        self.device, self.capacity, self.num_caches = pl.device, pl.capacity, pl.num_caches
        self.attention = normalize_attention(attention)
        self.kv_indices_capacity = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        self._engine = None
        if self.attention:  # built after the one launch, the way engines build it today
            self._engine = EngineAttention(
                self.attention, self.kv_indices_capacity, pl.max_requests, pl.block_sizes, pl.device
            )
        self.position_dtype = pl.position_dtype
        # The output buffers (what step() returns views of): [max_requests + 1], [], [C], [C], [max_requests],
        # [num_caches, C]; int32 but position_ids (position_dtype) and slot_mapping (int64).
        self.cu_seqlens_q, self.num_tokens = pl.cu_seqlens_q, pl.num_tokens
        self.batch_id_per_token, self.position_ids = pl.batch_id_per_token, pl.position_ids
        self.seq_lens_kv, self.slot_mapping = pl.seq_lens_kv, pl.slot_mapping
        with cupy.cuda.Device(self.device):
            self._record = cupy.asarray(np.array([0, NO_ERROR_KEY], dtype=np.uint64))  # [2], uint64
            cupy.cuda.get_current_stream().synchronize()  # see StepPlanner.__init__
        fn = kernel_loader.get_function(
            "kvaddr_one_block_i64" if self.position_dtype == np.int64 else "kvaddr_one_block_i32", self.device
        )
        P = self._params = kernel_loader.OneBlockParams()
        P.capacity = self.capacity  # int32
        P.num_caches = self.num_caches  # int32
        for g in range(kernel_loader.MAX_CACHES):
            P.max_blocks[g] = 1  # int32: an unused cache's width (set per call for used ones)
            P.block_size[g] = pl.block_sizes[g] if g < self.num_caches else 1  # int32
        P.cu_seqlens_q = pl.cu_seqlens_q.data.ptr  # [max_requests + 1], int32
        P.num_tokens = pl.num_tokens.data.ptr  # [], int32
        P.batch_id_per_token = pl.batch_id_per_token.data.ptr  # [C], int32
        P.position_ids = pl.position_ids.data.ptr  # [C], int64 / int32 (position_dtype)
        P.seq_lens_kv = pl.seq_lens_kv.data.ptr  # [max_requests], int32
        P.slot_mapping = pl.slot_mapping.data.ptr  # [num_caches, C], int64
        P.error_record = self._record.data.ptr  # [2], uint64
        self._launcher = kernel_loader.Launcher(fn, P, by_value=True)
        self.launches_per_step = 1 + (0 if self._engine is None else self._engine.launches)

    def step(
        self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None
    ) -> StepOutputs:
        """The whole step's addressing in one launch of ``max(bsz, 1)`` threads (bsz <= 1024)."""
        pl, P = self._buffers, self._params
        bsz = check_bsz(self.name, pl._prepare(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder))
        S = pl._params  # the inputs, checked and resolved by the planner
        P.seq_lens_decoder = S.seq_lens_decoder  # [bsz], int32
        P.seq_lens_this_time = S.seq_lens_this_time  # [bsz], int32
        P.bsz = bsz  # int32
        for g in range(self.num_caches):
            P.block_tables[g] = S.block_tables[g]  # [rows >= bsz, max_blocks], int32
            P.table_stride[g] = S.table_stride[g]  # int64, elements
            P.max_blocks[g] = S.max_blocks[g]  # int32
        handle = stream_handle(stream)
        self._launcher(1, max(bsz, 1), handle)
        out = pl._outputs(bsz)
        if self._engine is not None:
            tables = normalize_tables(block_tables, self.num_caches)
            infos = [describe("block_tables", x) for x in tables]
            out.attention = self._engine.build(out, tables, infos, handle)
        return out

    def errors(self, stream=None) -> tuple[int, int]:
        """Synchronise and return the last step's ``(error_mask, first_bad_key)`` (bits 4 and 8 only)."""
        import cupy

        handle = stream_handle(stream)
        rec = np.empty(2, dtype=np.uint64)
        with cupy.cuda.Device(self.device):
            s = cupy_stream(handle)
            self._record.get(stream=s, out=rec)
            s.synchronize()
        return int(rec[0]), int(rec[1])

    def check(self, stream=None) -> None:
        """Error bits 4 and 8 (see the module docstring): raise AddressingError if the last step had any."""
        mask, key = self.errors(stream)
        if mask:
            raise AddressingError(mask, key)


class _PositionsThenSlots:
    """Position kernel once per step, then slot mappings computed by a subclass."""

    name = ""

    def __init__(
        self,
        *,
        max_requests: int,
        capacity: int,
        block_sizes,
        num_layers: int = 1,
        position_dtype=np.int64,
        device: int | None = None,
        attention=None,
        kv_indices_capacity: int | None = None,
    ):
        require_cuda(device)
        import cupy

        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.positions = StepPlanner(max_requests, capacity, [], position_dtype=position_dtype, device=device)
        self.block_sizes = check_block_sizes(block_sizes, max_caches=kernel_loader.constants()["KV_MAX_CACHES"])
        self.attention = normalize_attention(attention)
        self.kv_indices_capacity = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        self._engine = None
        if self.attention:
            self._engine = EngineAttention(
                self.attention,
                self.kv_indices_capacity,
                self.positions.max_requests,
                self.block_sizes,
                self.positions.device,
            )
        self.num_caches = len(self.block_sizes)
        self.capacity = self.positions.capacity
        self.device = self.positions.device
        C, G = self.capacity, self.num_caches
        self._grid = -(-C // kernel_loader.constants()["KV_THREADS"])
        with cupy.cuda.Device(self.device):
            self.slot_mapping = cupy.full((G, C), -1, dtype=np.int64)
            cupy.cuda.get_current_stream().synchronize()  # see StepPlanner.__init__
        self.launches_per_step = None  # known after the first step
        self._views: dict = {}

    @property
    def _engine_launches(self) -> int:
        return 0 if self._engine is None else self._engine.launches

    def _tables(self, block_tables, bsz: int) -> list:
        tables = normalize_tables(block_tables, self.num_caches)
        many = self.num_caches > 1 and tables[0] is not tables[1]
        infos, seen = [], {}
        for g, t in enumerate(tables):
            info = seen.get(id(t))
            if info is None:
                info = seen[id(t)] = check_info(
                    f"block_tables[{g}]" if many else "block_tables",
                    describe("block_tables", t),
                    ndim=2,
                    min_rows=bsz,
                    device=self.device,
                )
            infos.append(info)
        return infos

    def step(
        self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None
    ) -> StepOutputs:
        """Position kernel, then the strategy's slot mappings for every layer."""
        handle = stream_handle(stream)
        pos = self.positions.compute(
            seq_lens_decoder, seq_lens_this_time, None, seq_lens_encoder=seq_lens_encoder, stream=handle
        )
        bsz = pos.seq_lens_kv.shape[0]
        infos = self._tables(block_tables, bsz)
        slots = self._slots(pos, infos, handle)
        key = (bsz, id(slots))
        out = self._views.get(key)
        if out is None:
            out = self._views[key] = StepOutputs(
                pos.cu_seqlens_q, pos.num_tokens, pos.batch_id_per_token, pos.position_ids, pos.seq_lens_kv, slots
            )
        if self._engine is not None:  # once per step, after the layers' slot mappings
            tables = normalize_tables(block_tables, self.num_caches)
            out.attention = self._engine.build(pos, tables, infos, handle)
        return out

    def check(self, stream=None) -> None:
        """Error bits 4 and 8 (the position kernel's); see the module docstring."""
        self.positions.check(stream)


class PerLayerKernel(_PositionsThenSlots):
    """Position kernel, then one slot-mapping kernel per layer per cache."""

    name = "per-layer-kernel"

    def __init__(self, **kw):
        super().__init__(**kw)
        p = self.positions
        fn = kernel_loader.get_function(
            "kvaddr_slots_i64" if p.position_dtype == np.int64 else "kvaddr_slots_i32", self.device
        )
        self._launchers = []
        for g in range(self.num_caches):
            args = kernel_loader.SlotsArgs(
                position_ids=p.position_ids.data.ptr,  # [C], int64 / int32
                batch_id_per_token=p.batch_id_per_token.data.ptr,  # [C], int32
                block_size=self.block_sizes[g],  # int32
                capacity=self.capacity,  # int32
                slot_mapping=self.slot_mapping[g].data.ptr,  # [C], int64 (row g of [num_caches, C])
            )  # block_table, row_stride, max_blocks: per call (_slots)
            self._launchers.append(kernel_loader.Launcher(fn, args))
        self.launches_per_step = 1 + self.num_layers * self.num_caches + self._engine_launches

    def _slots(self, pos, infos, handle):
        for L, info in zip(self._launchers, infos):
            a = L.args
            a.block_table = info.ptr  # [rows >= bsz, max_blocks], int32
            a.row_stride = info.strides[0]  # int64, elements
            a.max_blocks = info.shape[1]  # int32
        grid, block = self._grid, kernel_loader.constants()["KV_THREADS"]
        for _ in range(self.num_layers):
            for L in self._launchers:
                L(grid, block, handle)
        return self.slot_mapping


class _ChainScratch:
    """Preallocated buffers of one op chain (so the chain allocates nothing)."""

    def __init__(self, cupy, C):
        self.idx = cupy.empty(C, dtype=np.int64)
        self.flat = cupy.empty(C, dtype=np.int64)
        self.off = cupy.empty(C, dtype=np.int64)
        self.blk = cupy.empty(C, dtype=np.int32)


def _flat_table(cupy, info):
    """A 1-D CuPy view of every element a (possibly row-strided) table spans."""
    rows, width = info.shape
    n = (rows - 1) * info.strides[0] + width if rows else 0
    if n == 0:
        return None, 0
    mem = cupy.cuda.UnownedMemory(info.ptr, n * 4, info.obj)
    return cupy.ndarray((n,), dtype=np.int32, memptr=cupy.cuda.MemoryPointer(mem, 0)), n


class _OpChain(_PositionsThenSlots):
    def __init__(self, **kw):
        import cupy

        super().__init__(**kw)
        self._cupy = cupy
        with cupy.cuda.Device(self.device):
            self._scratch = [_ChainScratch(cupy, self.capacity) for _ in range(self.num_caches)]
            cupy.cuda.get_current_stream().synchronize()  # see StepPlanner.__init__
        where = kernel_loader.get_function("kvaddr_where_pad", self.device)
        self._where = []
        for sc in self._scratch:
            args = kernel_loader.WhereArgs(
                batch_id_per_token=self.positions.batch_id_per_token.data.ptr,  # [C], int32
                block_index=sc.idx.data.ptr,  # [C], int64
                block_id=sc.blk.data.ptr,  # [C], int32
                capacity=self.capacity,  # int32
            )  # max_blocks, slot_mapping: per call (_chain)
            self._where.append(kernel_loader.Launcher(where, args))
        self._flat_cache: dict = {}

    def _flat(self, info):
        key = (info.ptr, info.shape, info.strides)
        hit = self._flat_cache.get(key)
        if hit is None or hit[2] is not info.obj:
            flat, n = _flat_table(self._cupy, info)
            hit = self._flat_cache[key] = (flat, n, info.obj)
            if len(self._flat_cache) > 64:
                self._flat_cache.pop(next(iter(self._flat_cache)))
        return hit[0], hit[1]

    def _chain(self, pos, info, B, scratch, out, handle):
        """The per-layer framework-op chain for one cache: 9 launches."""
        cp = self._cupy
        s = scratch
        table, n = self._flat(info)
        if n == 0:  # an empty table: every token is padding
            out.fill(-1)
            return
        B64 = _i64(B)
        cp.floor_divide(pos.position_ids, B64, out=s.idx)  # pos // B
        cp.multiply(pos.batch_id_per_token, _i64(info.strides[0]), out=s.flat)  # row start
        cp.add(s.flat, s.idx, out=s.flat)  # + block index
        cp.clip(s.flat, 0, n - 1, out=s.flat)  # stay inside the table
        cp.take(table, s.flat, out=s.blk)  # gather
        cp.remainder(pos.position_ids, B64, out=s.off)  # pos % B
        cp.multiply(s.blk, B64, out=out)  # block * B, as int64
        cp.add(out, s.off, out=out)  # + pos % B
        where = self._where[self._scratch.index(s)]  # padding / bad -> -1
        where.args.max_blocks = info.shape[1]  # int32
        where.args.slot_mapping = out.data.ptr  # [C], int64
        where(self._grid, kernel_loader.constants()["KV_THREADS"], handle)


class PerLayer(_OpChain):
    """Position kernel, then per layer and cache FastDeploy's framework-op chain."""

    name = "per-layer"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.launches_per_step = 1 + self.num_layers * self.num_caches * len(CHAIN_OPS) + self._engine_launches

    def _slots(self, pos, infos, handle):
        with cupy_stream(handle):
            for _ in range(self.num_layers):
                for g, (info, B) in enumerate(zip(infos, self.block_sizes)):
                    self._chain(pos, info, B, self._scratch[g], self.slot_mapping[g], handle)
        return self.slot_mapping


class Hoisted(_OpChain):
    """FastDeploy PR #7367: position kernel and one op chain per distinct (table, B)."""

    name = "hoisted"
    _shared_view = None

    def _slots(self, pos, infos, handle):
        cp = self._cupy
        groups: dict = {}
        for g, (info, B) in enumerate(zip(infos, self.block_sizes)):
            groups.setdefault((info.ptr, info.shape, info.strides, B), []).append(g)
        launches = 1 + len(groups) * len(CHAIN_OPS)
        with cupy_stream(handle):
            for members in groups.values():
                g0 = members[0]
                self._chain(pos, infos[g0], self.block_sizes[g0], self._scratch[g0], self.slot_mapping[g0], handle)
            if len(groups) == 1 and self.num_caches > 1:
                # Every cache shares one (table, B): a stride-0 view, no copy.
                out = self._shared_view
                if out is None:
                    out = self._shared_view = cp.lib.stride_tricks.as_strided(
                        self.slot_mapping[0], shape=self.slot_mapping.shape, strides=(0, 8)
                    )
            else:
                for members in groups.values():
                    for g in members[1:]:
                        self.slot_mapping[g] = self.slot_mapping[members[0]]
                        launches += 1
                out = self.slot_mapping
        self.launches_per_step = launches + self._engine_launches
        return out


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
    """Build a strategy by name (one of :data:`STRATEGY_NAMES`).

    ``attention`` and ``kv_indices_capacity``: the attention metadata to add to
    every step (docs/attention.md; ``StepOutputs.attention``); off by default.
    """
    return _CLASSES[check_name(name)](
        max_requests=max_requests,
        capacity=capacity,
        block_sizes=block_sizes,
        num_layers=num_layers,
        position_dtype=position_dtype,
        device=device,
        attention=attention,
        kv_indices_capacity=kv_indices_capacity,
    )
