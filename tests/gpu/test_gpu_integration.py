"""CUDA graphs, streams, PyTorch zero-copy and device-side input checks (needs a GPU)."""

import numpy as np
import pytest

from tests.support.gpu import assert_outputs_equal, reference, requires_gpu, to_device
from tests.support.step_cases import WORKED_EXAMPLES, random_step

pytestmark = requires_gpu


def _fill(dst, src):
    import cupy

    dst[...] = cupy.asarray(src)


@pytest.mark.parametrize("name", ["fused", "per-layer-kernel", "hoisted", "per-layer", "one-block"])
@pytest.mark.parametrize("bsz", [64, 1024, 5000])
def test_graph_replay_follows_changing_inputs(name, bsz):
    import cupy

    if name == "one-block" and bsz > 1024:
        pytest.skip("one-block runs at most 1024 requests (test_gpu_strategies.py asserts the refusal)")
    from kvaddr.strategies.gpu import make_strategy

    rng = np.random.default_rng(bsz)
    B, width = 64, 40
    cap = 3 * bsz
    s = make_strategy(name, max_requests=bsz, capacity=cap, block_sizes=[B, B], num_layers=3)
    dec = cupy.zeros(bsz, dtype=np.int32)
    q = cupy.zeros(bsz, dtype=np.int32)
    table = cupy.zeros((bsz, width), dtype=np.int32)

    def new_step():
        case = random_step(rng, bsz=bsz, block_sizes=[B, B], shared_table=True, mix=("decode", "spec", "idle"))
        d, n = case["seq_lens_decoder"] % (B * (width - 4)), case["seq_lens_this_time"]
        t = rng.integers(0, 1 << 30, size=(bsz, width)).astype(np.int32)
        return dict(
            seq_lens_decoder=d.astype(np.int32), seq_lens_this_time=n, block_tables=t, block_sizes=[B, B], capacity=cap
        )

    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    first = new_step()
    for dst, k in ((dec, "seq_lens_decoder"), (q, "seq_lens_this_time"), (table, "block_tables")):
        _fill(dst, first[k])
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    with stream:
        s.step(dec, q, table, stream=stream)  # warm up: compile CuPy's ops outside capture
        stream.synchronize()
        stream.begin_capture()
        out = s.step(dec, q, table, stream=stream)
        graph = stream.end_capture()
    for i in range(4):
        case = new_step()
        with stream:
            for dst, k in ((dec, "seq_lens_decoder"), (q, "seq_lens_this_time"), (table, "block_tables")):
                _fill(dst, case[k])
            graph.launch(stream)
        stream.synchronize()
        assert_outputs_equal(out, reference(case).outputs, f"{name} replay {i}")


def test_two_graph_replays_of_the_large_path_in_a_row():
    """The large-batch path's tickets and epoch reset themselves between replays."""
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(5)
    case = random_step(rng, bsz=12000, block_sizes=[16], mix=("decode", "idle"))
    dev = to_device(case)
    p = StepPlanner(12000, case["capacity"], [16])
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.begin_capture()
    for _ in range(10):
        out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"], stream=stream)
    graph = stream.end_capture()
    for _ in range(5):
        graph.launch(stream)
    stream.synchronize()
    assert_outputs_equal(out, reference(case).outputs, "10 copies x 5 replays")


