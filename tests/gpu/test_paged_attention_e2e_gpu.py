"""Attention metadata from StepPlanner on the GPU (docs/attention.md): against the NumPy
reference on mixed batches, every element written (poisoned buffers, graph replay), and
the end-to-end paged-attention test with PyTorch's scaled_dot_product_attention.

Skips, with the reason, without a GPU, without PyTorch, or while StepPlanner has no
``attention`` option (the kernel gains the outputs in phase 2 of issue 14).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings

from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.gpu import requires_gpu, to_device
from tests.support.paged_attention import Simulation, TorchBackend, run_e2e

pytestmark = requires_gpu


def _planner_class():
    from kvaddr.planner import StepPlanner

    params = inspect.signature(StepPlanner).parameters
    if "attention" not in params or "kv_indices_capacity" not in params:
        pytest.skip("StepPlanner has no attention= / kv_indices_capacity= option yet (issue 14, phase 2)")
    return StepPlanner


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _reference(case):
    from kvaddr.reference import step_addressing

    return step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
        attention=case["attention"],
        kv_indices_capacity=case["kv_indices_capacity"],
    )


def _planner_step(case, planner=None):
    StepPlanner = _planner_class()
    if planner is None:
        planner = StepPlanner(
            max_requests=max(len(case["seq_lens_decoder"]), 1),
            capacity=case["capacity"],
            block_sizes=case["block_sizes"],
            attention=case["attention"],
            kv_indices_capacity=case["kv_indices_capacity"],
        )
    dev = to_device(case)
    out = planner.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    mask, key = planner.errors()
    return planner, out, mask, key, dev


def _assert_attention_equal(got, want, label):
    from kvaddr.outputs import ATTENTION_FIELDS

    for f in ATTENTION_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f"{label}: {f} is {g!r}, want {w!r}"
        if w is None:
            continue
        if f == "page_table":
            assert len(g) == len(w)
            for x, y in zip(g, w):
                np.testing.assert_array_equal(_host(x), y, err_msg=f"{label}: page_table")
            continue
        g = _host(g)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{label}: {f} {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        np.testing.assert_array_equal(g, w, err_msg=f"{label}: {f}")


def _check_errors(mask, key, ref, label):
    from kvaddr import attention_reference

    assert mask == ref.error_mask, f"{label}: error bits {mask} != {ref.error_mask}"
    if ref.error_mask:
        # phase 2 moves attention_reference's key layout (3-bit bit field) into kvaddr.errors
        assert attention_reference.decode_error_key(key) == ref.first_bad, f"{label}: first bad record"


@settings(max_examples=200, deadline=None)
@given(mixed_cases())
def test_planner_attention_matches_the_reference(case):
    ref = _reference(case)
    _, out, mask, key, _ = _planner_step(case)
    _assert_attention_equal(out.attention, ref.outputs.attention, "mixed")
    _check_errors(mask, key, ref, "mixed")


@pytest.mark.parametrize("bsz", [4097, 6000])
def test_planner_attention_large_batches(bsz):
    case = make_case(np.random.default_rng(bsz), bsz=bsz, block_sizes=[16, 64, 3], max_ctx=300, spare_capacity=5)
    ref = _reference(case)
    _, out, mask, key, _ = _planner_step(case)
    _assert_attention_equal(out.attention, ref.outputs.attention, f"bsz {bsz}")
    _check_errors(mask, key, ref, f"bsz {bsz}")
    over = dict(case, kv_indices_capacity=case["kv_indices_capacity"] - 100)
    ref = _reference(over)
    _, out, mask, key, _ = _planner_step(over)
    _assert_attention_equal(out.attention, ref.outputs.attention, f"bsz {bsz}, over capacity")
    _check_errors(mask, key, ref, f"bsz {bsz}, over capacity")


def test_every_element_is_written_on_every_call():
    """A big step then a small one on the same planner: no stale entry survives (pad -1)."""
    rng = np.random.default_rng(7)
    big = make_case(rng, bsz=300, block_sizes=[4, 16], spare_capacity=0)
    small = make_case(rng, bsz=5, block_sizes=[4, 16], spare_capacity=0)
    small = dict(small, kv_indices_capacity=big["kv_indices_capacity"], capacity=big["capacity"])
    planner, *_ = _planner_step(big)  # the planner's buffers now hold the big step
    _, out, mask, key, _ = _planner_step(small, planner)
    _check_errors(mask, key, _reference(small), "small after big")
    ref = _reference(small)
    _assert_attention_equal(out.attention, ref.outputs.attention, "small after big")


def test_off_by_default_and_graph_capture():
    import cupy

    StepPlanner = _planner_class()
    plain = StepPlanner(max_requests=8, capacity=16, block_sizes=[4])
    case = make_case(np.random.default_rng(1), bsz=8, block_sizes=[4], spare_capacity=3)
    dev = to_device(case)
    assert plain.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"]).attention is None

    planner = StepPlanner(
        max_requests=8,
        capacity=64,
        block_sizes=[4],
        attention=ALL_GROUPS,
        kv_indices_capacity=case["kv_indices_capacity"],
    )

    def padded(c):  # every step's table in one fixed (10, 64) buffer, as an engine keeps it
        full = np.full((10, 64), -1, np.int32)
        t = c["block_tables"][0]
        full[: t.shape[0], : t.shape[1]] = t
        return dict(c, block_tables=[full], capacity=64, kv_indices_capacity=case["kv_indices_capacity"])

    case = padded(case)
    dec = cupy.asarray(case["seq_lens_decoder"])
    q = cupy.asarray(case["seq_lens_this_time"])
    table = cupy.asarray(case["block_tables"][0])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        planner.compute(dec, q, table, stream=stream)  # warm up (module load) outside the capture
        stream.synchronize()
        stream.begin_capture()
        out = planner.compute(dec, q, table, stream=stream)
        graph = stream.end_capture()
    for seed in range(4):
        nxt = padded(make_case(np.random.default_rng(100 + seed), bsz=8, block_sizes=[4], spare_capacity=3))
        dec.set(nxt["seq_lens_decoder"], stream=stream)
        q.set(nxt["seq_lens_this_time"], stream=stream)
        table.set(nxt["block_tables"][0], stream=stream)
        graph.launch(stream)
        stream.synchronize()
        _assert_attention_equal(out.attention, _reference(nxt).outputs.attention, f"graph replay {seed}")


def _e2e(sim, backend, **kw):
    import cupy
    import torch

    StepPlanner = _planner_class()
    planner = StepPlanner(
        max_requests=sim.num_requests,
        capacity=64,
        block_sizes=list(sim.block_sizes),
        attention=ALL_GROUPS,
        kv_indices_capacity=sim.kv_indices_capacity,
    )
    keep = []

    def compute(dec, q, tables):
        torch.cuda.synchronize()  # the previous step's reads are done before its buffers are overwritten
        dev = [cupy.asarray(t) for t in tables]
        keep[:] = dev  # page_table views point into these
        out = planner.compute(cupy.asarray(dec), cupy.asarray(q), dev)
        planner.check()  # synchronises: torch reads the outputs next
        return out

    return run_e2e(sim, compute, backend, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_paged_attention_end_to_end_torch(seed):
    pytest.importorskip("torch", reason="PyTorch is not installed: the end-to-end paged-attention test needs SDPA")
    sim = Simulation(num_requests=24, steps=8, block_sizes=(16, 5), heads=4, dim=32, max_ctx=200, seed=seed)
    report = _e2e(sim, TorchBackend())
    assert report.ok, report.failures[:5]
    assert {"tokens", "idle"} <= report.kinds


def test_paged_attention_end_to_end_torch_can_fail():
    pytest.importorskip("torch", reason="PyTorch is not installed: the end-to-end paged-attention test needs SDPA")
    sim = Simulation(num_requests=8, steps=4, block_sizes=(4,), heads=2, dim=16, max_ctx=64, seed=3)

    def corrupt(step, meta):
        if step == 3:
            indptr, idx = meta["kv_indptr"][0], meta["kv_indices"][0]
            b = int(np.argmax(np.diff(indptr.cpu().numpy())))
            lo = int(indptr[b])
            idx[lo] = (idx[lo] + 1) % sim.num_blocks[0]

    report = _e2e(sim, TorchBackend(), corrupt=corrupt, paths=("flashinfer",))
    assert not report.ok and any("attention differs" in f or "negative page" in f for f in report.failures)
