"""VllmStepPlanner.bind() on the GPU against the NumPy reference and against compute().

A binding checks vLLM's persistent request state once and each launch's batch
(``idx_mapping``, ``query_start_loc``) in full, read inline from the CuPy array's or torch
tensor's attributes. Every test compares every output element with the reference and with
``compute()`` on the same inputs: random batches (1-3 groups, DCP, int64 idx_mapping, dummies,
corrupted values), new batch objects of new sizes every step, torch tensors on a torch stream,
``torch.cuda.graph`` capture with the contents changed between replays, a bound table resized
in place, every bad batch (CuPy and torch: compute()'s message, nothing launched), and the
attention metadata (``vllm_step<false>`` and ``vllm_step<true>``). Skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import device_copy, requires_gpu
from tests.support.vllm_cases import assert_same, corrupt, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
STATE = NAMES[2:]


def _ref(cfg, x, padded, **kw):
    return vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded, **kw)


def _cupy(x):
    return device_copy(x)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_equal_compute_and_the_reference(seed):
    import cupy

    rng = np.random.default_rng(600 + seed)
    G = 1 + seed % 3
    cp = 2 if seed % 2 else 1
    cfg, state = random_case(
        rng,
        max_num_reqs=300,
        num_reqs=200,
        block_sizes=(16, 4, 64)[:G],
        max_query=3,
        cp_size=cp,
        cp_rank=seed % cp,
        idx_dtype=np.int64 if seed % 3 == 2 else np.int32,
        spare_tokens=600,
    )

    def on_device(x):
        d = _cupy({k: x[k] for k in STATE})
        if seed % 2 and G > 1:  # vLLM keeps num_blocks stacked [G, rows]
            d["num_blocks"] = device_copy(np.stack(x["num_blocks"]))
        return d

    d = on_device(state)
    bound_planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = bound_planner.bind(*(d[k] for k in STATE))
    checked = VllmStepPlanner(**planner_kwargs(cfg))
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    for step in range(8):
        n = int(rng.integers(0, 201))
        x = new_batch(rng, cfg, state, n, max_query=3)
        use, use_d = bound, d
        if step % 3 == 2:  # bad values (a corrupted copy of the state, bound on its own): the reference's record
            x = corrupt(rng, cfg, x, rate=0.05)
            use_d = on_device(x)
            use = bound_planner.bind(*(use_d[k] for k in STATE))
        padded = min(cfg.max_num_reqs, n + int(rng.integers(0, 40)))
        idx, qsl = cupy.asarray(x["idx_mapping"]), cupy.asarray(x["query_start_loc"])  # new objects
        # The copies above ran on the null stream, the launch runs on a non-blocking stream: order them
        # (a bound launch is fast enough to overtake a copy still in flight).
        cupy.cuda.runtime.deviceSynchronize()
        got = use.launch(idx, qsl, padded, stream=stream)
        stream.synchronize()
        want = _ref(cfg, x, padded)
        assert_same(got, want.outputs.as_dict(), f"seed {seed} step {step}")
        assert bound_planner.errors(stream) == (want.error_mask, want.error_key), f"step {step}"
        via_compute = checked.compute(idx, qsl, *(use_d[k] for k in STATE), padded, stream=stream)
        stream.synchronize()
        assert_same(via_compute, want.outputs.as_dict(), f"compute, step {step}")
        assert checked.errors(stream) == (want.error_mask, want.error_key)


def test_slices_of_persistent_buffers_every_step():
    """vLLM's own pattern: idx_mapping / query_start_loc are new slices ``buf[:n]`` of persistent
    buffers every step (the same pointers), the request state the same objects with new contents."""
    import cupy

    rng = np.random.default_rng(61)
    cfg, state = random_case(rng, max_num_reqs=256, num_reqs=200, block_sizes=(16, 64), max_query=2, spare_tokens=520)
    M = cfg.max_num_reqs
    d = _cupy({k: state[k] for k in STATE})
    idx_buf = cupy.zeros(M, np.int32)
    qsl_buf = cupy.zeros(M + 1, np.int32)
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE))
    for step, n in enumerate((200, 200, 17, 0, 256, 256, 1, 120)):
        x = new_batch(rng, cfg, state, n, max_query=2)
        idx_buf[:n].set(x["idx_mapping"].astype(np.int32))
        qsl_buf[: n + 1].set(x["query_start_loc"])
        padded = min(M, n + 8)
        out = bound.launch(idx_buf[:n], qsl_buf[: n + 1], padded)
        cupy.cuda.get_current_stream().synchronize()
        want = _ref(cfg, x, padded)
        assert_same(out, want.outputs.as_dict(), f"step {step} (n = {n})")
        assert planner.errors() == (want.error_mask, want.error_key)
        # new request-state contents in place (the engine's own update), the same objects
        state["num_computed_tokens"] = np.maximum(state["num_computed_tokens"] - 1, 0).astype(np.int32)
        d["num_computed_tokens"].set(state["num_computed_tokens"])


def test_torch_tensors_on_a_torch_stream():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(62)
    cfg, state = random_case(rng, max_num_reqs=128, num_reqs=100, block_sizes=(16, 32), max_query=2, spare_tokens=200)
    dev = torch.device("cuda", 0)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    d = {k: [t(a) for a in state[k]] if isinstance(state[k], list) else t(state[k]) for k in STATE}
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE))
    s = torch.cuda.Stream()
    for step in range(5):
        n = int(rng.integers(1, 101))
        x = new_batch(rng, cfg, state, n, max_query=2)
        padded = min(cfg.max_num_reqs, n + step)
        with torch.cuda.stream(s):
            idx = t(x["idx_mapping"].astype(np.int64 if step % 2 else np.int32))
            qsl = t(x["query_start_loc"])
            out = bound.launch(idx, qsl, padded, stream=s)
        s.synchronize()
        xs = dict(x, idx_mapping=x["idx_mapping"].astype(np.int64 if step % 2 else np.int32))
        want = _ref(cfg, xs, padded)
        assert_same(out, want.outputs.as_dict(), f"torch step {step}")
        assert planner.errors(s) == (want.error_mask, want.error_key)


def test_torch_graph_capture_with_contents_changed_between_replays():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(63)
    cfg, state = random_case(rng, max_num_reqs=160, num_reqs=160, block_sizes=(16, 64), max_query=1, spare_tokens=60)
    M = cfg.max_num_reqs
    dev = torch.device("cuda", 0)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    d = {k: [t(a) for a in state[k]] if isinstance(state[k], list) else t(state[k]) for k in STATE}
    idx_buf = torch.zeros(M, dtype=torch.int32, device=dev)
    qsl_buf = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE))
    n, padded = 96, 128

    def load(x):
        idx_buf[:n].copy_(t(x["idx_mapping"].astype(np.int32)))
        qsl_buf[: n + 1].copy_(t(x["query_start_loc"]))

    x = new_batch(rng, cfg, state, n, max_query=1)
    load(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (the plan for this n is made here)
        bound.launch(idx_buf[:n], qsl_buf[: n + 1], padded, stream=s)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound.launch(idx_buf[:n], qsl_buf[: n + 1], padded, stream=torch.cuda.current_stream())
    for r in range(4):
        x = new_batch(rng, cfg, state, n, max_query=1)
        load(x)
        if r % 2:  # the request state's contents too (the same memory)
            state["num_computed_tokens"] = np.maximum(state["num_computed_tokens"] - 1, 0).astype(np.int32)
            d["num_computed_tokens"].copy_(t(state["num_computed_tokens"]))
            x = dict(x, num_computed_tokens=state["num_computed_tokens"])
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        want = _ref(cfg, x, padded)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {r}")
        assert planner.errors() == (want.error_mask, want.error_key)


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_a_bound_table_resized_in_place_is_checked_again(lib):
    rng = np.random.default_rng(64)
    cfg, state = random_case(rng, max_num_reqs=64, num_reqs=48, block_sizes=(16, 16), max_query=2, spare_tokens=100)
    M = cfg.max_num_reqs
    if lib == "torch":
        torch = pytest.importorskip("torch")

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

        def sync():
            torch.cuda.synchronize()
    else:
        import cupy

        dev = cupy.asarray

        def sync():
            cupy.cuda.get_current_stream().synchronize()

    d = {k: [dev(a) for a in state[k]] if isinstance(state[k], list) else dev(state[k]) for k in STATE}
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE))

    def step(label):
        x = new_batch(rng, cfg, state, 48, max_query=2)
        out = bound.launch(dev(x["idx_mapping"]), dev(x["query_start_loc"]), 48)
        sync()
        want = _ref(cfg, x, 48)
        assert_same(out, want.outputs.as_dict(), f"{lib} {label}")
        assert planner.errors() == (want.error_mask, want.error_key), label

    step("first")
    table = d["block_tables"][1]
    if lib == "torch":
        ptr = table.data_ptr()
        table.resize_(2 * M, table.shape[1])  # more rows: new memory, the old rows copied
        table[M:] = -7  # rows beyond max_num_reqs: never read
        assert table.data_ptr() != ptr
        step("resized to more rows: bound again")
        assert bound.params.block_table[1] == table.data_ptr()
        table.resize_(M - 1, table.shape[1])
    else:
        table.shape = (M // 2, 2 * table.shape[1])  # CuPy's shape setter: the same memory
    with pytest.raises(ValueError, match=r"block_tables\[1\] must be int32 with shape \(rows >= 64"):
        step("too few rows")
    if lib == "torch":
        table.resize_(M, table.shape[1])
    else:
        table.shape = (M, table.shape[1] // 2)
    step("restored")


def _bad_batches(lib):
    """(label, idx_mapping, query_start_loc, error, message) on the device, for max_num_reqs 4."""
    if lib == "torch":
        torch = pytest.importorskip("torch")

        def a(v, dt=np.int32):
            return torch.from_numpy(np.asarray(v, dt)).to("cuda")

        cpu = torch.from_numpy(np.array([2, 0], np.int32))
    else:
        import cupy

        def a(v, dt=np.int32):
            return cupy.asarray(np.asarray(v, dt))

        cpu = np.array([2, 0], np.int32)
    good_i, good_q = a([2, 0]), a([0, 1, 3])
    return [
        ("idx float", a([2, 0], np.float32), good_q, TypeError, "idx_mapping must be int32 or int64"),
        ("idx uint32" if lib == "cupy" else "idx int16", a([2, 0], np.uint32 if lib == "cupy" else np.int16), good_q,
         TypeError, "idx_mapping must be int32 or int64"),
        ("idx 2-D", a([[2, 0]]), good_q, ValueError, r"idx_mapping must be .* got shape \(1, 2\)"),
        ("idx strided", a([2, 9, 0, 9])[::2], good_q, ValueError, "idx_mapping must be contiguous"),
        ("idx too long", a([0, 1, 2, 3, 0]), a([0, 1, 2, 3, 4, 5]), ValueError, "at most max_num_reqs = 4 entries, got 5"),
        ("idx on the host", cpu, good_q, TypeError, "idx_mapping must be a CUDA array"),
        ("qsl int64", good_i, a([0, 1, 3], np.int64), TypeError, "query_start_loc must be int32"),
        ("qsl short", good_i, a([0, 1]), ValueError, r"query_start_loc must be .* = \(3,\), got shape \(2,\)"),
        ("qsl long", good_i, a([0, 1, 3, 3]), ValueError, r"query_start_loc must be .* = \(3,\), got shape \(4,\)"),
        ("qsl strided", good_i, a([0, 9, 1, 9, 3, 9])[::2], ValueError, "query_start_loc must be contiguous"),
        ("qsl 2-D", good_i, a([[0], [1], [3]]), ValueError, r"query_start_loc must be .* got shape \(3, 1\)"),
    ]  # fmt: skip


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_every_bad_batch_raises_computes_message_and_launches_nothing(lib):
    from tests.support.vllm_cases import worked_example

    cfg, x = worked_example()
    rows = _bad_batches(lib)
    if lib == "torch":
        import torch

        def dev(v):
            return torch.from_numpy(np.ascontiguousarray(v)).to("cuda")

        def sync():
            torch.cuda.synchronize()
    else:
        import cupy

        dev = cupy.asarray

        def sync():
            cupy.cuda.get_current_stream().synchronize()

    d = {k: [dev(a) for a in x[k]] if isinstance(x[k], list) else dev(x[k]) for k in STATE}
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    bound = planner.bind(*(d[k] for k in STATE))
    good = bound.launch(dev(x["idx_mapping"]), dev(x["query_start_loc"]), 2)
    sync()
    want = _ref(cfg, x, 2).outputs.as_dict()
    assert_same(good, want, f"{lib} good batch")
    for label, idx, qsl, exc, message in rows:
        with pytest.raises(exc, match=message):
            VllmStepPlanner(**planner_kwargs(cfg)).compute(idx, qsl, *(d[k] for k in STATE), 4)
        planner.outputs.positions.fill(-9)  # a launch would rewrite it
        with pytest.raises(exc, match=message):
            bound.launch(idx, qsl, 4)
        sync()
        assert (planner.outputs.positions == -9).all().item(), f"{lib} {label}: launched"
        bound.launch(dev(x["idx_mapping"]), dev(x["query_start_loc"]), 2)  # still bound and usable
        sync()
        assert_same(planner.outputs, want, f"{lib} after {label}")


def test_attention_metadata_from_a_binding():
    import cupy

    attention = ("flashinfer", "varlen")
    rng = np.random.default_rng(65)
    cfg, state = random_case(rng, max_num_reqs=200, num_reqs=150, block_sizes=(16, 64), max_query=3, spare_tokens=450)
    d = _cupy({k: state[k] for k in STATE})
    planner = VllmStepPlanner(**planner_kwargs(cfg), attention=attention, kv_indices_capacity=1 << 16)
    bound = planner.bind(*(d[k] for k in STATE))
    for step in range(3):
        n = int(rng.integers(1, 151))
        x = new_batch(rng, cfg, state, n, max_query=3)
        out = bound.launch(cupy.asarray(x["idx_mapping"]), cupy.asarray(x["query_start_loc"]), n + step)
        cupy.cuda.get_current_stream().synchronize()
        want = _ref(cfg, x, n + step, attention=attention, kv_indices_capacity=1 << 16)
        assert_same(out, want.outputs.as_dict(), f"step {step}")
        w = want.outputs.attention
        for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k"):
            assert np.array_equal(getattr(out.attention, f).get(), getattr(w, f)), (step, f)
        assert int(out.attention.max_seqlen_q.get()) == int(w.max_seqlen_q)
        assert out.attention.max_seqlen_k.get().tolist() == w.max_seqlen_k.tolist()
        assert planner.errors() == (want.error_mask, want.error_key)


def test_readme_bind_snippet():
    """README's bind() snippet, after its vLLM example (the same tensors), verbatim apart from the asserts."""
    torch = pytest.importorskip("torch")

    dev = "cuda"
    num_computed_tokens = torch.tensor([9, 0, 5, 0], dtype=torch.int32, device=dev)
    block_table = torch.tensor(
        [[1, 3, 8, -1], [0, 0, 0, 0], [7, 2, -1, -1], [0, 0, 0, 0]], dtype=torch.int32, device=dev
    )
    num_blocks = torch.tensor([[3, 0, 2, 0]], dtype=torch.int32, device=dev)
    positions = torch.zeros(6, dtype=torch.int64, device=dev)
    slot_mappings = torch.zeros((1, 6), dtype=torch.int64, device=dev)
    planner = VllmStepPlanner(
        max_num_reqs=4, max_num_batched_tokens=6, block_sizes=[4], widths=[4],
        out={"positions": positions, "slot_mappings": slot_mappings},
    )  # fmt: skip
    idx_mapping = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)
    # the README's snippet:
    bound = planner.bind(num_computed_tokens, [block_table], num_blocks)  # checked once
    out = bound.launch(idx_mapping, query_start_loc, num_reqs_padded=2, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert positions.tolist() == [5, 9, 10, 0, 0, 0]
    assert slot_mappings.tolist() == [[9, 33, 34, -1, -1, -1]]
    assert out.seq_lens.tolist() == [6, 11, 0, 0]
    assert out.positions is positions
