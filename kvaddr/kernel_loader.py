"""Loading kernels.cu: one cupy.RawModule per device, memoized; functions by name.

CuPy caches the compiled binary on disk (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``), so a new process on the same GPU skips NVRTC.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

from kvaddr.errors import KernelCompileError

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
KERNEL_NAMES = (
    "kvaddr_step_i64",
    "kvaddr_step_i32",
    # the single-block step (v9), one kernel per cache count and position type
    *(f"kvaddr_step1_c{g}_{pos}" for pos in ("i64", "i32") for g in range(5)),
    # v9 as first shipped (StepPlanner.use_kernel("v9-old"): one comparison run)
    *(f"kvaddr_step1old_c{g}_{pos}" for pos in ("i64", "i32") for g in range(5)),
    # the small-batch step with attention outputs (v9 token blocks + metadata blocks)
    *(f"kvaddr_step1m_c{g}_{pos}" for pos in ("i64", "i32") for g in range(5)),
    # v9 across blocks (R = 4, 8, 16 requests per thread; StepPlanner.kernel_for for 256 < bsz <= 4096)
    *(f"kvaddr_step1w{r}_c{g}_{pos}" for r in (4, 8, 16) for pos in ("i64", "i32") for g in range(5)),
    # v9 across blocks with attention outputs (token blocks + metadata blocks; 256 < bsz <= 4096)
    *(f"kvaddr_step1wm{r}_c{g}_{pos}" for r in (4, 8, 16) for pos in ("i64", "i32") for g in range(5)),
    "kvaddr_slots_i64",
    "kvaddr_slots_i32",
    "kvaddr_where_pad",
    "kvaddr_engine_pages",
    "kvaddr_engine_cumsum",
    "kvaddr_engine_copy_pages",
    "kvaddr_engine_pad_pages",
    "kvaddr_engine_last_page",
    "kvaddr_engine_max",
    "kvaddr_empty",
    "kvaddr_one_block_i64",
    "kvaddr_one_block_i32",
    # kvaddr/engines/vllm.py and its three-launch baseline (the vLLM section of kernels.cu)
    "kvaddr_vllm_step_v2",
    "kvaddr_vllm_step_v2a",  # v2 with the attention metadata blocks (VllmStepPlanner(attention=...))
    "kvaddr_vllm3_prepare",
    "kvaddr_vllm3_gather",
    "kvaddr_vllm3_slots",
)
COMPILE_OPTIONS = ("-std=c++14",)

_modules: dict = {}
_functions: dict = {}


@functools.cache
def source() -> str:
    """The CUDA source of every kvaddr kernel."""
    return SOURCE_PATH.read_text()


@functools.cache
def constants() -> dict:
    """Integer ``#define KV_*`` constants of kernels.cu (one source of truth), error bits
    ``KV_ERR_*`` included (a trailing ``//`` comment is allowed)."""
    out = {}
    for name, value in re.findall(r"^#define (KV_[A-Z_0-9]+) (\d+)\s*(?://.*)?$", source(), flags=re.M):
        out[name] = int(value)
    out["KV_TOKENS_PER_THREAD"] = out["KV_TOKENS"] // out["KV_THREADS"]
    out["KV_WARPS"] = out["KV_THREADS"] // 32
    return out


def cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def get_module(device_id: int | None = None):
    """The compiled module for a device (the current one by default).

    Raises
    ------
    KernelCompileError
        With NVRTC's log, if kernels.cu does not compile for that device.
    """
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
    mod = _modules.get(dev)
    if mod is None:
        with cupy.cuda.Device(dev):
            mod = cupy.RawModule(code=source(), options=COMPILE_OPTIONS)
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as exc:
                raise KernelCompileError(
                    f"kvaddr/kernels.cu failed to compile for CUDA device {dev}:\n{exc.get_message()}"
                ) from None
        _modules[dev] = mod
    return mod


def get_function(name: str, device_id: int | None = None):
    """A kernel of kernels.cu by name, as a launchable ``cupy.cuda.Function``."""
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
    fn = _functions.get((dev, name))
    if fn is None:
        if name not in KERNEL_NAMES:
            raise ValueError(f"name must be one of {', '.join(KERNEL_NAMES)}, got {name!r}")
        with cupy.cuda.Device(dev):
            raw = get_module(dev).get_function(name)
            # The RawKernel's cupy.cuda.Function takes a stream argument (RawKernel
            # itself launches on the current stream only).
            fn = getattr(raw, "kernel", raw)
        _functions[(dev, name)] = fn
    return fn


class RawStream:
    """The smallest stream object ``cupy.cuda.Function.__call__`` accepts (it reads ``.ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


_streams: dict = {}


def raw_stream(handle: int) -> RawStream:
    s = _streams.get(handle)
    if s is None:
        s = _streams[handle] = RawStream(handle)
    return s


# ---- kernel arguments by name: ctypes mirrors of kernels.cu ------------------------
# Device pointers are c_uint64 (an int, 0 for null). tests/unit/test_kernel_params.py
# checks these against the C source (field names, order, sizes, offsets: nvcc).

_U64, _I64, _I32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
#: kernels.cu's KV_MAX_CACHES (the length of StepParams' per-cache arrays).
MAX_CACHES = 4


class StepParams(ctypes.Structure):
    """kernels.cu's ``KvStepParams``: the fused step's one parameter, passed by value.

    Filled by name (``params.bsz = 7``, ``params.block_tables[g] = ptr``); shapes and
    dtypes of what each pointer addresses are in the comments (and in kernels.cu).
    """

    _fields_ = [
        # -- inputs (read only) --
        ("seq_lens_decoder", _U64),  # [bsz], int32: tokens already in each request's KV cache
        ("seq_lens_this_time", _U64),  # [bsz], int32: tokens each request runs this step
        ("block_tables", _U64 * MAX_CACHES),  # cache g: [rows >= bsz, max_blocks[g]], int32; 0 if unused
        # -- outputs (written every launch) --
        ("cu_seqlens_q", _U64),  # [bsz + 1], int32
        ("num_tokens", _U64),  # [] (one value), int32
        ("batch_id_per_token", _U64),  # [capacity], int32 (-1 padding)
        ("position_ids", _U64),  # [capacity], int64 (PosT = long long) or int32 (PosT = int)
        ("seq_lens_kv", _U64),  # [bsz], int32
        ("slot_mapping", _U64),  # [num_caches, capacity], int64 (-1 padding / bad)
        # -- device state (owned by the planner) --
        ("error_records", _U64),  # [(num_chunks + max_tiles) * KV_WARPS, 2], uint64: (mask, first-bad key)
        ("tile_state", _U64),  # [4], uint32: KV_STATE_* words of the large-batch path
        ("tile_status", _U64),  # [max(max_tiles, 1)], uint64: look-back word of each tile
        # -- attention outputs (docs/attention.md; 0 when not asked for) --
        ("kv_indptr", _U64),  # [num_caches, attn_stride], int32: row g = kv_indptr[g][0..bsz] (flashinfer)
        ("kv_indices", _U64),  # [num_caches, kv_indices_capacity], int32: -1 past kv_indptr[g][bsz]
        ("kv_last_page_len", _U64),  # [num_caches, attn_stride], int32: row g = [0..bsz) (flashinfer)
        ("cu_seqlens_k", _U64),  # [bsz + 1], int32 (varlen)
        ("max_seqlen", _U64),  # [2], int32: max_seqlen_q, max_seqlen_k (varlen)
        # -- scalars --
        ("table_stride", _I64 * MAX_CACHES),  # int64: row stride of block_tables[g], in elements
        ("max_blocks", _I32 * MAX_CACHES),  # int32: row length of block_tables[g] (1 if unused)
        ("block_size", _I32 * MAX_CACHES),  # int32: B of cache g (1 if unused)
        ("bsz", _I32),  # int32: requests this step
        ("capacity", _I32),  # int32: C, tokens of every per-token output
        ("num_caches", _I32),  # int32: caches addressed, 0..MAX_CACHES
        ("max_tiles", _I32),  # int32: ceil(max_requests / KV_TILE) if max_requests > KV_TILE else 0
        ("attention", _I32),  # int32: KV_ATTN_* bits asked for (0: none, no metadata blocks)
        ("kv_indices_capacity", _I32),  # int32: N, entries of each kv_indices row (1 without flashinfer)
        ("attn_stride", _I32),  # int32: row stride (elements) of kv_indptr and kv_last_page_len
        ("meta_per_cache", _I32),  # int32: metadata blocks per cache (>= 1 with attention)
        ("meta_entries", _I32),  # int32: E, kv_indices entries per metadata block
        ("num_meta", _I32),  # int32: metadata blocks after the token blocks (0 when off)
    ]


class SlotsArgs(ctypes.Structure):
    """The parameters of ``kvaddr_slots_i64`` / ``kvaddr_slots_i32``, in order (one per field)."""

    _fields_ = [
        ("position_ids", _U64),  # [capacity], int64 / int32
        ("batch_id_per_token", _U64),  # [capacity], int32 (-1 padding)
        ("block_table", _U64),  # [rows, max_blocks], int32, rows row_stride elements apart
        ("row_stride", _I64),  # int64: the table's row stride, in elements
        ("max_blocks", _I32),  # int32: the table's row length
        ("block_size", _I32),  # int32: B
        ("capacity", _I32),  # int32: C
        ("slot_mapping", _U64),  # [capacity], int64: this cache's slot mapping (written)
    ]


class WhereArgs(ctypes.Structure):
    """The parameters of ``kvaddr_where_pad``, in order (one per field)."""

    _fields_ = [
        ("batch_id_per_token", _U64),  # [capacity], int32
        ("block_index", _U64),  # [capacity], int64: pos // B
        ("block_id", _U64),  # [capacity], int32: the gathered block id
        ("max_blocks", _I32),  # int32: the table's row length
        ("capacity", _I32),  # int32: C
        ("slot_mapping", _U64),  # [capacity], int64: fixed in place (-1 padding / bad)
    ]


class OneBlockParams(ctypes.Structure):
    """kernels.cu's ``KvOneBlockParams``: the one-block step's one parameter, passed by value.

    ``kvaddr_one_block_i64`` / ``_i32`` run ``<<<1, max(bsz, 1)>>>`` (bsz <= 1024).
    """

    _fields_ = [
        # -- inputs (read only) --
        ("seq_lens_decoder", _U64),  # [bsz], int32
        ("seq_lens_this_time", _U64),  # [bsz], int32
        ("block_tables", _U64 * MAX_CACHES),  # cache g: [rows >= bsz, max_blocks[g]], int32; 0 if unused
        # -- outputs (written every launch) --
        ("cu_seqlens_q", _U64),  # [bsz + 1], int32
        ("num_tokens", _U64),  # [] (one value), int32
        ("batch_id_per_token", _U64),  # [capacity], int32 (-1 padding)
        ("position_ids", _U64),  # [capacity], int64 (kvaddr_one_block_i64) or int32 (_i32)
        ("seq_lens_kv", _U64),  # [bsz], int32
        ("slot_mapping", _U64),  # [num_caches, capacity], int64 (-1 padding / bad)
        ("error_record", _U64),  # [2], uint64: (error mask, first-bad key), rewritten every launch
        # -- scalars --
        ("table_stride", _I64 * MAX_CACHES),  # int64: row stride of block_tables[g], in elements
        ("max_blocks", _I32 * MAX_CACHES),  # int32: row length of block_tables[g] (1 if unused)
        ("block_size", _I32 * MAX_CACHES),  # int32: B of cache g (1 if unused)
        ("bsz", _I32),  # int32: requests this step, 0..1024
        ("capacity", _I32),  # int32: C
        ("num_caches", _I32),  # int32: caches addressed, 0..MAX_CACHES
        ("reserved", _I32),  # int32, unused (no tail padding)
    ]


class Launcher:
    """One kernel's launch from a persistent ctypes.Structure of its arguments.

    ``cupy.cuda.Function.__call__`` converts every argument on every launch (about
    0.7 us each on an H200 host with CuPy 14). Here the arguments live in one ctypes
    Structure with the kernel's exact C types (the explicit cast RawKernel needs),
    callers write only the fields that changed (by name), and the launch goes
    straight to ``cuLaunchKernel`` with a prebuilt ``kernelParams`` array, which the
    driver copies, so the structure can be reused at once (also while a CUDA graph
    is being captured). Not thread-safe: use one launcher (one planner) per thread.

    Parameters
    ----------
    fn : cupy.cuda.Function
    args : ctypes.Structure instance
        With ``by_value=True``, the kernel's one parameter (a C struct passed by
        value, e.g. :class:`StepParams`); otherwise one field per kernel parameter,
        in order (e.g. :class:`SlotsArgs`).
    by_value : bool, default False
    """

    def __init__(self, fn, args, *, by_value: bool = False):
        self.fn = fn
        self.args = args
        self.by_value = by_value
        base = ctypes.addressof(args)
        if by_value:
            addrs = [base]
        else:
            addrs = [base + getattr(type(args), name).offset for name, _ in args._fields_]
        self._params = (ctypes.c_void_p * len(addrs))(*addrs)
        self._params_ptr = ctypes.addressof(self._params)
        self._fast = None
        try:
            from cupy.cuda import driver

            self._fast = driver.launchKernel
            self._fptr = int(fn.ptr)
        except (ImportError, AttributeError):  # older CuPy: convert through Function.__call__
            self._fast = None

    @property
    def fast(self) -> bool:
        return self._fast is not None

    def __call__(self, grid: int, block: int, stream: int) -> None:
        if self._fast is not None:
            self._fast(self._fptr, grid, 1, 1, block, 1, 1, 0, stream, self._params_ptr, 0)
        else:
            self.fn((grid,), (block,), function_args(self.args, by_value=self.by_value), 0, raw_stream(stream))


def function_args(args, *, by_value: bool = False) -> tuple:
    """A launcher's arguments for ``cupy.cuda.Function.__call__`` / ``RawKernel``.

    One NumPy scalar of the field's exact type per field (positional kernels), or
    with ``by_value`` a one-tuple of a ``cupy.cuda.function.CPointer`` to the struct
    itself: CuPy passes that address to ``cuLaunchKernel`` as the parameter's value
    pointer, so the driver copies the struct's bytes at launch (CuPy does no
    conversion; valid while ``args`` lives, its contents read at each launch).
    """
    if by_value:
        from cupy.cuda.function import CPointer

        return (CPointer(ctypes.addressof(args)),)
    import numpy as np

    conv = {_U64: np.uint64, _I64: np.int64, _I32: np.int32}
    return tuple(conv[ctype](getattr(args, name)) for name, ctype in args._fields_)
