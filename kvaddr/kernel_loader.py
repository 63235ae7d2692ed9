"""Loading the kernels: kvaddr/kernels.cu compiled by NVRTC through ``cupy.RawModule``.

Library kernels are templates compiled only when a planner needs them, one module per set
of kernels and device, memoized (:func:`load_kernels`); the baselines the profiler compares
against are one more module (:func:`get_module`). CuPy caches each compiled binary on disk
(``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), so a new process on the same GPU
skips NVRTC.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

from kvaddr.errors import KernelCompileError

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
#: ``#include "kernels/NAME.cuh"`` lines of kernels.cu (and of the headers), expanded by :func:`source`.
_INCLUDE = re.compile(r'^#include "(kernels/[A-Za-z0-9_]+\.cuh)"[ \t]*$', flags=re.M)
COMPILE_OPTIONS = ("-std=c++14",)
#: The define that compiles the baseline kernels (kvaddr/kernels/baselines.cuh) into a module.
BASELINES_OPTION = "-DKV_BASELINES"

_modules: dict = {}
_functions: dict = {}
_compiled: list = []  # (device, names, seconds) of every module this process compiled or loaded


@functools.cache
def source() -> str:
    """The CUDA source of every kvaddr kernel: kernels.cu with its headers expanded in place.

    The loader compiles this text itself (no include path), so CuPy's disk cache key, a hash
    of the source, changes whenever any header does.
    """

    def expand(text: str, seen: tuple) -> str:
        def one(m: re.Match) -> str:
            rel = m.group(1)
            if rel in seen:
                raise KernelCompileError(f"kvaddr/kernels.cu: {rel} includes itself")
            path = SOURCE_PATH.parent / rel
            return f"// ---- {rel} ----\n" + expand(path.read_text(), (*seen, rel))

        return _INCLUDE.sub(one, text)

    return expand(SOURCE_PATH.read_text(), ())


def source_files() -> tuple:
    """kernels.cu and every header it includes (what the package must ship)."""
    return (SOURCE_PATH, *sorted(SOURCE_PATH.parent.joinpath("kernels").glob("*.cuh")))


@functools.cache
def constants() -> dict:
    """Integer ``#define KV_*`` constants of the kernels (one source of truth), error bits
    ``KV_ERR_*`` included (a trailing ``//`` comment is allowed)."""
    out = {}
    for name, value in re.findall(r"^#define (KV_[A-Z_0-9]+) (\d+)\s*(?://.*)?$", source(), flags=re.M):
        out[name] = int(value)
    out["KV_TOKENS_PER_THREAD"] = out["KV_TOKENS"] // out["KV_THREADS"]
    out["KV_WARPS"] = out["KV_THREADS"] // 32
    return out


def cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def cache_state() -> dict:
    """CuPy's on-disk kernel cache (where compiled kvaddr modules are kept across processes):
    ``{"dir", "exists", "writable", "files", "bytes"}``, and what this process compiled."""
    d = Path(cache_dir())
    files = [f for f in d.iterdir() if f.is_file()] if d.is_dir() else []
    return {
        "dir": str(d),
        "exists": d.is_dir(),
        "writable": os.access(d if d.is_dir() else d.parent, os.W_OK),
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "compiled": list(_compiled),
    }


def _device(device_id) -> int:
    import cupy

    return cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)


def _compile(dev: int, code: str, options: tuple, names: tuple, what: str):
    import time

    import cupy

    t0 = time.perf_counter()
    with cupy.cuda.Device(dev):
        kw = {"name_expressions": list(names)} if names else {}
        mod = cupy.RawModule(code=code, options=options, **kw)
        try:
            mod.compile()
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(
                f"kvaddr/kernels.cu ({what}) failed to compile for CUDA device {dev}:\n{exc.get_message()}"
            ) from None
    _compiled.append((dev, what, time.perf_counter() - t0))
    return mod


def load_kernels(names, device_id: int | None = None) -> dict:
    """The library kernels ``names`` (kvaddr/kernel_names.py ``LIBRARY_KERNELS``) for a device,
    as launchable ``cupy.cuda.Function`` objects by name.

    The ones not loaded yet in this process are compiled together, in one module holding only
    them (a template instantiation per name, CuPy ``name_expressions``); CuPy's disk cache
    keeps the binary, so a later process loads it without compiling.

    Raises
    ------
    KernelCompileError
        With NVRTC's log, if they do not compile for that device.
    """
    from kvaddr.kernel_names import LIBRARY_KERNELS

    dev = _device(device_id)
    names = tuple(dict.fromkeys(names))
    bad = [n for n in names if n not in LIBRARY_KERNELS]
    if bad:
        raise ValueError(f"names must be library kernels (kvaddr.kernel_names.LIBRARY_KERNELS), got {bad!r}")
    missing = tuple(n for n in names if (dev, n) not in _functions)
    if missing:
        # The names lead the text, so the disk cache keeps one binary per set of kernels.
        code = "// kvaddr: " + "; ".join(missing) + "\n" + source()
        mod = _compile(dev, code, COMPILE_OPTIONS, missing, ", ".join(missing))
        import cupy

        with cupy.cuda.Device(dev):
            for n in missing:
                raw = mod.get_function(n)
                # The RawKernel's cupy.cuda.Function takes a stream argument.
                _functions[(dev, n)] = getattr(raw, "kernel", raw)
    return {n: _functions[(dev, n)] for n in names}


