"""The vLLM step's batch buffers bound whole (``launch(num_reqs, num_reqs_padded)``), ``num_blocks`` in
pinned host memory read through UVA, and compute() on fresh torch slices, on the GPU against the
NumPy reference.

Every test compares every output element and the error record with
:func:`~kvaddr.engines.vllm_reference.vllm_step_reference`: random batches written into persistent
batch buffers (CuPy and torch, int32 and int64 ``idx_mapping``, dummies, corrupted values, 1-3 groups,
DCP), ``num_blocks`` as a pinned torch tensor, a ``cupyx.empty_pinned`` array and a CuPy array at the
pinned memory's device pointer, ``torch.cuda.graph`` capture of the bound launch replayed with new
contents in the buffers (the pinned ``num_blocks`` changed on the host between replays), and
``compute()`` with new torch slices and a new torch stream object every step. Skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import assert_same, corrupt, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
STATE = NAMES[2:]


def _ref(cfg, x, padded):
    return vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded)


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_bound_batch_buffers_every_step(lib, seed):
    """New contents in the bound buffers every step (a new num_reqs, int32 or int64 idx_mapping,
    corrupted values every third step in a copy of the state): each launch equals the reference."""
    rng = np.random.default_rng(700 + seed)
    G = 1 + seed % 3
    cp = 2 if seed % 2 else 1
    idt = np.int64 if seed % 2 else np.int32
    cfg, state = random_case(
        rng,
        max_num_reqs=300,
        num_reqs=200,
        block_sizes=(16, 4, 64)[:G],
        max_query=3,
        cp_size=cp,
        cp_rank=seed % cp,
        idx_dtype=idt,
        spare_tokens=600,
    )
    M = cfg.max_num_reqs
    if lib == "torch":
        torch = _torch()

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

        def put(buf, n, a):
            buf[:n].copy_(dev(a))

        def sync():
            torch.cuda.synchronize()

        stream = torch.cuda.Stream()
    else:
        import cupy

        dev = cupy.asarray

        def put(buf, n, a):
            buf[:n].set(np.ascontiguousarray(a))

        def sync():
            cupy.cuda.runtime.deviceSynchronize()

        stream = cupy.cuda.Stream(non_blocking=True)
    d = {k: [dev(a) for a in state[k]] if isinstance(state[k], list) else dev(state[k]) for k in STATE}
    idx_buf, qsl_buf = dev(np.full(M, 9, idt)), dev(np.full(M + 1, 10**6, np.int32))
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE), idx_mapping=idx_buf, query_start_loc=qsl_buf, stream=stream)
    assert bound.max_num_reqs == M
    for step in range(8):
        n = int(rng.integers(0, 201))
        x = new_batch(rng, cfg, state, n, max_query=3)
        use = bound
        if step % 3 == 2:  # bad values: a corrupted copy of the state, bound on its own
            x = corrupt(rng, cfg, x, rate=0.05)
            cd = {k: [dev(a) for a in x[k]] if isinstance(x[k], list) else dev(x[k]) for k in STATE}
            use = planner.bind(*(cd[k] for k in STATE), idx_mapping=idx_buf, query_start_loc=qsl_buf)
        put(idx_buf, n, x["idx_mapping"].astype(idt))
        put(qsl_buf, n + 1, x["query_start_loc"])
        sync()
        padded = min(M, n + int(rng.integers(0, 40)))
        out = use.launch(n, padded, stream)
        sync()
        want = _ref(cfg, dict(x, idx_mapping=x["idx_mapping"].astype(idt)), padded)
        assert_same(out, want.outputs.as_dict(), f"{lib} seed {seed} step {step}")
        assert planner.errors(stream) == (want.error_mask, want.error_key), f"step {step}"


def _pinned(kind, stacked):
    """``(num_blocks argument, a function writing new contents into it on the host)``: vLLM's [G, rows]
    int32 array in pinned host memory, as a pinned torch tensor, a cupyx.empty_pinned array, a CuPy
    array at its device pointer or a ``__cuda_array_interface__`` view at its host address."""
    from kvaddr.measure.vllm_workload import pinned_num_blocks

    if kind == "torch":
        torch = _torch()
        t = torch.from_numpy(np.ascontiguousarray(stacked)).pin_memory()
        assert t.is_pinned()
        return t, lambda a: t.copy_(torch.from_numpy(np.ascontiguousarray(a)))
    host, view = pinned_num_blocks(stacked)

    def write(a):
        host[...] = a

    if kind == "cai":  # a __cuda_array_interface__ view of the pinned memory, at its host address
        cai = {"data": (host.ctypes.data, False), "shape": host.shape, "typestr": "<i4", "strides": None, "version": 3}
        return type("HostView", (), {"__cuda_array_interface__": cai, "owner": host})(), write
    return (host if kind == "numpy" else view), write


@pytest.mark.parametrize("kind", ["torch", "numpy", "cupy-view", "cai"])
@pytest.mark.parametrize("G", [1, 2])
def test_num_blocks_in_pinned_host_memory(kind, G):
    """compute() and both bind forms with num_blocks in pinned host memory, its contents changed on the
    host between steps (a count too large every other step: the reference's error record)."""
    import cupy

    rng = np.random.default_rng(720 + G)
    cfg, state = random_case(
        rng, max_num_reqs=1500, num_reqs=1200, block_sizes=(16, 64)[:G], max_query=2, spare_tokens=1300
    )
    M = cfg.max_num_reqs
    d = {
        k: [cupy.asarray(a) for a in state[k]] if isinstance(state[k], list) else cupy.asarray(state[k]) for k in STATE
    }
    stacked = np.stack(state["num_blocks"]).astype(np.int32)
    nb, write = _pinned(kind, stacked)
    idx_buf, qsl_buf = cupy.zeros(M, np.int32), cupy.zeros(M + 1, np.int32)
    planners = [VllmStepPlanner(**planner_kwargs(cfg)) for _ in range(3)]
    b_state = planners[1].bind(d["num_computed_tokens"], d["block_tables"], nb)
    b_batch = planners[2].bind(
        d["num_computed_tokens"], d["block_tables"], nb, idx_mapping=idx_buf, query_start_loc=qsl_buf
    )
    for step in range(6):
        n = int(rng.integers(1, 1201))
        if step % 2:
            stacked[G - 1, rng.integers(0, M)] = 10**6
        else:
            stacked[:] = np.stack(state["num_blocks"])
        write(stacked)
        x = dict(new_batch(rng, cfg, state, n, max_query=2), num_blocks=list(stacked))
        idx, qsl = cupy.asarray(x["idx_mapping"].astype(np.int32)), cupy.asarray(x["query_start_loc"])
        idx_buf[:n] = idx
        qsl_buf[: n + 1] = qsl
        cupy.cuda.runtime.deviceSynchronize()
        padded = min(M, n + 5)
        want = _ref(cfg, dict(x, idx_mapping=x["idx_mapping"].astype(np.int32)), padded)
        for label, planner in (("compute", planners[0]), ("bind", planners[1]), ("bind batch", planners[2])):
            if label == "compute":
                out = planner.compute(idx, qsl, d["num_computed_tokens"], d["block_tables"], nb, padded)
            elif label == "bind":
                out = b_state.launch(idx, qsl, padded)
            else:
                out = b_batch.launch(n, padded)
            cupy.cuda.runtime.deviceSynchronize()
            assert_same(out, want.outputs.as_dict(), f"{kind} G={G} {label} step {step}")
            assert planner.errors() == (want.error_mask, want.error_key), f"{label} step {step}"


def test_torch_graph_capture_of_the_bound_batch_with_new_contents():
    """torch.cuda.graph captures ``launch(num_reqs, num_reqs_padded)``; each replay finds new batch
    contents in the bound buffers, new request state in place and new pinned num_blocks on the host."""
    torch = _torch()
    rng = np.random.default_rng(740)
    cfg, state = random_case(rng, max_num_reqs=160, num_reqs=160, block_sizes=(16, 64), max_query=1, spare_tokens=60)
    M = cfg.max_num_reqs
    dev = torch.device("cuda", 0)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    nct, tables = t(state["num_computed_tokens"]), [t(a) for a in state["block_tables"]]
    stacked = np.stack(state["num_blocks"]).astype(np.int32)
    nb = torch.from_numpy(stacked.copy()).pin_memory()
    idx_buf = torch.zeros(M, dtype=torch.int32, device=dev)
    qsl_buf = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(nct, tables, nb, idx_mapping=idx_buf, query_start_loc=qsl_buf)
    n, padded = 96, 128

    def load(x):
        idx_buf[:n].copy_(t(x["idx_mapping"].astype(np.int32)))
        qsl_buf[: n + 1].copy_(t(x["query_start_loc"]))

    load(new_batch(rng, cfg, state, n, max_query=1))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (the plan for this n is made here)
        bound.launch(n, padded, s)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound.launch(n, padded, torch.cuda.current_stream())
    for r in range(5):
        x = new_batch(rng, cfg, state, n, max_query=1)
        load(x)
        if r % 2:  # the request state's contents too (the same memory), and num_blocks on the host
            state["num_computed_tokens"] = np.maximum(state["num_computed_tokens"] - 1, 0).astype(np.int32)
            nct.copy_(t(state["num_computed_tokens"]))
            stacked[1, rng.integers(0, M)] = 10**6 if r == 3 else stacked[1, 0]
            nb.copy_(torch.from_numpy(stacked))
        x = dict(x, num_computed_tokens=state["num_computed_tokens"], num_blocks=list(stacked))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        want = _ref(cfg, x, padded)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {r}")
        assert planner.errors() == (want.error_mask, want.error_key), f"replay {r}"


def test_compute_on_fresh_torch_slices_and_stream_objects():
    """vLLM's eager call: compute(idx_buf[:n], qsl_buf[:n + 1], state..., stream=current_stream())
    with new slices and a new stream object every step (the third call on is the path of fresh batch
    objects over the bound state); a bad slice still raises compute()'s message."""
    torch = _torch()
    rng = np.random.default_rng(750)
    cfg, state = random_case(rng, max_num_reqs=256, num_reqs=200, block_sizes=(16, 64), max_query=2, spare_tokens=520)
    M = cfg.max_num_reqs
    dev = torch.device("cuda", 0)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    d = {k: [t(a) for a in state[k]] if isinstance(state[k], list) else t(state[k]) for k in STATE}
    idx_buf = torch.zeros(M, dtype=torch.int32, device=dev)
    qsl_buf = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # the buffers' zero fills ran there; s writes and reads them
    with torch.cuda.stream(s):
        for step, n in enumerate((200, 200, 17, 0, 256, 256, 1, 120)):
            x = new_batch(rng, cfg, state, n, max_query=2)
            idx_buf[:n].copy_(t(x["idx_mapping"].astype(np.int32)))
            qsl_buf[: n + 1].copy_(t(x["query_start_loc"]))
            padded = min(M, n + 8)
            out = planner.compute(
                idx_buf[:n], qsl_buf[: n + 1], *(d[k] for k in STATE), padded, stream=torch.cuda.current_stream()
            )
            s.synchronize()
            want = _ref(cfg, x, padded)
            assert_same(out, want.outputs.as_dict(), f"step {step} (n = {n})")
            assert planner.errors(s.cuda_stream) == (want.error_mask, want.error_key)
        assert planner._state_bound is not None
        with pytest.raises(ValueError, match="idx_mapping must be contiguous"):
            planner.compute(idx_buf[:8:2], qsl_buf[:5], *(d[k] for k in STATE), 8, stream=torch.cuda.current_stream())
        with pytest.raises(TypeError, match="idx_mapping must be int32 or int64"):
            planner.compute(idx_buf[:4].float(), qsl_buf[:5], *(d[k] for k in STATE), 8)
