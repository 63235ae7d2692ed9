"""Loading kernels.cu: one cupy.RawModule per device, memoized; functions by name.

CuPy caches the compiled binary on disk (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``), so a new process on the same GPU skips NVRTC.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from kvaddr.errors import KernelCompileError

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
KERNEL_NAMES = (
    "kvaddr_step_i64",
    "kvaddr_step_i32",
    "kvaddr_slots_i64",
    "kvaddr_slots_i32",
    "kvaddr_where_pad",
    "kvaddr_empty",
    # kvaddr/engines/vllm.py and its three-launch baseline (the vLLM section of kernels.cu)
    "kvaddr_vllm_step",
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
    """Integer ``#define KV_*`` constants of kernels.cu (one source of truth)."""
    out = {}
    for name, value in re.findall(r"^#define (KV_[A-Z_0-9]+) (\d+)\s*$", source(), flags=re.M):
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


class Launcher:
    """One kernel's launch with a persistent, typed parameter block.

    ``cupy.cuda.Function.__call__`` converts every argument on every launch (about
    0.7 us each on an H200 host with CuPy 14); a step kernel has 31. Here each
    argument lives in a ctypes value of the kernel's exact C type (the explicit
    cast RawKernel needs), callers update only what changed, and the launch goes
    straight to ``cuLaunchKernel``, which copies the parameters, so the block can be
    reused at once (also while a CUDA graph is being captured). Not thread-safe:
    use one launcher (one planner) per thread.

    Parameters
    ----------
    fn : cupy.cuda.Function
    types : sequence of ctypes types, one per kernel parameter
    """

    def __init__(self, fn, types):
        import ctypes

        self.fn = fn
        self.values = [t() for t in types]
        self._params = (ctypes.c_void_p * len(self.values))(*[ctypes.addressof(v) for v in self.values])
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
            self.fn((grid,), (block,), numpy_args(self.values), 0, raw_stream(stream))


def numpy_args(values) -> tuple:
    """The launcher's current parameters as NumPy scalars (for Function.__call__)."""
    import ctypes

    import numpy as np

    conv = {ctypes.c_uint64: np.uint64, ctypes.c_int64: np.int64, ctypes.c_int32: np.int32}
    return tuple(conv[type(v)](v.value) for v in values)
