"""Shared by the GPU tests: why they skip, and running a strategy against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.skips import gpu_skip_reason, requires_gpu  # noqa: F401  (the GPU tests import them from here)

SKIP_REASON = gpu_skip_reason()


def to_device(case):
    import cupy

    out = dict(case)
    for k in ("seq_lens_decoder", "seq_lens_this_time", "seq_lens_encoder"):
        if out.get(k) is not None:
            out[k] = cupy.asarray(out[k])
    t = case["block_tables"]
    if isinstance(t, (list, tuple)):
        conv, seen = [], {}
        for x in t:
            if id(x) not in seen:
                seen[id(x)] = _table_to_device(x)
            conv.append(seen[id(x)])
        out["block_tables"] = conv
    else:
        out["block_tables"] = _table_to_device(t)
    cupy.cuda.runtime.deviceSynchronize()  # tests launch on other (non-blocking) streams
    return out


def device_copy(x):
    """NumPy inputs (an array, or a list or dict of arrays and lists of arrays) as CuPy arrays, the
    copies finished. CuPy copies on its current stream, and a copy from pageable host memory may
    still be in flight when it returns; the tests launch on non-blocking streams, which do not
    wait for that stream, so a launch could read the inputs before they land."""
    import cupy

    def one(a):
        return [cupy.asarray(b) for b in a] if isinstance(a, (list, tuple)) else cupy.asarray(a)

    out = {k: one(v) for k, v in x.items()} if isinstance(x, dict) else one(x)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def _table_to_device(t):
    """Keep row-strided host views row-strided on the device (last dim contiguous)."""
    import cupy

    if t.base is not None and t.strides[0] != t.shape[1] * 4 and t.ndim == 2:
        wide = cupy.asarray(np.ascontiguousarray(t.base)) if t.base.ndim == 2 else None
        if wide is not None and wide.shape[0] == t.shape[0]:
            return wide[:, : t.shape[1]]
    return cupy.asarray(np.ascontiguousarray(t))


def reference(case, position_dtype=np.int64, attention=None):
    """The NumPy reference's step for ``case``; with ``attention`` (groups), also those outputs,
    with the case's ``kv_indices_capacity``."""
    from kvaddr.reference import step_addressing

    return step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
        position_dtype=position_dtype,
        attention=attention,
        kv_indices_capacity=case["kv_indices_capacity"] if attention else None,
    )


def assert_outputs_equal(got, ref, label):
    from kvaddr.outputs import OUTPUT_FIELDS

    for f in OUTPUT_FIELDS:
        g = getattr(got, f)
        g = g.get() if hasattr(g, "get") else np.asarray(g)
        r = getattr(ref, f)
        assert g.dtype == r.dtype, f"{label}: {f} dtype {g.dtype} != {r.dtype}"
        assert g.shape == r.shape, f"{label}: {f} shape {g.shape} != {r.shape}"
        if not np.array_equal(g, r):
            bad = np.argwhere(g != r)[0]
            raise AssertionError(f"{label}: {f} differs at {tuple(bad)}: got {g[tuple(bad)]}, want {r[tuple(bad)]}")


def assert_attention_equal(got, want, label):
    """Every field of two AttentionOutputs (device or host) equal, dtype and shape included."""
    from kvaddr.outputs import ATTENTION_FIELDS

    for f in ATTENTION_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f"{label}: {f} is {g!r}, want {w!r}"
        if w is None:
            continue
        pairs = list(zip(g, w)) if f == "page_table" else [(g, w)]
        if f == "page_table":
            assert len(g) == len(w), f"{label}: page_table has {len(g)} caches, want {len(w)}"
        for x, y in pairs:
            x = x.get() if hasattr(x, "get") else np.asarray(x)
            y = np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, f"{label}: {f} {x.dtype}{x.shape} != {y.dtype}{y.shape}"
            if not np.array_equal(x, y):
                bad = tuple(np.argwhere(x != y)[0]) if x.ndim else ()
                raise AssertionError(f"{label}: {f} differs at {bad}: got {x[bad]}, want {y[bad]}")


