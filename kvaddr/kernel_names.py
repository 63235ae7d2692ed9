"""The kernels of kvaddr/kernels.cu, by the names the loader compiles them under.

``LIBRARY_KERNELS`` are template kernels, named by their CuPy ``name_expressions``
(compiled one module per set a planner needs, on first use); ``BASELINE_KERNELS`` are the
``extern "C"`` kernels the profiler compares the library against (one module, compiled
with ``-DKV_BASELINES`` when a baseline strategy first runs).
"""

from __future__ import annotations

_POS = ("long long", "int")
_CACHES = range(5)

LIBRARY_KERNELS: tuple[str, ...] = (
    *(f"step_multiblock<{p}>" for p in _POS),
    *(f"step_small<{g}, {p}>" for p in _POS for g in _CACHES),
    *(f"step_small_attention<{g}, {p}>" for p in _POS for g in _CACHES),
    *(f"step_wide<{g}, {p}, {r}>" for r in (4, 8, 16) for p in _POS for g in _CACHES),
    *(f"step_wide_attention<{g}, {p}>" for p in _POS for g in _CACHES),
    "vllm_step<false>",
    "vllm_step<true>",
)

BASELINE_KERNELS: tuple[str, ...] = (
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
    "kvaddr_vllm3_prepare",
    "kvaddr_vllm3_gather",
    "kvaddr_vllm3_slots",
)
