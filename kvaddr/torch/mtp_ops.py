"""``torch.ops.kvaddr.draft_steps``: every MTP substep's addressing (docs/spec-decode.md) as a PyTorch op.

``draft_steps(seq_lens_decoder, accept_num, block_tables, block_sizes, cu_seqlens_q, num_tokens,
batch_id_per_token, position_ids, seq_lens_kv, slot_mapping, error_records) -> ()`` writes the k
substeps of an MTP draft model (substep 0 over ``accept_num`` tokens, substeps 1..k-1 one token
per request with ``accept_num > 0``, ``seq_lens_decoder`` advanced) in ONE launch of
``mtp_step`` (kvaddr/kernels/mtp.cuh) into the caller's tensors, each with a leading ``[k]``:

=====================  ==============================  =====================================
argument               dtype, shape                    meaning
=====================  ==============================  =====================================
seq_lens_decoder       int32 [bsz], contiguous         tokens in the draft model's cache
accept_num             int32 [bsz], contiguous         tokens each request accepted
block_tables           list of int32 [>= bsz, W_g]     one table per cache, or one for all
block_sizes            int[] (0 to 4 entries)          B of each cache
cu_seqlens_q (a!)      int32 [k, M + 1]                rows: substeps; first bsz + 1 written
num_tokens (b!)        int32 [k]                       written
batch_id_per_token     int32 [k, C]                    all written
position_ids (d!)      int64 or int32 [k, C]           all written; the dtype picks the kernel
seq_lens_kv (e!)       int32 [k, M]                    first bsz of each row written
slot_mapping (f!)      int64 [k, len(block_sizes), C]  all written
error_records (g!)     int64 [draft_records(k, C), 2]  sticky (mask, key) records
=====================  ==============================  =====================================

It mutates its output arguments and returns nothing, so ``torch.compile`` (fullgraph) and
``opcheck`` see every write; :class:`DraftStepBuffers` allocates them and :func:`draft_steps`
returns their views. CUDA: the kernel on torch's current stream; CPU: the NumPy reference
(``kvaddr.spec_reference``); fake: the checks. Attention metadata is the planner's
(``StepPlanner(draft_steps=k, attention=...)``); this op writes the addressing.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from kvaddr import dispatch, kernel_loader
from kvaddr.constants import INT32_MAX, MAX_CACHES
from kvaddr.errors import NO_ERROR_KEY, AddressingError, reduce_error_records
from kvaddr.mtp import DraftOutputs
from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_substep_lengths
from kvaddr.torch.tensors import raw_stream as _raw_stream

__all__ = ["DraftStepBuffers", "draft_errors", "draft_records", "draft_steps"]

SCHEMA = (
    "draft_steps(Tensor seq_lens_decoder, Tensor accept_num, Tensor[] block_tables, int[] block_sizes, "
    "Tensor(a!) cu_seqlens_q, Tensor(b!) num_tokens, Tensor(c!) batch_id_per_token, Tensor(d!) position_ids, "
    "Tensor(e!) seq_lens_kv, Tensor(f!) slot_mapping, Tensor(g!) error_records) -> ()"
)
_THREADS, _WARPS = dispatch.THREADS, dispatch.WARPS
_NO_ERROR_I64 = NO_ERROR_KEY - (1 << 64)
#: Argument sets the CUDA kernel remembers before it forgets them all.
CACHE_SIZE = 256


def _int32_vector(name: str, t) -> None:
    what = "int32 with shape (bsz,), contiguous"
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be {what}, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got a strided view (stride {t.stride(0)} elements)")


def _merge_record(rec: torch.Tensor, mask: int, key: int) -> None:
    """Merge ``(mask, key)`` into record 0 of ``rec`` (int64 words, flat) as a kernel's warp does."""
    if not mask:
        return
    old_mask, old_key = (int(v) & ((1 << 64) - 1) for v in rec[:2].tolist())
    key = min(int(key), old_key)
    rec[0] = old_mask | int(mask)
    rec[1] = key - (1 << 64) if key >= 1 << 63 else key


