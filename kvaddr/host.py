"""The host side every planner shares: device error records, the stream of a call, the memo.

:class:`~kvaddr.planner.StepPlanner` and :class:`~kvaddr.engines.vllm.VllmStepPlanner` differ in
their contract and their kernel's parameter block; what they do around a launch is the same and
lives here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvaddr.errors import reduce_error_records
from kvaddr.validation import cupy_stream, stream_handle


class ErrorRecords:
    """A kernel's sticky error records: one ``(mask, first-bad key)`` pair of uint64 words per warp.

    A launch only adds to them (a warp with an error ORs its bits into its own record's mask and
    keeps the smaller key), so a read returns every launch's errors since the last read, and a
    read that found something resets them (docs/spec.md, "Errors").

    Parameters
    ----------
    records : cupy.ndarray, uint64
        The records on the device (any shape; read and reset whole).
    clean : numpy.ndarray, uint64
        The records' reset value (mask 0, key all ones), of the same shape.
    device : int
        The records' CUDA device.
    error : type
        The exception :meth:`check` raises, built as ``error(mask, key)``.
    """

    __slots__ = ("clean", "device", "error", "records")

    def __init__(self, records, clean: np.ndarray, device: int, error: type) -> None:
        self.records, self.clean, self.device, self.error = records, clean, int(device), error

    def read(self, stream: Any = None) -> tuple[int, int]:
        """Synchronise on ``stream`` (CuPy's current one by default); ``(error_mask, first_bad_key)``
        of every launch since the last read, then reset the records if something was set (a clean
        read launches nothing)."""
        import cupy

        handle = stream_handle(stream)
        rec = np.empty(self.records.shape, dtype=np.uint64)
        with cupy.cuda.Device(self.device):
            s = cupy_stream(handle)
            self.records.get(stream=s, out=rec)
            s.synchronize()
            mask, key = reduce_error_records(rec)
            if mask:
                self.records.set(self.clean, stream=s)  # in order before the next step on s
        return mask, key

    def check(self, stream: Any = None) -> None:
        """:meth:`read`, raising ``error(mask, key)`` if a launch since the last read found bad values."""
        mask, key = self.read(stream)
        if mask:
            raise self.error(mask, key)

    def clear(self, stream: Any = None) -> None:
        """Reset the records on ``stream`` (CuPy's current one by default), dropping errors not read
        yet; no synchronisation."""
        import cupy

        handle = stream_handle(stream)
        with cupy.cuda.Device(self.device):
            self.records.set(self.clean, stream=cupy_stream(handle))


class StreamResolver:
    """The raw ``cudaStream_t`` of a call's ``stream`` argument, cheaply on the hot path.

    A raw int is used as is; None is CuPy's current stream; a CuPy or torch stream object
    seen last time gives its remembered handle (their handles never change); a new object of
    the torch stream class seen last (``torch.cuda.current_stream()`` builds one per call)
    gives its ``cuda_stream`` int, one attribute read; anything else goes through
    :func:`kvaddr.validation.stream_handle`.
    """

    __slots__ = ("_current", "_obj", "_ptr", "_torch_cls")

    def __init__(self) -> None:
        import cupy

        self._current = cupy.cuda.get_current_stream
        self._obj: Any = None
        self._ptr = 0
        self._torch_cls: Any = None  # a torch stream class whose cuda_stream is its handle

    def __call__(self, stream: Any) -> int:
        if stream.__class__ is int:
            return stream
        if stream is None:
            return self._current().ptr
        if stream is self._obj:
            return self._ptr
        cls = stream.__class__
        if cls is self._torch_cls:
            return stream.cuda_stream
        handle = stream_handle(stream)
        mod = cls.__module__
        if mod.startswith("torch") and getattr(stream, "cuda_stream", None).__class__ is int:
            self._torch_cls = cls  # (torch.cuda.Stream, ExternalStream: cuda_stream is the handle)
        if mod.startswith(("cupy", "torch")):
            self._obj, self._ptr = stream, handle
        return handle


@dataclass(frozen=True)
class Memo:
    """A planner's memo of its last checked call, for ``compute()``'s fast path.

    ``same(*args)`` is True when a call passes the same argument objects with unchanged
    signatures (:func:`kvaddr.validation.memo_guard`): every check would pass as it did and the
    parameter block already holds them, so the call only launches ``function`` with ``blocks``
    x ``threads`` from ``params_ptr`` (through ``launch_kernel``, ``cuLaunchKernel``; ``launcher``
    when the fast launch is not available).
    """

    same: Callable[..., bool]
    size: int
    blocks: int
    threads: int
    launch_kernel: Callable | None
    function: int
    params_ptr: int
    launcher: Callable
    extra: Any = None