def get_module(device_id: int | None = None):
    """The baselines' module for a device (the current one by default), compiled on first use:
    the ``extern "C"`` kernels the profiler compares the library against.

    Raises
    ------
    KernelCompileError
        With NVRTC's log, if the baselines do not compile for that device.
    """
    dev = _device(device_id)
    mod = _modules.get(dev)
    if mod is None:
        mod = _modules[dev] = _compile(dev, source(), (*COMPILE_OPTIONS, BASELINES_OPTION), (), "baselines")
    return mod


def get_function(name: str, device_id: int | None = None):
    """A kernel by name, as a launchable ``cupy.cuda.Function``: a library kernel (its name
    expression, e.g. ``"step_small<1, long long>"``) or a baseline (e.g. ``"kvaddr_empty"``)."""
    from kvaddr.kernel_names import BASELINE_KERNELS, LIBRARY_KERNELS

    dev = _device(device_id)
    fn = _functions.get((dev, name))
    if fn is not None:
        return fn
    if name in LIBRARY_KERNELS:
        return load_kernels((name,), dev)[name]
    if name not in BASELINE_KERNELS:
        raise ValueError(
            f"name must be a kernel of kvaddr.kernel_names (LIBRARY_KERNELS or BASELINE_KERNELS), got {name!r}"
        )
    import cupy

    with cupy.cuda.Device(dev):
        raw = get_module(dev).get_function(name)
        fn = _functions[(dev, name)] = getattr(raw, "kernel", raw)
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
        # -- DSA outputs (docs/dsa.md; 0 / null when off) --
        ("dsa_value_offsets", _U64),  # [capacity], int64: indexer-cache byte offset of the values (-1 pad)
        ("dsa_scale_offsets", _U64),  # [capacity], int64: indexer-cache byte offset of the scale (-1 pad)
        ("dsa_ks", _U64),  # [capacity], int32: prefill token's first key; 0 decode / padding
        ("dsa_ke", _U64),  # [capacity], int32: ks + position + 1 (prefill), else 0
        ("dsa_ctx", _U64),  # [capacity], int32: position + 1; 0 padding
        ("dsa_cu_seq_lens", _U64),  # [max_requests + 1], int32: prefix of the prefills' seq_lens
        ("dsa", _I32),  # int32: 1 = write the DSA outputs (a second grid row)
        ("dsa_cache", _I32),  # int32: the indexer cache's index
        ("dsa_decode_len", _I32),  # int32: n, a decode runs 1 to n tokens
        ("dsa_value_bytes", _I32),  # int32: V
        ("dsa_scale_bytes", _I32),  # int32: S
        ("dsa_cu_len", _I32),  # int32: entries of dsa_cu_seq_lens
    ]