def draft_records(draft_steps: int, capacity: int) -> int:
    """Rows of ``error_records`` for k substeps of capacity C: one per warp of the launch."""
    return int(draft_steps) * -(-int(capacity) // _THREADS) * _WARPS


def _check(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec) -> tuple:
    """Every argument's dtype, shape, layout and device; returns ``(bsz, k, C, M, tables)``."""
    G = len(block_sizes)
    if G > MAX_CACHES:
        raise ValueError(f"block_sizes must hold at most {MAX_CACHES} caches, got {G}")
    for g, b in enumerate(block_sizes):
        if not 1 <= b <= INT32_MAX:
            raise ValueError(f"block_sizes[{g}] must be an int in [1, {INT32_MAX}], got {b}")
    _int32_vector("seq_lens_decoder", dec)
    _int32_vector("accept_num", acc)
    bsz = dec.shape[0]
    if acc.shape[0] != bsz:
        raise ValueError(f"accept_num must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got {tuple(acc.shape)}")
    if G == 0:
        tables = []
    elif len(tables) == 1:
        tables = [tables[0]] * G
    elif len(tables) != G:
        raise ValueError(f"block_tables must be one table or {G} (one per cache), got {len(tables)} tables")
    what = "int32 with shape (rows >= bsz, max_blocks) with a contiguous last dim"
    for g, t in enumerate(tables):
        name = f"block_tables[{g}]" if G > 1 and tables[0] is not tables[1] else "block_tables"
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be {what}, got dtype {t.dtype}")
        if t.dim() != 2 or t.shape[1] < 1 or t.shape[1] > INT32_MAX:
            raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
        if t.shape[1] > 1 and t.shape[0] > 0 and t.stride(1) != 1:
            raise ValueError(f"{name} must be {what}, got a last-dim stride of {t.stride(1)} elements")
        if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
            raise ValueError(f"{name} must be {what}, got overlapping rows (row stride {t.stride(0)})")
        if t.shape[0] < bsz:
            raise ValueError(f"{name} must be {what}, got {t.shape[0]} rows for bsz = {bsz}")
    if batch.dtype != torch.int32 or batch.dim() != 2 or not batch.is_contiguous():
        raise TypeError(f"batch_id_per_token must be contiguous int32 [k, C], got {batch.dtype} {tuple(batch.shape)}")
    k, C = batch.shape
    if not 1 <= k <= 1024 or not 1 <= C <= INT32_MAX - 1:
        raise ValueError(f"batch_id_per_token must have shape (k in [1, 1024], C >= 1), got {tuple(batch.shape)}")
    if kv.dtype != torch.int32 or kv.dim() != 2 or kv.shape[0] != k or not kv.is_contiguous():
        raise ValueError(f"seq_lens_kv must be contiguous int32 [k = {k}, max_requests], got {tuple(kv.shape)}")
    M = kv.shape[1]
    if not bsz <= M < (1 << 27):
        raise ValueError(f"seq_lens_kv must have max_requests >= bsz = {bsz} columns (and < 2**27), got {M}")
    for name, t, dt, shape in (
        ("cu_seqlens_q", cu, torch.int32, (k, M + 1)),
        ("num_tokens", nt, torch.int32, (k,)),
        ("slot_mapping", slots, torch.int64, (k, G, C)),
        ("error_records", rec, torch.int64, (draft_records(k, C), 2)),
    ):
        if t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous {dt} with shape {shape}, got {t.dtype} with shape {tuple(t.shape)}"
            )
    if pos.dtype not in (torch.int64, torch.int32) or tuple(pos.shape) != (k, C) or not pos.is_contiguous():
        raise ValueError(
            f"position_ids must be contiguous int64 or int32 with shape ({k}, {C}), got {tuple(pos.shape)}"
        )
    dev = dec.device
    named = [("accept_num", acc), *((f"block_tables[{g}]", t) for g, t in enumerate(tables))]
    named += [("cu_seqlens_q", cu), ("num_tokens", nt), ("batch_id_per_token", batch), ("position_ids", pos)]
    named += [("seq_lens_kv", kv), ("slot_mapping", slots), ("error_records", rec)]
    for name, t in named:
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev} like seq_lens_decoder, got {t.device}")
    return bsz, k, C, M, tables


def _fake(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec) -> None:
    _check(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec)


