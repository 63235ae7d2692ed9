"""kvaddr/kernels.cu with its ``#include "kernels/NAME.cuh"`` lines expanded (recursively, in
place), the text the loader compiles: what tests that read the CUDA source search."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS_CU = Path(__file__).resolve().parents[2] / "kvaddr" / "kernels.cu"
_INCLUDE = re.compile(r'^#include "(kernels/[A-Za-z0-9_]+\.cuh)"[ \t]*$', flags=re.M)


def expand(path: Path = KERNELS_CU) -> str:
    """The source at path with every ``#include "kernels/..."`` line replaced by that header's
    expanded text (relative to kernels.cu's folder)."""
    root = KERNELS_CU.parent
    return _INCLUDE.sub(lambda m: expand(root / m.group(1)).rstrip("\n"), Path(path).read_text())


def headers() -> list:
    """The headers kernels.cu includes, in order (kvaddr/kernels/NAME.cuh paths)."""
    return [KERNELS_CU.parent / h for h in _INCLUDE.findall(KERNELS_CU.read_text())]
