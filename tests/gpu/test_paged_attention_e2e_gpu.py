"""Attention metadata from StepPlanner on the GPU (docs/attention.md): against the NumPy
reference on mixed batches (hypothesis, every subset of the groups, 1-4 caches, bad values,
capacity overflow, more than 4096 and more than 16384 requests), every element written
(poisoned buffers, a big step then a small one, graph replay), nothing written past the
kv_indices capacity (guard words), attention off = the same addressing, the GPU baselines'
engine-style metadata, and the end-to-end paged-attention test with PyTorch's
scaled_dot_product_attention. Every test runs twice (the module fixture kernel_choice): with
the dispatch table's kernels, and with every batch on the multi-block kernel.

Skips, with the reason, without a GPU or (the end-to-end tests) without PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.attention_gpu import GROUP_SUBSETS
from tests.support.gpu import (
    ATTENTION_BUFFERS,
    assert_attention_equal,
    assert_outputs_equal,
    kernel_choice_fixture,
    requires_gpu,
    to_device,
)
from tests.support.paged_attention import Simulation, TorchBackend, run_e2e

pytestmark = requires_gpu

# every test with the dispatch table's kernels, then with every batch on the multi-block kernel
kernel_choice = kernel_choice_fixture()


def _planner_class():
    from kvaddr.planner import StepPlanner

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
    assert_attention_equal(got, want, label)


def _check_errors(mask, key, ref, label):
    from kvaddr.errors import decode_error_key

    assert mask == ref.error_mask, f"{label}: error bits {mask} != {ref.error_mask}"
    if ref.error_mask:
        assert decode_error_key(key) == ref.first_bad, f"{label}: first bad record"
    assert (mask, key) == (ref.error_mask, ref.error_key), f"{label}: error record"


@settings(max_examples=200, deadline=None)
@given(mixed_cases(), st.sampled_from(GROUP_SUBSETS))
def test_planner_attention_matches_the_reference(case, groups):
    case = dict(case, attention=groups)
    ref = _reference(case)
    _, out, mask, key, _ = _planner_step(case)
    _assert_attention_equal(out.attention, ref.outputs.attention, f"mixed {groups}")
    assert_outputs_equal(out, ref.outputs, f"mixed {groups}: addressing")
    _check_errors(mask, key, ref, f"mixed {groups}")


@settings(max_examples=40, deadline=None)
@given(mixed_cases(max_bsz=300), st.sampled_from(GROUP_SUBSETS))
def test_planner_attention_matches_the_reference_hundreds_of_requests(case, groups):
    case = dict(case, attention=groups)
    ref = _reference(case)
    _, out, mask, key, _ = _planner_step(case)
    _assert_attention_equal(out.attention, ref.outputs.attention, f"mixed {groups}")
    _check_errors(mask, key, ref, f"mixed {groups}")


@pytest.mark.parametrize("bsz", [4096, 4097, 6000, 16385])
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
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
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


def test_capacity_overflow_writes_nothing_past_n():
    """Bit 16: entries up to N written, nothing past them (guard words around a one-cache
    buffer of exactly N entries), kv_indptr keeps the true sums; a mixed batch over several
    metadata blocks, a decode-only batch of 5000 requests (the large path), prefills."""
    import cupy

    StepPlanner = _planner_class()
    for bsz, kinds in ((300, None), (5000, ("decode",)), (40, ("prefill", "continuation"))):
        kw = {} if kinds is None else {"kinds": kinds}
        case = make_case(np.random.default_rng(bsz), bsz=bsz, block_sizes=[2], spare_capacity=0, **kw)
        N = max(case["kv_indices_capacity"] * 2 // 3, 1)
        case = dict(case, kv_indices_capacity=N)
        planner = StepPlanner(bsz, case["capacity"], [2], attention=ALL_GROUPS, kv_indices_capacity=N)
        assert planner.kv_indices.shape == (1, N), "the planner's kv_indices holds exactly N entries per cache"
        guard, junk = 8192, 0x5A5A5A5A
        big = cupy.full(guard + N + guard, junk, dtype=np.int32)
        view = big[guard : guard + N].reshape(1, N)
        planner.kv_indices = view  # test hook: the kernel writes into a guarded buffer
        planner._params.kv_indices = view.data.ptr
        planner._views.clear()
        _, out, mask, key, _ = _planner_step(case, planner)
        ref = _reference(case)
        assert ref.error_mask & 16
        _check_errors(mask, key, ref, f"overflow, bsz {bsz}")
        _assert_attention_equal(out.attention, ref.outputs.attention, f"overflow, bsz {bsz}")
        h = big.get()
        assert (h[:guard] == junk).all(), "written before kv_indices"
        assert (h[guard + N :] == junk).all(), "written past the kv_indices capacity"


def test_poisoned_buffers_are_all_rewritten():
    """Every element of every attention buffer the outputs view is written on every call."""
    from tests.support.gpu import poison

    rng = np.random.default_rng(11)
    for bsz, sizes in ((7, [4]), (300, [3, 16]), (4500, [16, 64, 5, 1])):
        case = make_case(rng, bsz=bsz, block_sizes=sizes, spare_capacity=9)
        planner, *_ = _planner_step(case)
        for name in ATTENTION_BUFFERS:
            assert getattr(planner, name) is not None, name
        poison(planner)
        _, out, mask, key, _ = _planner_step(case, planner)
        ref = _reference(case)
        _assert_attention_equal(out.attention, ref.outputs.attention, f"poisoned, bsz {bsz}")
        _check_errors(mask, key, ref, f"poisoned, bsz {bsz}")


def test_attention_off_is_the_same_addressing():
    """Asking for attention changes no addressing output and no error record."""
    StepPlanner = _planner_class()
    rng = np.random.default_rng(5)
    for bsz, bad in ((9, "none"), (9, "unallocated"), (200, "negative-length"), (5000, "none")):
        case = make_case(rng, bsz=bsz, block_sizes=[4, 16], bad=bad, spare_capacity=2)
        dev = to_device(case)
        args = (dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        off = StepPlanner(bsz, case["capacity"], [4, 16])
        on = StepPlanner(
            bsz, case["capacity"], [4, 16], attention=ALL_GROUPS, kv_indices_capacity=case["kv_indices_capacity"]
        )
        assert off.grid(bsz) < on.grid(bsz)
        o_off, o_on = off.compute(*args), on.compute(*args)
        assert o_off.attention is None
        from kvaddr.reference import step_addressing

        plain = step_addressing(
            case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"], [4, 16], case["capacity"]
        )
        assert_outputs_equal(o_off, plain.outputs, f"off, bsz {bsz}")
        assert_outputs_equal(o_on, plain.outputs, f"on, bsz {bsz}")
        assert off.errors() == (plain.error_mask, plain.error_key)
        ref = _reference(case)
        assert on.errors() == (ref.error_mask, ref.error_key)


@pytest.mark.parametrize("name", ["per-layer", "per-layer-kernel", "hoisted", "fused"])
def test_strategies_metadata_equals_the_reference_eager_and_graph(name):
    """The baselines' engine-style metadata (separate launches) and the fused step's: equal to the
    reference on valid mixed batches, eagerly and replayed from a CUDA graph with new inputs."""
    import cupy

    from kvaddr.strategies.gpu import ENGINE_LAUNCHES, make_strategy
    from tests.support.gpu import poison

    rng = np.random.default_rng(21)
    sizes = [16, 3]
    cases = [make_case(rng, bsz=bsz, block_sizes=sizes, spare_capacity=4) for bsz in (50, 50, 50)]
    N = max(c["kv_indices_capacity"] for c in cases)
    W = max(t.shape[1] for c in cases for t in c["block_tables"])
    C = max(c["capacity"] for c in cases)

    def fixed(c):  # one fixed-shape table per cache, as an engine keeps it
        tables = []
        for t in c["block_tables"]:
            full = np.full((50, W), -1, np.int32)
            full[: t.shape[0] if t.shape[0] <= 50 else 50, : t.shape[1]] = t[:50]
            tables.append(full)
        return dict(c, block_tables=tables, capacity=C, kv_indices_capacity=N)

    cases = [fixed(c) for c in cases]
    s = make_strategy(
        name, max_requests=50, capacity=C, block_sizes=sizes, num_layers=2, attention=ALL_GROUPS, kv_indices_capacity=N
    )
    devs = [to_device(c) for c in cases]
    for i, (c, d) in enumerate(zip(cases, devs)):
        poison(s)
        out = s.step(d["seq_lens_decoder"], d["seq_lens_this_time"], d["block_tables"])
        cupy.cuda.runtime.deviceSynchronize()
        ref = _reference(c)
        assert_outputs_equal(out, ref.outputs, f"{name} eager {i}")
        _assert_attention_equal(out.attention, ref.outputs.attention, f"{name} eager {i}")
    if name == "fused":
        assert s.launches_per_step == 1
    else:  # known after a step (hoisted)
        assert s.launches_per_step >= 1 + 2 * ENGINE_LAUNCHES["flashinfer"] + ENGINE_LAUNCHES["varlen"]
    # graph: capture with set 0's arrays, replay after copying other sets' contents in
    d0 = devs[0]
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        s.step(d0["seq_lens_decoder"], d0["seq_lens_this_time"], d0["block_tables"], stream=stream)
        stream.synchronize()
        stream.begin_capture()
        out = s.step(d0["seq_lens_decoder"], d0["seq_lens_this_time"], d0["block_tables"], stream=stream)
        graph = stream.end_capture()
    for i in (1, 2, 0):
        c = cases[i]
        d0["seq_lens_decoder"].set(c["seq_lens_decoder"], stream=stream)
        d0["seq_lens_this_time"].set(c["seq_lens_this_time"], stream=stream)
        for g, t in enumerate(c["block_tables"]):
            d0["block_tables"][g].set(t, stream=stream)
        stream.synchronize()
        poison(s)
        cupy.cuda.runtime.deviceSynchronize()
        graph.launch(stream)
        stream.synchronize()
        ref = _reference(c)
        assert_outputs_equal(out, ref.outputs, f"{name} graph {i}")
        _assert_attention_equal(out.attention, ref.outputs.attention, f"{name} graph {i}")


def test_construction_errors_name_the_argument():
    StepPlanner = _planner_class()
    with pytest.raises(ValueError, match="kv_indices_capacity"):
        StepPlanner(4, 8, [4], attention="flashinfer")
    with pytest.raises(ValueError, match="attention"):
        StepPlanner(4, 8, [4], attention="flash")
    with pytest.raises(ValueError, match="at least one cache"):
        StepPlanner(4, 8, [], attention="page_table")
    p = StepPlanner(4, 8, [], attention="varlen")  # varlen needs no cache
    assert p.attention == ("varlen",) and p.kv_indices is None


def _e2e(sim, backend, **kw):
    import cupy
    import torch

    StepPlanner = _planner_class()
    planner = StepPlanner(
        max_requests=sim.num_requests,
        capacity=sim.num_requests * sim.max_ctx,  # a step's tokens never exceed it (prefills included)
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


def test_assorted_batches_match_the_reference():
    """Mixed batches (prefills longer than one copy round, idle requests, several caches), the
    batch-size edges of the kernels (0, 256, 257, > 4096 requests), capacity overflow, bad values,
    many rows longer than the columns a warp loads before its barrier (B = 1)."""
    rng = np.random.default_rng(104)
    cases = [
        make_case(rng, bsz=300, block_sizes=[1, 16, 3], spare_capacity=3),
        make_case(rng, bsz=40, block_sizes=[2], spare_capacity=0, kinds=("prefill", "continuation")),
        make_case(rng, bsz=5000, block_sizes=[16, 64], max_ctx=300, spare_capacity=2),
        make_case(rng, bsz=300, block_sizes=[4, 16], bad="unallocated", spare_capacity=2),
        make_case(rng, bsz=200, block_sizes=[4], bad="negative-length", spare_capacity=2),
        make_case(rng, bsz=300, block_sizes=[4, 16], bad="narrow-row", spare_capacity=2),
        make_case(rng, bsz=0, block_sizes=[4], spare_capacity=2),
        make_case(rng, bsz=250, block_sizes=[1, 4], max_ctx=300, spare_capacity=2),
        make_case(rng, bsz=256, block_sizes=[16], spare_capacity=2),
        make_case(rng, bsz=257, block_sizes=[16], spare_capacity=2),
        make_case(rng, bsz=120, block_sizes=[1], max_ctx=600, bad="unallocated", spare_capacity=2),
    ]
    over = dict(cases[0], kv_indices_capacity=max(cases[0]["kv_indices_capacity"] * 2 // 3, 1))
    for i, case in enumerate([*cases, over]):
        case = dict(case, attention=ALL_GROUPS)
        ref = _reference(case)
        _, out, mask, key, _ = _planner_step(case)
        _assert_attention_equal(out.attention, ref.outputs.attention, f"case {i}")
        assert_outputs_equal(out, ref.outputs, f"case {i}: addressing")
        _check_errors(mask, key, ref, f"case {i}")