def _cpu(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec) -> None:
    """The NumPy reference, substep by substep; the errors merged into record 0."""
    bsz, k, C, _, tables = _check(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec)
    d, a = dec.numpy(), acc.numpy()
    tabs = [t.numpy() for t in tables]
    pdt = np.int64 if pos.dtype == torch.int64 else np.int32
    flat = rec.view(-1)
    for j in range(k):
        dj, qj = mtp_substep_lengths(d, a, j)
        res = step_addressing(dj, qj, tabs, list(block_sizes), C, position_dtype=pdt)
        o = res.outputs
        cu[j, : bsz + 1].copy_(torch.from_numpy(o.cu_seqlens_q))
        nt[j] = int(o.num_tokens)
        batch[j].copy_(torch.from_numpy(o.batch_id_per_token))
        pos[j].copy_(torch.from_numpy(o.position_ids))
        kv[j, :bsz].copy_(torch.from_numpy(o.seq_lens_kv))
        slots[j].copy_(torch.from_numpy(o.slot_mapping))
        _merge_record(flat, res.error_mask, res.error_key)


_lock = threading.Lock()
_cache: dict = {}


def _bind(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec):
    """Check once; the (launcher, grid, k, params) of this argument set."""
    bsz, k, C, M, tables = _check(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec)
    G = len(block_sizes)
    P = kernel_loader.MtpParams()
    s = P.step
    s.seq_lens_decoder = dec.data_ptr()  # [bsz], int32
    for g in range(MAX_CACHES):
        s.max_blocks[g] = 1  # int32, unused caches
        s.block_size[g] = block_sizes[g] if g < G else 1  # int32
    for g, t in enumerate(tables):
        s.block_tables[g] = t.data_ptr()  # [rows >= bsz, W_g], int32
        s.table_stride[g] = t.stride(0)  # int64, elements
        s.max_blocks[g] = t.shape[1]  # int32
    s.cu_seqlens_q = cu.data_ptr()  # [k, M + 1], int32
    s.num_tokens = nt.data_ptr()  # [k], int32
    s.batch_id_per_token = batch.data_ptr()  # [k, C], int32
    s.position_ids = pos.data_ptr()  # [k, C], int64 / int32
    s.seq_lens_kv = kv.data_ptr()  # [k, M], int32
    s.slot_mapping = slots.data_ptr()  # [k, G, C], int64
    s.error_records = rec.data_ptr()  # [records, 2], uint64 words
    s.bsz, s.capacity, s.num_caches = bsz, C, G  # int32
    s.kv_indices_capacity, s.attn_stride = 1, M + 1  # int32 (no attention outputs)
    P.accept_num = acc.data_ptr()  # [bsz], int32
    P.num_substeps, P.max_requests = k, M  # int32
    cfg = dispatch.StepConfig(G, pos.dtype == torch.int64, C, max(bsz, 1))
    launch = dispatch.mtp_launch(cfg)
    fn = kernel_loader.load_kernels((launch.kernel,), dec.device.index)[launch.kernel]
    return (kernel_loader.Launcher(fn, P, by_value=True), launch.blocks, launch.threads, k, P)


def _cuda(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec) -> None:
    key = (id(dec), id(acc), id(cu), id(nt), id(batch), id(pos), id(kv), id(slots), id(rec), *map(id, tables))
    entry = _cache.get(key)
    if entry is None or entry[0] != list(block_sizes):
        bound = _bind(dec, acc, tables, block_sizes, cu, nt, batch, pos, kv, slots, rec)

        def forget(_ref, key=key):
            _cache.pop(key, None)

        refs = tuple(weakref.ref(t, forget) for t in (dec, acc, cu, nt, batch, pos, kv, slots, rec, *tables))
        entry = (list(block_sizes), bound, refs)
        with _lock:
            if len(_cache) >= CACHE_SIZE:
                _cache.clear()
            _cache[key] = entry
    launcher, blocks, threads, k, _ = entry[1]
    dev = dec.device.index
    with torch.cuda.device(dev):
        launcher(blocks, threads, _raw_stream(dev), k)


def clear_cache() -> None:
    """Forget every remembered argument set."""
    with _lock:
        _cache.clear()


