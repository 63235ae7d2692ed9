"""Is there a usable CUDA device? The library's check, and its answer in one sentence.

:func:`require_cuda` is the first thing every GPU object of kvaddr does
(:class:`~kvaddr.planner.StepPlanner`, the strategies of :mod:`kvaddr.strategies.gpu`):
without CuPy, an NVIDIA driver or a GPU it raises :class:`NoCudaDevice`, a
:class:`~kvaddr.errors.KvaddrError` whose message is one plain sentence, instead of
CuPy's ``ModuleNotFoundError`` or ``CUDARuntimeError``::

    kvaddr found no usable CUDA device: no NVIDIA driver; kvaddr.reference.step_addressing
    and kvaddr.strategies.cpu run on the CPU.

:func:`cuda_status` answers the same question without raising (``kvaddr info`` and the
profiler's ``--device auto`` use it through :func:`kvaddr.measure.environment.probe_cuda`).
The raw error (CuPy's exception) is kept in ``raw`` and appended to the messages when the
environment variable ``KVADDR_DEBUG`` is set (to anything but ``0``).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from kvaddr.errors import KvaddrError

#: What runs without a GPU, named in every "no usable CUDA device" message.
CPU_ALTERNATIVE = "kvaddr.reference.step_addressing and kvaddr.strategies.cpu run on the CPU"
#: The short reason when no NVIDIA driver is installed or loaded.
NO_DRIVER = "no NVIDIA driver"


def debug_enabled() -> bool:
    """True when ``KVADDR_DEBUG`` asks for raw errors and tracebacks."""
    return os.environ.get("KVADDR_DEBUG", "") not in ("", "0")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


@dataclass(frozen=True)
class CudaStatus:
    """Whether CUDA is usable, and why not when it is not.

    Attributes
    ----------
    available : bool
    device_count : int
    reason : str
        Short and plain: ``"2 CUDA device(s)"``, ``"no NVIDIA driver"``,
        ``"CuPy is not installed"``, ...
    raw : str or None
        The error behind ``reason`` (``"CUDARuntimeError: cudaErrorInsufficientDriver: ..."``).
    """

    available: bool
    device_count: int
    reason: str
    raw: str | None = None

    def explained(self) -> str:
        """``reason``, with the raw error appended when ``KVADDR_DEBUG`` is set."""
        if self.raw and debug_enabled():
            return f"{self.reason} [{self.raw}]"
        return self.reason


class NoCudaDevice(KvaddrError):
    """No usable CUDA device: CuPy missing, no NVIDIA driver, no GPU, or a CUDA runtime failure.

    Attributes
    ----------
    reason : str
        The short reason (see :class:`CudaStatus`).
    raw : str or None
        The underlying error, appended to the message when ``KVADDR_DEBUG`` is set.
    """

    def __init__(self, reason: str, raw: str | None = None):
        self.reason, self.raw = reason, raw
        detail = CudaStatus(False, 0, reason, raw).explained()
        super().__init__(f"kvaddr found no usable CUDA device: {detail}; {CPU_ALTERNATIVE}.")


def nvidia_driver_present() -> bool | None:
    """Whether an NVIDIA driver is on this machine: its kernel module, or ``libcuda`` loadable.

    True when ``/proc/driver/nvidia/version`` exists or ``libcuda.so.1`` loads; False when
    neither; None when that cannot be told (not Linux, and no libcuda found).
    """
    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False if os.name == "posix" else None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _runtime_failure(cupy, exc: BaseException) -> tuple:
    """``(reason, raw)`` for an exception of ``cudaGetDeviceCount``."""
    raw = _one_line(exc)
    m = re.search(r"cudaError\w+", str(exc))
    name = m.group(0) if m else type(exc).__name__
    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        driver = None
    if driver == 0 or (name == "cudaErrorNoDevice" and nvidia_driver_present() is False):
        return NO_DRIVER, raw
    if name == "cudaErrorInsufficientDriver":
        if driver is None and nvidia_driver_present() is False:
            return NO_DRIVER, raw
        try:
            runtime = _cuda_version(int(cupy.cuda.runtime.runtimeGetVersion()))
        except Exception:
            runtime = "?"
        have = f"CUDA {_cuda_version(driver)}" if driver else "an older CUDA"
        return f"the NVIDIA driver supports {have}, older than CuPy's CUDA runtime ({runtime})", raw
    if name == "cudaErrorNoDevice":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"the NVIDIA driver sees no GPU{hidden}", raw
    return f"the CUDA runtime failed ({name})", raw


def cuda_status() -> CudaStatus:
    """Import CuPy and count CUDA devices; never raises.

    Returns
    -------
    CudaStatus
    """
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            reason = "CuPy is not installed (pip install 'kvaddr[cuda12]' or 'kvaddr[cuda13]')"
            return CudaStatus(False, 0, reason, _one_line(exc))
        return CudaStatus(False, 0, "CuPy is installed but does not import (KVADDR_DEBUG=1 shows why)", _one_line(exc))
    except Exception as exc:  # a broken install raising anything (a missing libcudart, ...)
        return CudaStatus(False, 0, "CuPy is installed but does not import (KVADDR_DEBUG=1 shows why)", _one_line(exc))
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver or a device
        reason, raw = _runtime_failure(cupy, exc)
        return CudaStatus(False, 0, reason, raw)
    if n < 1:
        return CudaStatus(False, 0, "the CUDA runtime reports no GPU")
    return CudaStatus(True, n, f"{n} CUDA device(s)")


#: ``[cupy module, device count]`` of the last successful check (the module itself, so a
#: replaced module, a test's fake one, is checked anew).
_checked: list = [None, 0]


def require_cuda(device: int | None = None) -> int:
    """Raise :class:`NoCudaDevice` unless CuPy imports and a CUDA device (``device``, if given) exists.

    A success is remembered (for the CuPy module it saw), so calling this in every
    constructor costs one lookup after the first time.

    Parameters
    ----------
    device : int, optional
        A device ordinal that must exist.

    Returns
    -------
    int
        The number of CUDA devices.

    Raises
    ------
    NoCudaDevice
        With one sentence: no usable CUDA device, the short reason, and what runs on the CPU.
    """
    module = sys.modules.get("cupy")
    if module is not None and _checked[0] is module:
        n = _checked[1]
    else:
        status = cuda_status()
        if not status.available:
            raise NoCudaDevice(status.reason, status.raw)
        _checked[:] = [sys.modules.get("cupy"), status.device_count]
        n = status.device_count
    if device is not None and not (isinstance(device, (int, np.integer)) and 0 <= int(device) < n):
        raise NoCudaDevice(f"there is no CUDA device {device!r} (the CUDA runtime sees {n}: 0 to {n - 1})")
    return n


__all__ = ["CPU_ALTERNATIVE", "NO_DRIVER", "CudaStatus", "NoCudaDevice", "cuda_status", "require_cuda"]
