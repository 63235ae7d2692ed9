"""``VllmStepPlanner(error_records=...)`` on the GPU: the step's error records in a caller's
CuPy or torch array (what the torch op ``kvaddr::vllm_step_into`` does with a view of its storage),
equal word for word to the planner's own records and reduced by ``errors()`` like the reference;
sticky (only a warp with an error writes; ``errors()`` clears them, and so does the caller who
reads them itself, with ``kvaddr.errors.reset_error_records``); the attention kernel
(``vllm_step<true>``) too; bad arrays refused naming the argument. Skips without a GPU (the torch rows without torch)."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY, VllmAddressingError
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import corrupt, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


def _device(inputs):
    import cupy

    return {k: ([cupy.asarray(x) for x in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in inputs.items()}


def _records(kind, shape):
    """A caller's records array, filled with garbage (the planner clears it at construction)."""
    import cupy

    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
        return torch.full(shape, 0x5A5A5A5A, dtype=torch.int64, device="cuda")
    dtype = np.int64 if kind == "cupy-int64" else np.uint64
    return cupy.full(shape, 0x5A5A5A5A, dtype=dtype)


def _words(x) -> np.ndarray:
    import cupy

    if type(x).__module__.startswith("torch"):
        return x.cpu().numpy().view(np.uint64)
    return cupy.asnumpy(x).view(np.uint64)


@pytest.mark.parametrize("kind", ["cupy-int64", "cupy-uint64", "torch"])
@pytest.mark.parametrize("seed", range(3))
def test_caller_records_equal_the_planners_own_and_the_reference(kind, seed):
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(40 + seed)
    cfg, inputs = random_case(
        rng,
        max_num_reqs=300,
        num_reqs=260,
        block_sizes=(16, 64),
        max_query=5,
        slot_dtype=[np.int64, np.int32][seed % 2],
    )
    kw = planner_kwargs(cfg)
    shape = VllmStepPlanner.error_records_shape(cfg.max_num_reqs, cfg.max_num_batched_tokens)
    rec = _records(kind, shape)
    mine = VllmStepPlanner(**kw, error_records=rec)
    own = VllmStepPlanner(**kw)
    assert own._records.shape == shape
    # cleared at construction: (0, no error) in every record of the caller's array
    w = _words(rec)
    assert (w[:, 0] == 0).all() and (w[:, 1] == VLLM_NO_ERROR_KEY).all()
    assert mine.errors() == (0, VLLM_NO_ERROR_KEY)
    for k, step in enumerate([corrupt(rng, cfg, inputs, rate=0.1), new_batch(rng, cfg, inputs, num_reqs=100)]):
        d = _device(step)
        want = vllm_step_reference(cfg, **step, num_reqs_padded=None)
        for p in (mine, own):
            p.compute(*(d[n] for n in NAMES))
        cupy.cuda.runtime.deviceSynchronize()
        np.testing.assert_array_equal(_words(rec), cupy.asnumpy(own._records), f"step {k}")
        assert mine.errors() == own.errors() == (want.error_mask, want.error_key), f"step {k}"
        w = _words(rec)  # read and cleared by errors()
        assert (w[:, 0] == 0).all() and (w[:, 1] == VLLM_NO_ERROR_KEY).all(), f"step {k}"
        if want.error_mask:
            # sticky: the bad step, then a good one: check() still sees the bad one
            for s in (step, inputs):
                ds = _device(s)
                mine.compute(*(ds[n] for n in NAMES))
            with pytest.raises(VllmAddressingError):
                mine.check()
            mine.check()  # cleared by the first check()


@pytest.mark.parametrize("kind", ["cupy-int64", "torch"])
def test_caller_records_read_by_the_caller_are_reset_with_the_helper(kind):
    """The caller reads its records itself (kvaddr.errors.reduce_error_records) and resets them
    (reset_error_records): the next read sees only the steps after the reset."""
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.errors import reduce_error_records, reset_error_records

    rng = np.random.default_rng(77)
    cfg, inputs = random_case(rng, max_num_reqs=40, num_reqs=30, block_sizes=(16,), max_query=3)
    kw = planner_kwargs(cfg)
    rec = _records(kind, VllmStepPlanner.error_records_shape(cfg.max_num_reqs, cfg.max_num_batched_tokens))
    planner = VllmStepPlanner(**kw, error_records=rec)
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    want = vllm_step_reference(cfg, **bad, num_reqs_padded=None)
    assert want.error_mask
    for s in (bad, inputs):
        d = _device(s)
        planner.compute(*(d[n] for n in NAMES))
    cupy.cuda.runtime.deviceSynchronize()
    assert reduce_error_records(_words(rec)) == (want.error_mask, want.error_key)
    reset_error_records(rec)  # on the array library's current stream
    cupy.cuda.runtime.deviceSynchronize()
    d = _device(inputs)
    planner.compute(*(d[n] for n in NAMES))
    cupy.cuda.runtime.deviceSynchronize()
    assert reduce_error_records(_words(rec)) == (0, VLLM_NO_ERROR_KEY)


def test_records_of_both_kernels_are_sticky():
    """The attention kernel (``vllm_step<true>``) writes its metadata blocks' records the same way:
    a bad step, a good one, then errors(): the bad step's; two bad steps: the OR of the bits, the min key."""
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(5)
    cfg, inputs = random_case(rng, max_num_reqs=60, num_reqs=50, block_sizes=(16, 8), max_query=4)
    for attention in (None, "flashinfer,varlen"):
        extra = {} if attention is None else dict(attention=attention, kv_indices_capacity=4096)
        planner = VllmStepPlanner(**planner_kwargs(cfg), **extra)
        bads = []
        while len(bads) < 2:
            b = corrupt(rng, cfg, inputs, rate=0.1)
            w = vllm_step_reference(cfg, **b, attention=attention, kv_indices_capacity=extra.get("kv_indices_capacity"))
            if w.error_mask and all(w.error_mask != x[1].error_mask for x in bads):
                bads.append((b, w))
        (b1, w1), (b2, w2) = bads
        for s in (b1, inputs):
            d = _device(s)
            planner.compute(*(d[n] for n in NAMES))
        cupy.cuda.runtime.deviceSynchronize()
        assert planner.errors() == (w1.error_mask, w1.error_key), attention
        assert planner.errors() == (0, VLLM_NO_ERROR_KEY), attention
        for s in (b1, b2, inputs):
            d = _device(s)
            planner.compute(*(d[n] for n in NAMES))
        cupy.cuda.runtime.deviceSynchronize()
        want = (w1.error_mask | w2.error_mask, min(w1.error_key, w2.error_key))
        assert planner.errors() == want, attention


def test_bad_error_records_are_refused_on_the_gpu():
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    kw = dict(max_num_reqs=4, max_num_batched_tokens=600, block_sizes=[4], widths=[4])
    R = VllmStepPlanner.error_records_shape(4, 600)[0]
    rows = [
        (np.zeros((R, 2), np.int64), TypeError, "error_records must be a CUDA array"),
        (cupy.zeros((R, 2), np.int32), TypeError, "got dtype int32"),
        (cupy.zeros((R + 1, 2), np.int64), ValueError, rf"of shape \({R}, 2\), got shape \({R + 1}, 2\)"),
        (cupy.zeros((2 * R, 2), np.int64)[::2], ValueError, r"C-contiguous .* got strides \(4, 1\)"),
    ]
    for x, exc, msg in rows:
        with pytest.raises(exc, match=msg):
            VllmStepPlanner(**kw, error_records=x)