#: The planner's attention buffers (StepPlanner attributes; None when not asked for).
ATTENTION_BUFFERS = ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen")


def poison(strategy):
    """Fill every output buffer a strategy owns with garbage, so unwritten elements show."""
    planner = getattr(strategy, "planner", None) or getattr(strategy, "positions", None) or strategy
    for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping"):
        buf = getattr(planner, name)
        if buf.size:
            buf.fill(0x5A5A5A5A)
    planner.num_tokens.fill(-77)
    if hasattr(strategy, "slot_mapping") and strategy.slot_mapping is not planner.slot_mapping:
        strategy.slot_mapping.fill(0x5A5A5A5A)
    # attention outputs: the fused planner's buffers, or a baseline's EngineAttention buffers
    for owner in (planner, getattr(strategy, "_engine", None)):
        for name in ATTENTION_BUFFERS:
            buf = getattr(owner, name, None) if owner is not None else None
            if buf is not None and buf.size:
                buf.fill(0x5A5A5A5A)


def multiblock_launch(planner, bsz: int) -> tuple:
    """``(launcher, blocks, threads)`` of ``step_multiblock`` for ``bsz`` requests on ``planner``'s
    parameter block and device state: a test-only path (the dispatch table runs that kernel above
    4096 requests only) so that the GPU tests check it at every batch size. Its grid is the
    table's (``dispatch.multiblock_blocks``); its records fit the planner's (``step_records``
    sizes them for every kernel, this one at any bsz <= max_requests)."""
    import dataclasses

    from kvaddr import dispatch, kernel_loader

    cfg = planner.config
    plans = planner.__dict__.setdefault("_multiblock_plans", {})
    plan = plans.get(bsz)
    if plan is None:
        big = dataclasses.replace(cfg, max_requests=max(cfg.max_requests, dispatch.WIDE_MAX_REQUESTS + 1))
        name = plans["kernel"] = dispatch.step_launch(big, big.max_requests).kernel  # the table's multi-block kernel
        launcher = plans.get(name)
        if launcher is None:
            fn = kernel_loader.load_kernels((name,), planner.device)[name]
            launcher = plans[name] = kernel_loader.Launcher(fn, planner._params, by_value=True)
        plan = plans[bsz] = (launcher, dispatch.multiblock_blocks(cfg, bsz), dispatch.THREADS)
    return plan


def _multiblock_kernel_for(planner, bsz: int) -> tuple:
    _, blocks, threads = multiblock_launch(planner, bsz)
    return planner.__dict__["_multiblock_plans"]["kernel"], blocks, threads


def force_multiblock(planner, on: bool = True):
    """Run every batch of ``planner`` on ``step_multiblock`` (:func:`multiblock_launch`;
    ``kernel_for`` says so), or (``on=False``) on the dispatch table's kernels again. Returns
    the planner."""
    import types

    if on:
        planner._launch_plan = types.MethodType(multiblock_launch, planner)
        planner.kernel_for = types.MethodType(_multiblock_kernel_for, planner)
    else:
        planner.__dict__.pop("_launch_plan", None)
        planner.__dict__.pop("kernel_for", None)
    planner._memo = None  # the memo holds the last call's launch
    return planner


def kernel_choice_fixture():
    """A module-scoped autouse fixture that runs every test of the module twice: with the
    dispatch table's kernels (id "dispatch") and with every batch of every StepPlanner
    (strategies' included) on ``step_multiblock`` (id "multiblock", :func:`multiblock_launch`),
    so the multi-block kernel and its metadata blocks meet the same cases as the others. Module
    scope: hypothesis tests accept it (no function-scoped fixture)."""

    @pytest.fixture(scope="module", autouse=True, params=["dispatch", "multiblock"])
    def kernel_choice(request):
        from kvaddr.planner import StepPlanner

        if request.param == "dispatch":
            yield request.param
            return
        saved = StepPlanner._launch_plan, StepPlanner.kernel_for
        StepPlanner._launch_plan, StepPlanner.kernel_for = multiblock_launch, _multiblock_kernel_for
        try:
            yield request.param
        finally:
            StepPlanner._launch_plan, StepPlanner.kernel_for = saved

    return kernel_choice