class MtpParams(ctypes.Structure):
    """kernels.cu's ``KvMtpParams``: the MTP substeps' one parameter, passed by value.

    ``step`` is a :class:`StepParams` whose output pointers address substep 0's rows of
    outputs shaped ``[k, ...]`` (kvaddr/kernels/mtp.cuh); its ``seq_lens_this_time`` is unused.
    """

    _fields_ = [
        ("step", StepParams),  # KvStepParams: tables, block sizes, bsz, capacity, outputs of substep 0
        ("accept_num", _U64),  # [bsz], int32: tokens each request accepted (0 for an idle slot)
        ("num_substeps", _I32),  # int32: k >= 1 (the grid's y dimension)
        ("max_requests", _I32),  # int32: M; rows of cu_seqlens_q / cu_seqlens_k are M + 1 apart
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


class MtpLengthsArgs(ctypes.Structure):
    """The parameters of ``kvaddr_mtp_substep_lengths``, in order (one per field)."""

    _fields_ = [
        ("seq_lens_decoder", _U64),  # [bsz], int32
        ("accept_num", _U64),  # [bsz], int32
        ("dec_out", _U64),  # [bsz], int32: the substep's seq_lens_decoder (written)
        ("q_out", _U64),  # [bsz], int32: the substep's seq_lens_this_time (written)
        ("bsz", _I32),  # int32: requests, <= 1024
        ("substep", _I32),  # int32: j >= 0
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
    launch_kernel : callable, optional
        What makes the driver call, with ``cupy.cuda.driver.launchKernel``'s arguments (a
        :class:`DependentLaunch`, say); ``launchKernel`` by default.
    """

    def __init__(self, fn, args, *, by_value: bool = False, launch_kernel=None):
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

            self._fast = driver.launchKernel if launch_kernel is None else launch_kernel
            self._fptr = int(fn.ptr)
        except (ImportError, AttributeError):  # older CuPy: convert through Function.__call__
            self._fast = launch_kernel
            self._fptr = int(fn.ptr) if launch_kernel is not None else 0

    @property
    def fast(self) -> bool:
        return self._fast is not None

    @property
    def driver(self) -> tuple | None:
        """``(launch_kernel, function, params_ptr)``: CuPy's ``driver.launchKernel``, this kernel's
        function handle and the address of its kernelParams array, for a bound launch that makes
        the driver call itself (read once when binding, not per launch); None on a CuPy without
        that call (then call the launcher)."""
        if self._fast is None:
            return None
        return self._fast, self._fptr, self._params_ptr

    def __call__(self, grid: int, block: int, stream: int, grid_y: int = 1) -> None:
        if self._fast is not None:
            self._fast(self._fptr, grid, grid_y, 1, block, 1, 1, 0, stream, self._params_ptr, 0)
        else:
            args = function_args(self.args, by_value=self.by_value)
            self.fn((grid, grid_y), (block,), args, 0, raw_stream(stream))


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def _cu_launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` through ctypes, or None where the driver library lacks it."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            fn = ctypes.CDLL(name).cuLaunchKernelEx
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def programmatic_launch_supported(device_id: int) -> bool:
    """Whether a kernel can be launched as the programmatic dependent of the one before it on
    ``device_id`` (compute capability 9.0 or later, a driver with ``cuLaunchKernelEx``)."""
    import cupy

    try:
        major = int(cupy.cuda.Device(device_id).compute_capability) // 10
    except (AttributeError, TypeError, ValueError):
        return False
    return major >= 9 and _cu_launch_kernel_ex() is not None


class DependentLaunch:
    """``cupy.cuda.driver.launchKernel``'s signature for a kernel that runs behind another: each call
    launches ``first`` (``first_blocks`` x ``threads``, the same kernel parameters), then the kernel
    it is given, as ``first``'s programmatic dependent with ``programmatic`` (it may start while
    ``first`` runs and waits for it with ``griddepcontrol.wait``; sm_90 and later, see
    :func:`programmatic_launch_supported`), else in stream order. Both launches are recorded by
    CUDA graph capture. The second launch's configuration is built once per grid, block and stream
    and kept (a handful per planner). Not thread-safe."""

    def __init__(self, first: int, first_blocks: int, threads: int, *, programmatic: bool):
        from cupy.cuda import driver

        self._launch = driver.launchKernel
        self._first, self._first_blocks, self._threads = int(first), int(first_blocks), int(threads)
        self.programmatic = bool(programmatic)
        self._ex = _cu_launch_kernel_ex() if self.programmatic else None
        if self.programmatic and self._ex is None:
            raise RuntimeError("a programmatic launch needs the driver's cuLaunchKernelEx")
        self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        ctypes.memmove(ctypes.addressof(self._attr) + _LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
        self._configs: dict = {}  # (grid, block, shared bytes, stream) -> (config, its byref)

    def _config(self, key: tuple):
        gx, gy, gz, bx, by, bz, shared_bytes, stream = key
        c = _LaunchConfig((gx, gy, gz), (bx, by, bz), shared_bytes, stream, ctypes.pointer(self._attr), 1)
        if len(self._configs) >= 64:  # (streams come and go: keep a bounded set)
            self._configs.clear()
        entry = self._configs[key] = (c, ctypes.byref(c))
        return entry

    def __call__(self, fptr, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra) -> None:
        self._launch(self._first, self._first_blocks, 1, 1, self._threads, 1, 1, 0, stream, params, 0)
        if self._ex is None:
            self._launch(fptr, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra)
            return
        key = (gx, gy, gz, bx, by, bz, shared_bytes, stream)
        entry = self._configs.get(key)
        if entry is None:
            entry = self._config(key)
        rc = self._ex(entry[1], fptr, params, extra)
        if rc != 0:
            from cupy.cuda.driver import CUDADriverError

            raise CUDADriverError(rc)


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
