"""kvaddr/kernels.cu with its ``#include "kernels/NAME.cuh"`` lines expanded in place: the text
the loader compiles (``kvaddr.kernel_loader.source``), what tests that read the CUDA source search."""

from __future__ import annotations

from kvaddr import kernel_loader

KERNELS_CU = kernel_loader.SOURCE_PATH


def expand() -> str:
    """The expanded source, exactly as the loader compiles it."""
    return kernel_loader.source()