class DraftStepBuffers:
    """The op's output tensors for k substeps (allocated once, passed every cycle).

    Parameters
    ----------
    max_requests : int
        M, the largest bsz.
    capacity : int
        C, the most tokens of a substep.
    block_sizes : sequence of int
        B of each cache (0 to 4).
    draft_steps : int
        k >= 1.
    position_dtype : torch.dtype, default torch.int64
    device : torch.device or str, default "cuda"
    """

    def __init__(self, max_requests, capacity, block_sizes, draft_steps, *, position_dtype=torch.int64, device="cuda"):
        M, C, k, G = int(max_requests), int(capacity), int(draft_steps), len(block_sizes)
        if not 1 <= k <= 1024:
            raise ValueError(f"draft_steps must be an int in [1, 1024], got {draft_steps}")
        self.block_sizes = [int(b) for b in block_sizes]
        self.draft_steps, self.capacity, self.max_requests = k, C, M
        kw = dict(device=device)
        self.cu_seqlens_q = torch.zeros((k, M + 1), dtype=torch.int32, **kw)
        self.num_tokens = torch.zeros(k, dtype=torch.int32, **kw)
        self.batch_id_per_token = torch.full((k, C), -1, dtype=torch.int32, **kw)
        self.position_ids = torch.zeros((k, C), dtype=position_dtype, **kw)
        self.seq_lens_kv = torch.zeros((k, M), dtype=torch.int32, **kw)
        self.slot_mapping = torch.full((k, G, C), -1, dtype=torch.int64, **kw)
        self.error_records = torch.empty((draft_records(k, C), 2), dtype=torch.int64, **kw)
        self.error_records[:, 0] = 0
        self.error_records[:, 1] = _NO_ERROR_I64

    @property
    def outputs_args(self) -> tuple:
        """The op's seven mutated arguments, in order."""
        return (
            self.cu_seqlens_q,
            self.num_tokens,
            self.batch_id_per_token,
            self.position_ids,
            self.seq_lens_kv,
            self.slot_mapping,
            self.error_records,
        )


def draft_steps(seq_lens_decoder, accept_num, block_tables, buffers: DraftStepBuffers) -> DraftOutputs:
    """Run ``torch.ops.kvaddr.draft_steps`` into ``buffers``; return views of its outputs
    (``.substep(j)``: substep j's). ``block_tables``: one int32 table or a list, one per cache.
    Traceable by ``torch.compile(fullgraph=True)``."""
    tables = [block_tables] if isinstance(block_tables, torch.Tensor) else list(block_tables or [])
    _op(seq_lens_decoder, accept_num, tables, buffers.block_sizes, *buffers.outputs_args)
    bsz = seq_lens_decoder.shape[0]
    b = buffers
    return DraftOutputs(
        cu_seqlens_q=b.cu_seqlens_q[:, : bsz + 1],
        num_tokens=b.num_tokens,
        batch_id_per_token=b.batch_id_per_token,
        position_ids=b.position_ids,
        seq_lens_kv=b.seq_lens_kv[:, :bsz],
        slot_mapping=b.slot_mapping,
    )


def draft_errors(buffers: DraftStepBuffers, *, clear: bool = True) -> tuple[int, int]:
    """``(error_mask, first_bad_key)`` of every launch since the last clear (synchronises);
    clears the records after reading unless ``clear=False``."""
    out = reduce_error_records(buffers.error_records.detach().cpu().numpy())
    if clear and out[0]:
        buffers.error_records[:, 0] = 0
        buffers.error_records[:, 1] = _NO_ERROR_I64
    return out


def check(buffers: DraftStepBuffers) -> None:
    """Raise :class:`~kvaddr.errors.AddressingError` if a launch since the last read had bad values."""
    mask, key = draft_errors(buffers)
    if mask:
        raise AddressingError(mask, key)


_lib = torch.library.Library("kvaddr", "FRAGMENT")
_lib.define(SCHEMA)
_lib.impl("draft_steps", _cpu, "CPU")
_lib.impl("draft_steps", _cuda, "CUDA")
torch.library.register_fake("kvaddr::draft_steps", _fake, lib=_lib)
_op = torch.ops.kvaddr.draft_steps.default
