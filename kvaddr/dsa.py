"""DeepSeek-V3.2 sparse attention on the GPU: the indexer's top-k positions -> cache slots.

:func:`topk_to_slots` converts a ``[T, K]`` (one layer) or ``[L, T, K]`` (L layers at once) int32
top-k into int32 slots of the same shape and int32 valid counts per row, in one launch of
``dsa_topk_slots`` (kvaddr/kernels/dsa.cuh), with the checks and options of
:func:`kvaddr.dsa_reference.topk_to_slots` (its oracle; docs/dsa.md): an index at or past the
token's context length, a block index past the table's width and a negative block id give -1 and
set an error bit in the layer's first-bad record; ``compact=True`` moves each row's valid slots
first; ``cp_size > 1`` keeps only this rank's positions, mapped to its local slots.

Beyond the reference, for values only the device sees (the kernel never reads or writes out of
bounds):

* a token with ``req_id < 0`` is padding (a CUDA graph's spare token): its row is all -1, its
  count 0, and it sets no error;
* a token with ``req_id >= block_table.shape[0]`` converts as through a row of width 0 (each
  in-context entry: -1 and :data:`~kvaddr.dsa_reference.ERR_BLOCK_INDEX`);
* a slot ``id * B + offset`` that does not fit int32 is -1 with :data:`ERR_SLOT_RANGE` (8).

Arrays: CuPy, PyTorch CUDA tensors, or any ``__cuda_array_interface__`` / ``__dlpack__``
object. With ``out``, ``counts`` and ``errors`` given, a call allocates nothing and does not
synchronise (CUDA-graph safe: every element of ``out`` and ``counts`` is written; the error
records are sticky, read and reset by :func:`topk_slot_errors`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvaddr import kernel_loader
from kvaddr.dsa_reference import NO_ERROR_KEY
from kvaddr.validation import INT32, ArrayInfo, check_int, describe, stream_handle

__all__ = [
    "ERR_SLOT_RANGE",
    "DsaTopkParams",
    "TopkSlotLaunch",
    "TopkSlotOutputs",
    "prepare_topk_to_slots",
    "topk_kernel",
    "topk_slot_errors",
    "topk_to_slots",
]

#: A slot ``block id * B + offset`` does not fit int32 (device-only; the reference refuses such tables).
ERR_SLOT_RANGE = 8
#: Threads per block of ``dsa_topk_slots`` (kernels.cu's KV_THREADS).
THREADS = 256
#: Places per thread per chunk (kernels.cu's KV_DSA_UNROLL).
UNROLL = 2
_U64, _I64, _I32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
_INT32_MAX = (1 << 31) - 1
_UINT64 = np.dtype(np.uint64)
_INT64 = np.dtype(np.int64)


class DsaTopkParams(ctypes.Structure):
    """kernels.cu's ``KvDsaTopkParams``: ``dsa_topk_slots``' one parameter, passed by value."""

    _fields_ = [
        ("topk", _U64),  # [L, T, K] int32, contiguous
        ("req_id", _U64),  # [T] int32 (< 0: padding token)
        ("block_table", _U64),  # [rows, width] int32, rows table_stride elements apart
        ("ctx", _U64),  # [T] int32
        ("slots", _U64),  # [L, T, K] int32 (written)
        ("counts", _U64),  # [L, T] int32 (written)
        ("errors", _U64),  # [L, 2] uint64: per layer (mask, first-bad key), sticky
        ("table_stride", _I64),  # int64: row stride of block_table, in elements
        ("num_layers", _I32),  # L
        ("num_tokens", _I32),  # T
        ("k", _I32),  # K
        ("rows", _I32),  # block_table's rows
        ("width", _I32),  # block_table's row length
        ("block_size", _I32),  # B
        ("cp_size", _I32),
        ("cp_rank", _I32),
        ("cp_interleave", _I32),
        ("row_shift", _I32),  # log2 of the threads per row, 5..8
        ("block_shift", _I32),  # log2(B) when B is a power of two, else -1
        ("reserved", _I32),  # unused (no tail padding)
    ]


@dataclass
class TopkSlotOutputs:
    """What :func:`topk_to_slots` wrote (device arrays, the caller's when given).

    Attributes
    ----------
    slots : device array
        int32, ``topk``'s shape.
    valid_counts : device array
        int32, ``topk.shape[:-1]``: each row's slots >= 0.
    errors : device array
        uint64 (or int64) [L, 2] (``[2]`` accepted for one layer): each layer's sticky
        (error mask, first-bad key); read with :func:`topk_slot_errors`.
    """

    slots: Any
    valid_counts: Any
    errors: Any


def topk_kernel(k: int, vec: int) -> tuple[int, int]:
    """``(row_shift, rows per block)`` of ``dsa_topk_slots`` for rows of ``k`` entries read ``vec``
    at a time: the fewest threads per row (32 to 256, a power of two) that cover a row in one chunk."""
    shift = 5
    while shift < 8 and (vec << shift) * UNROLL < k:
        shift += 1
    return shift, THREADS >> shift


def _contiguous(info: ArrayInfo) -> bool:
    if 0 in info.shape:
        return True
    want = 1
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n > 1 and s != want:
            return False
        want *= n
    return True


def _check(name: str, info: ArrayInfo, shape: tuple | None, dev: int, dtypes=(INT32,)) -> ArrayInfo:
    if info.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got dtype {info.dtype}")
    if shape is not None and tuple(info.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(info.shape)}")
    if not _contiguous(info):
        raise ValueError(f"{name} must be contiguous, got strides {info.strides} (elements)")
    if info.device != dev:
        raise ValueError(f"{name} must be on CUDA device {dev} (topk's), got device {info.device}")
    return info


def topk_to_slots(
    topk,
    req_id,
    block_table,
    block_size: int,
    ctx,
    *,
    out=None,
    counts=None,
    errors=None,
    compact: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    stream=None,
) -> TopkSlotOutputs:
    """Map the indexer's top-k positions to cache slots on the GPU, with checks (one launch).

    :func:`prepare_topk_to_slots` with the same arguments, then its launch on ``stream``.

    Parameters
    ----------
    topk : int32 device array [T, K] or [L, T, K], contiguous
        Request-local positions; a negative entry is unused. [L, T, K]: L layers' top-k at once
        (the same ``req_id``, table and ``ctx``).
    req_id : int32 device array [T], contiguous
        Each token's row of ``block_table`` (the step's ``batch_id_per_token``); < 0: padding.
    block_table : int32 device array [rows, W], last dimension contiguous
        Block ids in batch order (rank-local with DCP); a negative id is unallocated.
    block_size : int
        ``B`` (>= 1).
    ctx : int32 device array [T], contiguous
        Each token's context length (``position + 1``): a position at or past it is an error.
    out : int32 device array, ``topk``'s shape, optional
        The slots (allocated when None).
    counts : int32 device array, ``topk.shape[:-1]``, optional
        Each row's valid slots (allocated when None).
    errors : uint64 or int64 device array [L, 2] ([2] for a [T, K] topk), optional
        Sticky per-layer (error mask, first-bad key) records: a launch ORs its bits in and keeps
        the smaller key. Allocated clean when None; a caller's array is never reset here
        (:func:`topk_slot_errors` reads and resets it).
    compact : bool, optional
        Each row's valid slots first, in their order, then -1s.
    cp_size, cp_rank, cp_interleave : int, optional
        Decode context parallelism: keep only this rank's positions (docs/dsa.md).
    stream : optional
        A CuPy stream, a raw ``cudaStream_t`` or a torch stream (CuPy's current one by default).

    Returns
    -------
    TopkSlotOutputs

    Raises
    ------
    TypeError
        A wrong dtype, a non-array, a non-int / non-bool option.
    ValueError
        A wrong shape, a strided array, arrays on different devices, an option out of range.
    """
    handle = stream_handle(stream)
    return _prepare(
        topk,
        req_id,
        block_table,
        block_size,
        ctx,
        out=out,
        counts=counts,
        errors=errors,
        compact=compact,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        records_stream=handle,
    ).launch(handle)


class TopkSlotLaunch:
    """One checked conversion, ready to launch again: :func:`prepare_topk_to_slots`' result.

    :meth:`launch` converts what the arrays hold at that moment (on the device, in stream
    order), so it can run every step, or be captured in a CUDA graph, while the same arrays
    (the same memory, shapes and strides) are refilled; nothing is checked or allocated there.

    Attributes
    ----------
    outputs : TopkSlotOutputs
        The arrays the launch writes.
    device : int
        Their CUDA device.
    """

    __slots__ = ("_grid", "_launcher", "device", "outputs")

    def __init__(self, outputs: TopkSlotOutputs, device: int, launcher, grid: int) -> None:
        self.outputs, self.device, self._launcher, self._grid = outputs, device, launcher, grid

    def launch(self, stream=None) -> TopkSlotOutputs:
        """Launch on ``stream`` (CuPy's current one by default; a CuPy or torch stream or a raw
        handle); returns :attr:`outputs`."""
        if self._launcher is not None:
            import cupy

            handle = stream_handle(stream)
            with cupy.cuda.Device(self.device):
                self._launcher(self._grid, THREADS, handle)
        return self.outputs


def prepare_topk_to_slots(
    topk,
    req_id,
    block_table,
    block_size: int,
    ctx,
    *,
    out=None,
    counts=None,
    errors=None,
    compact: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> TopkSlotLaunch:
    """Check the arguments of :func:`topk_to_slots` (the same, without ``stream``), allocate the
    outputs not given, and return the launch, not run yet.

    Raises
    ------
    TypeError, ValueError
        As :func:`topk_to_slots`.
    """
    return _prepare(
        topk,
        req_id,
        block_table,
        block_size,
        ctx,
        out=out,
        counts=counts,
        errors=errors,
        compact=compact,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        records_stream=None,
    )


def _prepare(
    topk,
    req_id,
    block_table,
    block_size: int,
    ctx,
    *,
    out,
    counts,
    errors,
    compact: bool,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int,
    records_stream: int | None,
) -> TopkSlotLaunch:
    """prepare_topk_to_slots. Records it allocates are cleared on ``records_stream`` (the raw
    handle of the one launch that follows, so in stream order before it), or, for None, on
    CuPy's current stream and waited for (the launch may then run on any stream)."""
    ti = describe("topk", topk)
    if len(ti.shape) not in (2, 3):
        raise ValueError(f"topk must have shape [T, K] or [L, T, K], got {tuple(ti.shape)}")
    dev = ti.device
    _check("topk", ti, None, dev)
    layers, t, k = (1, *ti.shape) if len(ti.shape) == 2 else ti.shape
    if t > _INT32_MAX or k >= 1 << 29 or layers > _INT32_MAX:
        raise ValueError(f"topk has too many tokens or columns: shape {tuple(ti.shape)}")
    ri = _check("req_id", describe("req_id", req_id), (t,), dev)
    ci = _check("ctx", describe("ctx", ctx), (t,), dev)
    bi = describe("block_table", block_table)
    if bi.dtype != INT32:
        raise TypeError(f"block_table must be int32, got dtype {bi.dtype}")
    if len(bi.shape) != 2:
        raise ValueError(f"block_table must have shape [rows, W], got {tuple(bi.shape)}")
    rows, width = bi.shape
    if rows and width > 1 and bi.strides[1] != 1:
        raise ValueError(f"block_table's last dimension must be contiguous, got strides {bi.strides} (elements)")
    if rows and width and bi.device != dev:
        raise ValueError(f"block_table must be on CUDA device {dev} (topk's), got device {bi.device}")
    if rows > _INT32_MAX or width > _INT32_MAX:
        raise ValueError(f"block_table is too large: shape {tuple(bi.shape)}")
    b = check_int("block_size", block_size, lo=1, hi=_INT32_MAX)
    if not isinstance(compact, (bool, np.bool_)):
        raise TypeError(f"compact must be a bool, got {compact!r}")
    cp = check_int("cp_size", cp_size, lo=1, hi=_INT32_MAX)
    rank = check_int("cp_rank", cp_rank, lo=0, hi=cp - 1)
    inter = check_int("cp_interleave", cp_interleave, lo=1, hi=_INT32_MAX)

    import cupy

    with cupy.cuda.Device(dev):
        if out is None:
            out = cupy.empty(tuple(ti.shape), dtype=np.int32)
        if counts is None:
            counts = cupy.empty(tuple(ti.shape[:-1]), dtype=np.int32)
        if errors is None:
            errors = cupy.empty((layers, 2), dtype=np.uint64)
            if records_stream is None:
                errors[:, 0] = 0
                errors[:, 1] = NO_ERROR_KEY
                cupy.cuda.get_current_stream().synchronize()
            else:
                from kvaddr.validation import cupy_stream

                with cupy_stream(records_stream):
                    errors[:, 0] = 0
                    errors[:, 1] = NO_ERROR_KEY
    oi = _check("out", describe("out", out), ti.shape, dev)
    ni = _check("counts", describe("counts", counts), ti.shape[:-1], dev)
    ei = describe("errors", errors)
    want_err = ((layers, 2), (2,)) if len(ti.shape) == 2 else ((layers, 2),)
    if tuple(ei.shape) not in want_err:
        raise ValueError(f"errors must have shape {' or '.join(str(s) for s in want_err)}, got {tuple(ei.shape)}")
    _check("errors", ei, None, dev, (_UINT64, _INT64))

    outputs = TopkSlotOutputs(out, counts, errors)
    if layers * t == 0:
        return TopkSlotLaunch(outputs, dev, None, 0)
    vec = 4 if k % 4 == 0 and ti.ptr % 16 == 0 and oi.ptr % 16 == 0 else 1
    shift, per_block = topk_kernel(k, vec)
    p = DsaTopkParams(
        topk=ti.ptr,
        req_id=ri.ptr,
        block_table=bi.ptr if rows and width else 0,
        ctx=ci.ptr,
        slots=oi.ptr,
        counts=ni.ptr,
        errors=ei.ptr,
        table_stride=bi.strides[0] if rows else 0,
        num_layers=layers,
        num_tokens=t,
        k=k,
        rows=rows,
        width=width,
        block_size=b,
        cp_size=cp,
        cp_rank=rank,
        cp_interleave=inter,
        row_shift=shift,
        block_shift=b.bit_length() - 1 if b & (b - 1) == 0 else -1,
    )
    pow2 = vec == 4 and cp == 1 and b & (b - 1) == 0 and layers * t <= _INT32_MAX
    if pow2 and k <= (vec << shift) * UNROLL:
        # the common cases (a row of one chunk: K <= 2048): no division, fewer registers
        name = f"dsa_topk_slots_pow2<{'true' if compact else 'false'}>"
    else:
        name = f"dsa_topk_slots<{'true' if compact else 'false'}, {vec}>"
    fn = kernel_loader.load_kernels((name,), dev)[name]
    return TopkSlotLaunch(outputs, dev, kernel_loader.Launcher(fn, p, by_value=True), -(-(layers * t) // per_block))


def topk_slot_errors(errors, *, reset: bool = True, stream=None) -> tuple[np.ndarray, np.ndarray]:
    """Read (synchronising on ``stream``) the per-layer error records of :func:`topk_to_slots`.

    Parameters
    ----------
    errors : uint64 or int64 device array [L, 2] or [2]
    reset : bool, optional
        Clear the records after reading them (when one is set).
    stream : optional
        As in :func:`topk_to_slots`.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        int64 ``[L]`` error masks (0: clean) and uint64 ``[L]`` first-bad keys
        (:data:`~kvaddr.dsa_reference.NO_ERROR_KEY` when clean; read them with
        :func:`~kvaddr.dsa_reference.decode_topk_error_key`).
    """
    import cupy

    from kvaddr.validation import cupy_stream

    handle = stream_handle(stream)
    info = describe("errors", errors)
    arr = cupy.asarray(errors) if not hasattr(errors, "get") else errors
    s = cupy_stream(handle)
    with cupy.cuda.Device(info.device):
        host = np.empty(tuple(info.shape), dtype=info.dtype)
        arr.get(stream=s, out=host)
        s.synchronize()
        words = host.reshape(-1, 2).view(np.uint64)
        masks = words[:, 0].astype(np.int64)
        keys = words[:, 1].copy()
        if reset and masks.any():
            clean = np.empty_like(host).reshape(-1, 2).view(np.uint64)
            clean[:, 0] = 0
            clean[:, 1] = NO_ERROR_KEY
            arr.set(clean.view(host.dtype).reshape(host.shape), stream=s)
    return masks, keys
