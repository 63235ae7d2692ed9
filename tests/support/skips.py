"""Why tests skip: one wording per cause, shared by every skip site and by the grouped summary.

Each cause has one sentence (what is missing, then what is skipped) and, where one exists, a marker
to put on a test or a module (``pytestmark = requires_gpu``). ``tests/conftest.py`` prints the
skipped tests grouped by cause, one line each with a count; :func:`cause` maps a skip reason to its
cause's wording (a reason written some other way, e.g. by ``pytest.importorskip``, is mapped too).
"""

from __future__ import annotations

import os
import shutil

import pytest

TOOLCHAIN_ENV = "KVADDR_TOOLCHAIN_TESTS"

NO_CUPY = "CuPy is not installed (pip install 'kvaddr[cuda12]'): GPU tests skipped"
NO_GPU = "no CUDA device: GPU tests skipped"
NO_TORCH = "PyTorch is not installed: torch op tests skipped"
NO_TORCH_CUDA = "torch sees no CUDA device: GPU torch op tests skipped"
NO_PLOT = "matplotlib is not installed (pip install 'kvaddr[plot]'): plot tests skipped"
NO_CXX = "no C++ compiler (g++ or c++ on PATH): kernel emulation tests skipped"
NO_CXX20 = "no C++20 compiler with <barrier>: attention kernel emulation tests skipped"
NO_NVCC = "nvcc not found on PATH: toolchain checks skipped"
TOOLCHAIN_OPT_IN = f"toolchain checks (nvcc) are opt-in: --run-toolchain or {TOOLCHAIN_ENV}=1"
INDUCTOR_OPT_IN = "inductor on the CPU compiles C++ for ~30 s: opt-in with KVADDR_TEST_INDUCTOR=1"
NO_DEV_FULL = "no /dev/full on this system: full-disk tests skipped"

NVCC = shutil.which("nvcc")


def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here (None: they can)."""
    try:
        import cupy
    except ImportError:
        return NO_CUPY
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device
        return NO_GPU
    return None if n > 0 else NO_GPU


def torch_skip_reason() -> str | None:
    """Why the torch-op tests cannot run here (None: they can)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return NO_TORCH
    return None


def cuda_torch_skip_reason() -> str | None:
    """Why the torch-op tests on the GPU cannot run here (None: they can)."""
    why = torch_skip_reason()
    if why:
        return why
    import torch

    if not torch.cuda.is_available():
        return NO_TORCH_CUDA
    try:
        import cupy  # noqa: F401
    except ImportError:
        return NO_CUPY
    return None


def plot_skip_reason() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return NO_PLOT
    return None


def toolchain_opted_in(config) -> bool:
    """``--run-toolchain`` given, or ``KVADDR_TOOLCHAIN_TESTS=1``."""
    return bool(config.getoption("--run-toolchain", default=False)) or os.environ.get(TOOLCHAIN_ENV) == "1"


def skip_unless(reason: str | None):
    """A skipif marker that skips with ``reason`` when it is not None."""
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def requires_plot():
    """Skip the calling test when matplotlib is missing (call it first thing in the test)."""
    why = plot_skip_reason()
    if why:
        pytest.skip(why)


requires_gpu = skip_unless(gpu_skip_reason())
requires_torch = skip_unless(torch_skip_reason())
requires_cuda_torch = skip_unless(cuda_torch_skip_reason())
requires_dev_full = skip_unless(None if os.path.exists("/dev/full") else NO_DEV_FULL)


def requires_cxx(cxx):
    """Skip unless ``cxx`` (an emulator module's compiler path) is set."""
    return skip_unless(None if cxx else NO_CXX)


#: Other wordings of a cause (``pytest.importorskip``'s, older ones) -> the cause's one wording.
_PATTERNS = (
    ("nvcc not found", NO_NVCC),
    ("could not import 'torch'", NO_TORCH),
    ("PyTorch is not installed", NO_TORCH),
    ("could not import 'matplotlib'", NO_PLOT),
    ("matplotlib is not installed", NO_PLOT),
    ("CuPy is not installed", NO_CUPY),
    ("could not import 'cupy'", NO_CUPY),
    ("no CUDA device", NO_GPU),
    ("no C++ compiler", NO_CXX),
    ("no g++", NO_CXX),
)


def cause(reason: str) -> str:
    """A skip reason as its cause's one wording (unknown reasons unchanged)."""
    for pattern, wording in _PATTERNS:
        if pattern in reason:
            return wording
    return reason
