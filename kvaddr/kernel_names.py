"""The kernels of kernels.cu by name: one place for the loader, the dispatch table and the tests.

``LIBRARY_KERNELS``: the CuPy ``name_expressions`` of the library's template kernels (a module
compiles only the instantiations it names). ``BASELINE_KERNELS``: the ``extern "C"`` kernels the
profiler measures the library against, compiled only with ``-DKV_BASELINES``.
"""

from __future__ import annotations

_POS = ("long long", "int")
_CACHES = range(5)

_STEP_KERNELS: tuple[str, ...] = (
    *(f"step_multiblock<{pos}>" for pos in _POS),
    *(f"step_small<{g}, {pos}>" for pos in _POS for g in _CACHES),
    *(f"step_small_attention<{g}, {pos}>" for pos in _POS for g in _CACHES),
    *(f"step_wide<{g}, {pos}, {r}>" for r in (4, 8, 16) for pos in _POS for g in _CACHES),
    *(f"step_wide_attention<{g}, {pos}>" for pos in _POS for g in _CACHES),
)


def with_dsa(kernel: str) -> str:
    """The step kernel ``kernel`` (core or vLLM) that also writes the DSA outputs (its ``DSA = true``
    instantiation: a second grid row of DSA blocks, kvaddr/kernels/dsa_step.cuh, vllm_dsa.cuh)."""
    return kernel[:-1] + ", true>"


LIBRARY_KERNELS: tuple[str, ...] = (
    *_STEP_KERNELS,
    *(with_dsa(k) for k in _STEP_KERNELS if "<0," not in k),  # DSA needs a cache
    *(f"mtp_step<{pos}>" for pos in _POS),
    "vllm_step<false>",
    "vllm_step<true>",
    *(with_dsa(f"vllm_step<{a}>") for a in ("false", "true")),  # the vLLM step with DSA outputs
    # num_blocks in pinned host memory: the copy into device memory, then the step reading the copy
    # (its STAGED = true instantiation; dispatch.vllm_staged_kernels)
    *(f"vllm_stage_num_blocks<{g}>" for g in range(1, 5)),
    *(f"vllm_step<{a}, {d}, true>" for a in ("false", "true") for d in ("false", "true")),
    *(f"dsa_topk_slots<{c}, {v}>" for c in ("false", "true") for v in (1, 4)),
    "dsa_topk_slots_pow2<false>",
    "dsa_topk_slots_pow2<true>",
    "vllm_draft_step<false>",
    "vllm_draft_step<true>",
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
    "kvaddr_mtp_substep_lengths",
    "kvaddr_vllm3_prepare",
    "kvaddr_vllm3_gather",
    "kvaddr_vllm3_slots",
    "kvaddr_dsa_topk_baseline",
    "kvaddr_draft_first",
    "kvaddr_draft_prepare",
    "kvaddr_draft_slots",
    "kvaddr_draft_meta",
)
