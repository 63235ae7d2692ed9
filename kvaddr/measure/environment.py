"""What machine a measurement ran on: CUDA device probing and version strings.

Nothing here raises: a missing CuPy, driver or GPU is reported as a reason.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvaddr.errors import EnvironmentProblem


@dataclass(frozen=True)
class CudaProbe:
    """Whether a CUDA device is usable, and why not when it is not."""

    available: bool
    device_count: int
    reason: str


def probe_cuda() -> CudaProbe:
    """Import CuPy and count CUDA devices, catching every failure.

    The reason is :func:`kvaddr.device.cuda_status`'s short one (``"no NVIDIA driver"``,
    ``"CuPy is not installed (...)"``), with the raw error appended when ``KVADDR_DEBUG`` is set.
    """
    from kvaddr.device import cuda_status

    status = cuda_status()
    return CudaProbe(status.available, status.device_count, status.explained())


def use_gpu(device: str) -> tuple:
    """Resolve a ``device`` setting (``auto``, ``cuda`` or ``cpu``).

    Returns
    -------
    (bool, str or None)
        True for the GPU; with ``auto`` and no usable GPU, False and why
        (None otherwise).

    Raises
    ------
    EnvironmentProblem
        ``cuda`` without a usable GPU.
    """
    if device == "cpu":
        return False, None
    probe = probe_cuda()
    if device == "cuda" and not probe.available:
        raise EnvironmentProblem(f"--device cuda: no CUDA device found: {probe.reason}")
    return probe.available, (None if probe.available else probe.reason)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _cuda_version(v: int) -> str:
    """12040 -> '12.4'."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def kvaddr_version() -> str:
    try:
        from kvaddr import __version__

        return str(__version__)
    except Exception:
        pass
    try:
        from importlib.metadata import version

        return version("kvaddr")
    except Exception:
        return "unknown"


def git_commit() -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout kvaddr runs from."""
    root = Path(__file__).resolve().parents[2]  # the checkout holding kvaddr/
    out = {"commit": None, "dirty": None}
    if not (root / ".git").exists():
        return out
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            out["commit"] = sha.stdout.strip()
        st = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if st.returncode == 0 and out["commit"] is not None:
            out["dirty"] = bool(st.stdout.strip())
    except Exception:
        pass
    return out


def kernel_cache_dir() -> str:
    """CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def kernel_cache_summary() -> str:
    """CuPy's kernel cache in a few words: where it is and what it holds.

    The first planner on a machine compiles the kernels it needs into this folder; later
    processes load them from it without compiling.
    """
    d = kernel_cache_dir()
    if not os.path.isdir(d):
        return f"{d} (empty: the first planner compiles its kernels, a few seconds)"
    files = [os.path.join(d, f) for f in os.listdir(d)]
    files = [f for f in files if os.path.isfile(f)]
    size = sum(os.path.getsize(f) for f in files)
    return f"{d} ({len(files)} compiled modules, {size / 2**20:.1f} MiB)"


def gpu_list() -> list:
    """Name, compute capability and memory of each CUDA device ([] without CuPy or devices)."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return []
    gpus = []
    for i in range(n):
        try:
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props.get("name", b"?")
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "compute_capability": f"{props.get('major', '?')}.{props.get('minor', '?')}",
                    "total_memory_bytes": int(props.get("totalGlobalMem", 0)),
                    "multiprocessors": int(props.get("multiProcessorCount", 0)),
                }
            )
        except Exception as exc:
            gpus.append({"index": i, "error": _one_line(exc)})
    return gpus


def cuda_versions() -> dict:
    """Driver, runtime, NVRTC and CuPy versions (None where unknown; ``cuda_driver`` None without a driver)."""
    out = {"cupy": None, "cuda_driver": None, "cuda_runtime": None, "nvrtc": None}
    try:
        import cupy
    except Exception:
        return out
    out["cupy"] = getattr(cupy, "__version__", None)
    for key, fn in (("cuda_driver", "driverGetVersion"), ("cuda_runtime", "runtimeGetVersion")):
        try:
            v = int(getattr(cupy.cuda.runtime, fn)())
        except Exception:
            continue
        # cudaDriverGetVersion gives 0 when no NVIDIA driver is installed: no version, not "0.0".
        out[key] = _cuda_version(v) if v > 0 else None
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception:
        pass
    return out


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``"580.159.04"``), or None where unknown.

    Read from ``/proc/driver/nvidia/version``, else asked of ``nvidia-smi``.
    """
    import re

    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as fh:
            m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", fh.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except Exception:
        pass
    return None


def environment_record(device: str, device_id: int | None = None) -> dict:
    """The ``environment`` object of the JSON report.

    Parameters
    ----------
    device : str
        ``"cuda"`` or ``"cpu"``: where the strategies ran.
    device_id : int, optional
        The CUDA device measured.
    """
    env = {
        "device": device,
        "gpu": None,
        "driver_version": None,
        **cuda_versions(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "kvaddr": kvaddr_version(),
        **{f"git_{k}": v for k, v in git_commit().items()},
    }
    if device == "cuda":
        gpus = gpu_list()
        index = 0 if device_id is None else device_id
        env["gpu"] = next((g for g in gpus if g.get("index") == index), None)
        env["driver_version"] = nvidia_driver_version()
    return env


def compile_check(device_id: int = 0) -> tuple:
    """Compile kernels.cu for a device: ``(ok, message)``, message the NVRTC log on failure."""
    import time

    try:
        import cupy

        from kvaddr import kernel_loader
        from kvaddr.errors import KernelCompileError
    except Exception as exc:
        return False, f"cannot load the kernel module ({_one_line(exc)})"
    t0 = time.perf_counter()
    try:
        with cupy.cuda.Device(device_id):
            kernel_loader.load_kernels(("step_small<1, long long>",), device_id)  # a library kernel
            kernel_loader.get_module(device_id)  # the baselines
    except KernelCompileError as exc:
        return False, str(exc)
    except Exception as exc:
        return False, _one_line(exc)
    return True, f"compiles ({time.perf_counter() - t0:.2f} s, kernel cache included)"


def python_info() -> dict:
    return {"python": sys.version.split()[0], "numpy": np.__version__, "kvaddr": kvaddr_version()}
