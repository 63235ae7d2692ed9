"""The source of v9's ablation module (benchmarks/ablate_v9.py, tests/gpu/test_ablate_v9_gpu.py,
tests/unit/test_ablation_kernels_compile.py): kernels.cu with ``KV_ABLATION`` defined, cut to what
the small-batch step needs (the header and shared helpers, then the v9 section with its ablation
kernels), so the GPU check compiles it quickly. One string for all three, so CuPy's kernel cache
compiles it once per machine."""

from __future__ import annotations

from kvaddr import kernel_loader

#: Where the kept parts of kernels.cu start and end (section markers of the file).
HEAD_END = "// ---- large batch (bsz > KV_TILE)"
V9_START = "// ---- v9: the small-batch step"
V9_END = "// BASELINE (MEASUREMENT) KERNELS"
#: The section after v9's ablation kernels (the small-batch step with attention outputs) is not kept.
V9M_START = "// ---- v9m: the small-batch step with attention outputs"


def ablation_source(source: str | None = None) -> str:
    """``#define KV_ABLATION 1`` + kernels.cu's head (up to the large-batch path) + its v9 section."""
    src = kernel_loader.source() if source is None else source
    head = src[: src.index(HEAD_END)]
    end = src.index(V9M_START) if V9M_START in src else src.index(V9_END)
    v9 = src[src.index(V9_START) : src.rindex("\n", 0, end)]
    return "#define KV_ABLATION 1\n" + head + v9 + "\n"
