"""StepPlanner.bind / BoundStep.launch on the GPU: equal to compute() and to the reference,
bsz changing per call without rebinding (across the small/large-path boundary), CUDA-graph
capture of the bound launch (CuPy and torch), torch streams, and check_bound."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.gpu import assert_outputs_equal, requires_gpu

pytestmark = requires_gpu

TILE = 4096


def _step(rng, bsz, rows, width, B, *, errors=False):
    """Host inputs of one step in persistent-buffer form: ``rows`` rows, the first ``bsz`` real."""
    d = np.full(rows, 0x3FFFFFFF, np.int32)  # garbage past bsz: never read
    q = np.full(rows, 0x3FFFFFFF, np.int32)
    d[:bsz] = rng.integers(0, width * B - 8, bsz)
    q[:bsz] = rng.choice([0, 1, 1, 1, 2, 4], bsz)
    table = rng.integers(0, 1 << 20, (rows, width)).astype(np.int32)
    if errors and bsz:
        d[rng.integers(0, bsz)] = -3  # bit 8
        table[rng.integers(0, bsz), :] = -1  # bit 2 for that request's tokens
    return d, q, table


def _reference(d, q, table, bsz, block_sizes, capacity, position_dtype=np.int64):
    from kvaddr.reference import step_addressing

    return step_addressing(d[:bsz], q[:bsz], table, block_sizes, capacity, position_dtype=position_dtype)


@pytest.mark.parametrize("position_dtype", [np.int64, np.int32])
def test_bound_launch_equals_compute_and_the_reference_as_bsz_changes(position_dtype):
    import cupy

    from kvaddr import StepPlanner

    rows, width, sizes, C = 9000, 16, [16, 64], 20000
    planner = StepPlanner(rows, C, sizes, position_dtype=position_dtype)
    dec = cupy.zeros(rows, np.int32)
    q = cupy.zeros(rows, np.int32)
    table = cupy.zeros((rows, width), np.int32)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    bound = planner.bind(dec, q, table, stream=stream)
    assert bound.max_bsz == rows
    rng = np.random.default_rng(11)
    # small path, the KV_TILE edge, the large (ticketed) path, back down, empty, full
    for i, bsz in enumerate([37, TILE, TILE + 1, 1, 9000, 0, 300, 2 * TILE + 5, 64]):
        d, qq, t = _step(rng, bsz, rows, width, 16, errors=i % 3 == 2)
        dec.set(d), q.set(qq), table.set(t)
        cupy.cuda.runtime.deviceSynchronize()
        ref = _reference(d, qq, t, bsz, sizes, C, position_dtype)
        planner.slot_mapping.fill(0x5A5A), planner.position_ids.fill(77)
        cupy.cuda.runtime.deviceSynchronize()
        out = bound.launch(bsz)
        stream.synchronize()
        assert_outputs_equal(out, ref.outputs, f"bound launch, bsz {bsz}")
        assert planner.errors(stream) == (ref.error_mask, ref.error_key), f"bound errors, bsz {bsz}"
        planner.slot_mapping.fill(0x5A5A)
        cupy.cuda.runtime.deviceSynchronize()
        out = planner.compute(dec[:bsz], q[:bsz], table, stream=stream)
        stream.synchronize()
        assert_outputs_equal(out, ref.outputs, f"compute, bsz {bsz}")
        # the records are sticky: read this launch's errors too (the next step starts clean)
        assert planner.errors(stream) == (ref.error_mask, ref.error_key), f"compute errors, bsz {bsz}"


def test_positions_only_and_several_tables():
    import cupy

    from kvaddr import StepPlanner

    rows, width, C = 200, 8, 1024
    rng = np.random.default_rng(5)
    d, qq, t = _step(rng, 150, rows, width, 4)
    t2 = rng.integers(0, 1000, (rows, width)).astype(np.int32)
    dec, q = cupy.asarray(d), cupy.asarray(qq)
    for sizes, tables, host in (([], None, []), ([4, 8], [cupy.asarray(t), cupy.asarray(t2)], [t, t2])):
        planner = StepPlanner(rows, C, sizes)
        out = planner.bind(dec, q, tables).launch(150)
        cupy.cuda.get_current_stream().synchronize()
        from kvaddr.reference import step_addressing

        ref = step_addressing(d[:150], qq[:150], host, sizes, C)
        assert_outputs_equal(out, ref.outputs, f"caches {sizes}")


def test_cupy_graph_capture_of_the_bound_launch_follows_changing_inputs():
    import cupy

    from kvaddr import StepPlanner

    rows, width, sizes, C = 5000, 16, [16], 8192
    for bsz in (100, 4500):  # small and large path
        planner = StepPlanner(rows, C, sizes)
        dec, q = cupy.zeros(rows, np.int32), cupy.zeros(rows, np.int32)
        table = cupy.zeros((rows, width), np.int32)
        cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
        stream = cupy.cuda.Stream(non_blocking=True)
        bound = planner.bind(dec, q, table, stream=stream)
        out = bound.launch(bsz)  # warm-up outside capture
        stream.synchronize()
        stream.begin_capture()
        bound.launch(bsz)
        graph = stream.end_capture()
        rng = np.random.default_rng(bsz)
        for _ in range(3):
            d, qq, t = _step(rng, bsz, rows, width, 16)
            dec.set(d, stream=stream), q.set(qq, stream=stream), table.set(t, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            ref = _reference(d, qq, t, bsz, sizes, C)
            assert_outputs_equal(out, ref.outputs, f"graph replay bsz {bsz}")
            assert planner.errors(stream) == (ref.error_mask, ref.error_key)


def test_torch_tensors_bound_launched_on_a_torch_stream_and_in_torch_cuda_graph():
    torch = pytest.importorskip("torch")
    from kvaddr import StepPlanner

    rows, width, sizes, C, bsz = 512, 8, [64, 16], 2048, 300
    dec = torch.zeros(rows, dtype=torch.int32, device="cuda")
    q = torch.zeros(rows, dtype=torch.int32, device="cuda")
    table = torch.zeros((rows, width), dtype=torch.int32, device="cuda")
    planner = StepPlanner(rows, C, sizes)
    bound = planner.bind(dec, q, table)
    s = torch.cuda.Stream()
    rng = np.random.default_rng(2)
    d, qq, t = _step(rng, bsz, rows, width, 16)
    dec.copy_(torch.from_numpy(d)), q.copy_(torch.from_numpy(qq)), table.copy_(torch.from_numpy(t))
    s.wait_stream(torch.cuda.current_stream())
    out = bound.launch(bsz, stream=s)  # a torch stream object (cuda_stream)
    s.synchronize()
    assert_outputs_equal(out, _reference(d, qq, t, bsz, sizes, C).outputs, "torch stream")

    g = torch.cuda.CUDAGraph()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        bound.launch(bsz, stream=torch.cuda.current_stream())
    for _ in range(3):
        d, qq, t = _step(rng, bsz, rows, width, 16)
        dec.copy_(torch.from_numpy(d)), q.copy_(torch.from_numpy(qq)), table.copy_(torch.from_numpy(t))
        g.replay()
        torch.cuda.synchronize()
        assert_outputs_equal(out, _reference(d, qq, t, bsz, sizes, C).outputs, "torch graph replay")


def test_check_bound_sees_an_in_place_resize_of_a_torch_tensor():
    torch = pytest.importorskip("torch")
    from kvaddr import StepPlanner

    dec = torch.zeros(64, dtype=torch.int32, device="cuda")
    q = torch.zeros(64, dtype=torch.int32, device="cuda")
    table = torch.zeros((64, 4), dtype=torch.int32, device="cuda")
    bound = StepPlanner(64, 128, [16]).bind(dec, q, table, debug=True)
    bound.launch(10)
    bound.check_bound()
    table.resize_(32, 4)  # same storage, fewer rows
    with pytest.raises(ValueError, match=r"block_tables changed since bind"):
        bound.check_bound()
    with pytest.raises(ValueError, match=r"block_tables changed since bind"):
        bound.launch(10)  # debug=True: checked before every launch


def test_bind_refuses_what_compute_refuses():
    import cupy

    from kvaddr import StepPlanner

    planner = StepPlanner(8, 64, [16])
    dec = cupy.zeros(8, np.int32)
    with pytest.raises(ValueError, match=r"block_tables must be .*got 4 rows for bsz = 8"):
        planner.bind(dec, dec, cupy.zeros((4, 2), np.int32))
    with pytest.raises(ValueError, match=r"seq_lens_decoder must have at most max_requests = 8 entries, got 9"):
        planner.bind(cupy.zeros(9, np.int32), cupy.zeros(9, np.int32), cupy.zeros((9, 2), np.int32))
    with pytest.raises(TypeError, match=r"seq_lens_this_time must be int32"):
        planner.bind(dec, dec.astype(np.int64), cupy.zeros((8, 2), np.int32))
    bound = planner.bind(dec, dec, cupy.zeros((8, 2), np.int32))
    with pytest.raises(ValueError, match=r"bsz must be an int in \[0, 8\]"):
        bound.launch(9)