def test_torch_tensors_in_and_out_without_copies():
    torch = pytest.importorskip("torch")
    import cupy

    from kvaddr import StepPlanner

    case = WORKED_EXAMPLES[0][1]
    dec = torch.tensor(case["seq_lens_decoder"], device="cuda")
    q = torch.tensor(case["seq_lens_this_time"], device="cuda")
    table = torch.tensor(case["block_tables"], device="cuda")
    p = StepPlanner(3, 8, [4])
    ts = torch.cuda.Stream()
    ts.wait_stream(torch.cuda.current_stream())
    out = p.compute(dec, q, table, stream=ts)
    ts.synchronize()
    slots = torch.from_dlpack(out.slot_mapping)
    assert slots.data_ptr() == out.slot_mapping.data.ptr  # shared, not copied
    assert slots.tolist() == [[9, 16, 17, 18, 33, 34, -1, -1]]
    # The kernel reads the tensors' own memory: change them in place and recompute.
    table[0, 1] = 100  # position 5 of request 0 is in its block index 1
    out = p.compute(dec, q, table, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert slots[0, 0].item() == 100 * 4 + 1
    from kvaddr.validation import describe

    assert describe("t", table).ptr == table.data_ptr()
    # A non-contiguous tensor is refused, not copied.
    with pytest.raises(ValueError, match="block_tables must be int32 .*transposed or strided"):
        p.compute(dec, q, table.t().contiguous().t())
    assert cupy.asarray(dec).data.ptr == dec.data_ptr()


def test_torch_cuda_graph_capture_on_torch_stream():
    torch = pytest.importorskip("torch")
    from kvaddr import StepPlanner

    bsz, B, width = 256, 64, 8
    dec = torch.zeros(bsz, dtype=torch.int32, device="cuda")
    q = torch.ones(bsz, dtype=torch.int32, device="cuda")
    table = torch.zeros((bsz, width), dtype=torch.int32, device="cuda")
    p = StepPlanner(bsz, bsz, [B, B])
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.compute(dec, q, table, stream=s)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = p.compute(dec, q, table, stream=torch.cuda.current_stream())
    rng = np.random.default_rng(3)
    for _ in range(3):
        d = rng.integers(0, B * width, size=bsz).astype(np.int32)
        t = rng.integers(0, 1 << 20, size=(bsz, width)).astype(np.int32)
        dec.copy_(torch.from_numpy(d))
        table.copy_(torch.from_numpy(t))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(
            dict(
                seq_lens_decoder=d,
                seq_lens_this_time=np.ones(bsz, np.int32),
                block_tables=t,
                block_sizes=[B, B],
                capacity=bsz,
            )
        )
        assert_outputs_equal(out, ref.outputs, "torch graph replay")


def test_streams_accept_cupy_raw_and_torch_like_objects():
    import cupy

    from kvaddr import StepPlanner

    case = to_device(WORKED_EXAMPLES[0][1])
    p = StepPlanner(3, 8, [4])
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    s = cupy.cuda.Stream(non_blocking=True)

    class TorchLike:
        cuda_stream = s.ptr

    class StreamProtocol:  # the CUDA stream protocol (cuda.core, CuPy 14)
        def __cuda_stream__(self):
            return (0, s.ptr)

    for stream in (s, s.ptr, TorchLike(), StreamProtocol(), None):
        p.batch_id_per_token.fill(9)
        cupy.cuda.runtime.deviceSynchronize()  # the fill runs on CuPy's current stream: done before the step writes
        out = p.compute(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"], stream=stream)
        s.synchronize()
        cupy.cuda.get_current_stream().synchronize()
        assert out.batch_id_per_token.get().tolist() == [0, 1, 1, 1, 2, 2, -1, -1]
    with pytest.raises(TypeError, match="stream must be a CuPy stream"):
        p.compute(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"], stream="fast")


def test_device_side_input_checks():
    import cupy

    from kvaddr import StepPlanner

    c = WORKED_EXAMPLES[0][1]
    dev = to_device(c)
    p = StepPlanner(3, 8, [4])
    d, q, t = dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"]
    with pytest.raises(TypeError, match="seq_lens_decoder must be a CUDA array .*numpy.ndarray"):
        p.compute(c["seq_lens_decoder"], q, t)
    with pytest.raises(TypeError, match="block_tables must be int32 .*got dtype int64"):
        p.compute(d, q, t.astype(np.int64))
    with pytest.raises(ValueError, match="block_tables must be int32 .*transposed or strided"):
        p.compute(d, q, cupy.asfortranarray(t))
    with pytest.raises(ValueError, match="seq_lens_this_time must have shape \\(bsz,\\) = \\(3,\\)"):
        p.compute(d, q[:2], t)
    with pytest.raises(ValueError, match="at most max_requests = 2 entries, got 3"):
        StepPlanner(2, 8, [4]).compute(d, q, t)
    with pytest.raises(ValueError, match="block_tables must be .*got 2 rows for bsz = 3"):
        p.compute(d, q, t[:2])
    with pytest.raises(TypeError, match="seq_lens_decoder must be int32 .*float32"):
        p.compute(d.astype(np.float32), q, t)
    with pytest.raises(ValueError, match="block_sizes\\[0\\] must be an int in \\[1, 2147483647\\], got 0"):
        StepPlanner(3, 8, [0])
    with pytest.raises(ValueError, match="capacity must be an int in"):
        StepPlanner(3, 0, [4])
    with pytest.raises(ValueError, match="block_sizes must hold at most 4 caches"):
        StepPlanner(3, 8, [4] * 5)


def test_kernel_cache_is_memoized_per_device():
    from kvaddr import dispatch, kernel_loader

    assert kernel_loader.get_module() is kernel_loader.get_module()
    assert kernel_loader.get_function("kvaddr_empty") is kernel_loader.get_function("kvaddr_empty")
    names = dispatch.step_kernels(dispatch.StepConfig(1, True, 64, 300))  # a planner's kernels, compiled once
    fns = kernel_loader.load_kernels(names)
    assert all(kernel_loader.get_function(n) is fns[n] for n in names)
    assert kernel_loader.load_kernels(names[:1])[names[0]] is fns[names[0]]


def test_two_planners_on_two_streams_at_once():
    """Each planner owns its buffers and state: concurrent steps don't interfere."""
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(11)
    cases = [
        random_step(rng, bsz=bsz, block_sizes=[64, 16], shared_table=False, mix=("decode", "spec", "prefill"))
        for bsz in (3000, 6000)
    ]
    planners = [StepPlanner(6000, c["capacity"], [64, 16]) for c in cases]
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in cases]
    devs = [to_device(c) for c in cases]
    for _ in range(20):
        outs = [
            p.compute(d["seq_lens_decoder"], d["seq_lens_this_time"], d["block_tables"], stream=s)
            for p, d, s in zip(planners, devs, streams)
        ]
    for s in streams:
        s.synchronize()
    for out, c in zip(outs, cases):
        assert_outputs_equal(out, reference(c).outputs, f"bsz {len(c['seq_lens_decoder'])}")
