"""VllmStepPlanner on the GPU against the NumPy reference (docs/vllm.md).

Every test builds its batch on the host, runs the reference and the planner, and
compares every output element (the gathered tables in full), and the step's error record
(sticky: :func:`run_and_compare` reads it, which clears it). The one-launch kernel is
``vllm_step<false>`` (kvaddr.dispatch.vllm_kernel). Skips without a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_errors import VLLM_ERROR_REASONS, VLLM_NO_ERROR_KEY, VllmAddressingError
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_bad_input_matrix import ROWS
from tests.support.vllm_cases import (
    assert_same,
    new_batch,
    planner_kwargs,
    random_case,
    to_numpy,
    worked_example,
)

pytestmark = requires_gpu

INPUT_NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


def on_device(inputs: dict) -> dict:
    import cupy

    def conv(x):
        if x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous:
            return cupy.asarray(x.T).T  # keep a transposed view transposed
        return cupy.asarray(x)

    out = {}
    for k, v in inputs.items():
        out[k] = [conv(x) for x in v] if isinstance(v, list) else conv(v)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def make_planner(cfg: VllmStepConfig, cls=None, **kw):
    from kvaddr.engines.vllm import VllmStepPlanner

    return (cls or VllmStepPlanner)(**planner_kwargs(cfg), **kw)


def ref(cfg, inputs, padded=None):
    return vllm_step_reference(cfg, **{k: inputs[k] for k in INPUT_NAMES}, num_reqs_padded=padded)


def run_and_compare(planner, cfg, inputs, padded=None, label=""):
    import cupy

    d = on_device(inputs)
    out = planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded)
    cupy.cuda.get_current_stream().synchronize()
    want = ref(cfg, inputs, padded)
    assert_same(out, want.outputs.as_dict(), label)
    assert planner.errors() == (want.error_mask, want.error_key), label
    return out


# -- the worked example --------------------------------------------------------------------


def test_worked_example():
    cfg, inputs = worked_example()
    out = run_and_compare(make_planner(cfg), cfg, inputs)
    assert to_numpy(out.positions).tolist() == [5, 9, 10, 0, 0, 0]
    assert to_numpy(out.slot_mappings).tolist() == [[9, 33, 34, -1, -1, -1]]
    assert to_numpy(out.seq_lens).tolist() == [6, 11, 0, 0]


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp(rank):
    cfg, inputs = worked_example(cp_size=2, cp_rank=rank)
    out = run_and_compare(make_planner(cfg), cfg, inputs)
    assert int(to_numpy(out.slot_mappings)[0, 0]) == (-1 if rank == 0 else 30)
    assert int(to_numpy(out.dcp_local_seq_lens)[0]) == 3


# -- random batches --------------------------------------------------------------------------

GROUPS = [(16,), (16, 64), (16, 64, 24), (1, 16, 64, 13)]


@pytest.mark.parametrize("block_sizes", GROUPS, ids=["-".join(map(str, g)) for g in GROUPS])
@pytest.mark.parametrize("max_query", [1, 40])
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64], ids=["idx32", "idx64"])
@pytest.mark.parametrize("seed", range(3))
def test_random_batches(block_sizes, max_query, idx_dtype, seed):
    rng = np.random.default_rng(seed)
    G = len(block_sizes)
    cfg, inputs = random_case(
        rng,
        max_num_reqs=300,
        num_reqs=int(rng.integers(1, 300)),
        block_sizes=block_sizes,
        max_query=max_query,
        dummy_fraction=0.15,
        idx_dtype=idx_dtype,
        slot_mapping_enabled=[g != 1 for g in range(G)],
        sliding_window_reach=[0, 0, 100, 0][:G],
    )
    n = len(inputs["idx_mapping"])
    run_and_compare(make_planner(cfg), cfg, inputs, padded=int(rng.integers(n, 301)), label=f"seed {seed}")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("interleave", ["1", "B"])
@pytest.mark.parametrize("two_groups", [False, True])
def test_dcp_every_rank(cp, interleave, two_groups):
    B = 16
    il = 1 if interleave == "1" else B
    block_sizes = (B, 64) if two_groups else (B,)
    outs = []
    for rank in range(cp):
        cfg, inputs = random_case(
            np.random.default_rng(7),
            max_num_reqs=200,
            num_reqs=150,
            block_sizes=block_sizes,
            max_query=30,
            cp_size=cp,
            cp_rank=rank,
            cp_interleave=il,
            dcp_sharded=[True, False][: len(block_sizes)],
        )
        out = run_and_compare(make_planner(cfg), cfg, inputs, label=f"rank {rank}")
        outs.append({k: to_numpy(v) for k, v in out.as_dict().items() if k != "input_block_tables"})
    # Union of the ranks' local slots = the global mapping: every real token local on exactly one rank.
    slots = np.stack([o["slot_mappings"][0] for o in outs])
    qsl, idx = inputs["query_start_loc"], inputs["idx_mapping"]
    real = np.zeros(slots.shape[1], bool)
    for b in range(len(idx)):
        if idx[b] >= 0:
            real[qsl[b] : qsl[b + 1]] = True
    assert ((slots >= 0).sum(axis=0)[real] == 1).all()
    assert ((slots >= 0).sum(axis=0)[~real] == 0).all()
    # ... and the union equals the global mapping: token t's slot, on the rank that owns
    # its run of I positions, is its virtual block's id times B plus its local offset.
    pos = outs[0]["positions"]
    table = inputs["block_tables"][0]
    for b in range(len(idx)):
        if idx[b] < 0:
            continue
        for t in range(qsl[b], qsl[b + 1]):
            vb, vo = divmod(int(pos[t]), B * cp)
            owner = (vo // il) % cp
            lo = (vo // (il * cp)) * il + vo % il
            assert slots[owner, t] == int(table[idx[b], vb]) * B + lo, (b, t)
    # Local lengths add up to seq_lens.
    total = np.sum([o["dcp_local_seq_lens"].astype(np.int64) for o in outs], axis=0)
    assert (total == outs[0]["seq_lens"]).all()
    if two_groups:  # the unsharded group is the same on every rank
        for o in outs[1:]:
            assert (o["slot_mappings"][1] == outs[0]["slot_mappings"][1]).all()


def test_dummy_requests_only_and_empty_batch():
    cfg, inputs = random_case(np.random.default_rng(1), max_num_reqs=64, num_reqs=40, dummy_fraction=1.0)
    planner = make_planner(cfg)
    run_and_compare(planner, cfg, inputs, padded=64)
    inputs.update(idx_mapping=inputs["idx_mapping"][:0], query_start_loc=inputs["query_start_loc"][:1])
    run_and_compare(planner, cfg, inputs, padded=0)
    inputs.update(query_start_loc=np.array([3], np.int32))  # no request, yet 3 "tokens": all padding
    run_and_compare(planner, cfg, inputs, padded=0)


def test_int32_slots():
    cfg, inputs = random_case(
        np.random.default_rng(2), max_num_reqs=100, num_reqs=90, block_sizes=(64,), slot_dtype=np.int32
    )
    idx = inputs["idx_mapping"]
    row = int(idx[idx >= 0][0])
    inputs["block_tables"][0][row, :] = 2**30  # every slot of this request overflows int32
    run_and_compare(make_planner(cfg), cfg, inputs)
    assert ref(cfg, inputs).error_mask == 256


# -- state across calls: stale rows, error reset, persistent buffers ------------------------------


@pytest.mark.parametrize("block_sizes", [(16,), (16, 64)])
def test_a_sequence_of_steps_leaves_nothing_stale(block_sizes):
    rng = np.random.default_rng(3)
    cfg, state = random_case(
        rng, max_num_reqs=500, num_reqs=500, block_sizes=block_sizes, max_query=8, spare_tokens=4000
    )
    planner = make_planner(cfg)
    ptrs = None
    for step, n in enumerate([500, 20, 300, 0, 7, 499, 1]):
        inputs = new_batch(rng, cfg, state, n, max_query=8)
        padded = min(500, n + int(rng.integers(0, 40)))
        out = run_and_compare(planner, cfg, inputs, padded=padded, label=f"step {step} (num_reqs {n})")
        now = [out.positions.data.ptr, out.slot_mappings.data.ptr] + [t.data.ptr for t in out.input_block_tables]
        assert ptrs is None or now == ptrs, "the output buffers moved"
        ptrs = now


def _launch(planner, inputs, padded=None):
    """One step, not read (the records keep its errors until the next errors() or check())."""
    import cupy

    d = on_device(inputs)
    planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded)
    cupy.cuda.get_current_stream().synchronize()


def test_errors_are_sticky_until_read():
    """A bad step then errors(): reported, and a second errors() is clean; a bad step, then a
    good one, then check(): the bad one's (sticky); two bad steps: the OR of the bits, the
    smaller key; clear_errors() drops errors unread."""
    cfg, inputs = worked_example()
    planner = make_planner(cfg)
    bad = dict(inputs, idx_mapping=np.array([2, 4], np.int32))
    run_and_compare(planner, cfg, bad)  # reads them
    assert planner.errors() == (0, VLLM_NO_ERROR_KEY)
    _launch(planner, bad)
    _launch(planner, inputs)  # a good step after the bad one: writes no record
    with pytest.raises(VllmAddressingError, match="idx_mapping entry outside"):
        planner.check()
    assert planner.errors() == (0, VLLM_NO_ERROR_KEY)
    planner.check()
    bad2 = dict(inputs, num_computed_tokens=inputs["num_computed_tokens"].copy())
    bad2["num_computed_tokens"][0] = -3
    w1, w2 = ref(cfg, bad), ref(cfg, bad2)
    assert w1.error_mask and w2.error_mask and w1.error_mask != w2.error_mask
    _launch(planner, bad2)
    _launch(planner, bad)
    assert planner.errors() == (w1.error_mask | w2.error_mask, min(w1.error_key, w2.error_key))
    _launch(planner, bad)
    planner.clear_errors()
    assert planner.errors() == (0, VLLM_NO_ERROR_KEY)


def test_out_buffers_are_written_in_place_and_fully():
    import cupy

    cfg, inputs = random_case(np.random.default_rng(4), max_num_reqs=128, num_reqs=100, block_sizes=(16, 32))
    M, T = cfg.max_num_reqs, cfg.max_num_batched_tokens
    out = dict(
        positions=cupy.full(T, 77, np.int64),
        seq_lens=cupy.full(M, 77, np.int32),
        slot_mappings=cupy.full((2, T), 77, np.int64),
        input_block_tables=[cupy.full((M, w), 77, np.int32) for w in cfg.widths],
        dcp_local_seq_lens=cupy.full(M, 77, np.int32),
    )
    planner = make_planner(cfg, out=out)
    got = run_and_compare(planner, cfg, inputs)
    assert got.positions is out["positions"] and got.input_block_tables[1] is out["input_block_tables"][1]


# -- the bad-input matrix on the device ----------------------------------------------------------

GPU_ROWS = [r for r in ROWS if "gpu" in r.where]


@pytest.mark.parametrize("row", GPU_ROWS, ids=[r.id for r in GPU_ROWS])
def test_bad_input_row(row):
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    cfg_kw, inputs = row.make()
    if row.kind == "config":
        out = {"positions": cupy.zeros(6, np.int32)} if row.id == "out-wrong-dtype" else None
        with pytest.raises(row.exc, match=row.message):
            VllmStepPlanner(**cfg_kw, out=out)
        return
    cfg = VllmStepConfig(**cfg_kw)
    planner = make_planner(cfg)
    if row.kind == "host":
        args = inputs if row.id == "host-array-on-gpu-path" else on_device(inputs)
        with pytest.raises(row.exc, match=row.message):
            planner.compute(*(args[k] for k in INPUT_NAMES), num_reqs_padded=row.num_reqs_padded)
        return
    out = run_and_compare(planner, cfg, inputs, padded=row.num_reqs_padded, label=row.id)  # reads, clears
    assert ref(cfg, inputs, row.num_reqs_padded).error_mask == row.bits
    if row.bits:
        _launch(planner, inputs, row.num_reqs_padded)
        with pytest.raises(VllmAddressingError, match=re.escape(VLLM_ERROR_REASONS[row.bits])):
            planner.check()
    planner.check()  # clear (check() cleared the records)
    if row.check is not None:
        host = type(out)(**{k: (tuple(map(to_numpy, v)) if isinstance(v, tuple) else to_numpy(v))
                            for k, v in out.as_dict().items()})  # fmt: skip
        assert row.check(host)


# -- streams and CUDA graphs ---------------------------------------------------------------------


def test_cupy_graph_replay_with_new_contents():
    import cupy

    rng = np.random.default_rng(5)
    cfg, state = random_case(rng, max_num_reqs=256, num_reqs=256, block_sizes=(16, 64), max_query=4, spare_tokens=900)
    planner = make_planner(cfg)
    n, padded = 200, 224
    first = new_batch(rng, cfg, state, n, max_query=4)
    d = on_device(first)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=stream)  # warm, outside capture
    stream.synchronize()
    stream.begin_capture()
    planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=stream)
    graph = stream.end_capture()
    for i in range(4):
        step = new_batch(rng, cfg, state, n, max_query=4)
        step["num_computed_tokens"] = state["num_computed_tokens"].copy()
        step["num_computed_tokens"][rng.integers(0, 256, 10)] = 0  # contents change too
        for k in INPUT_NAMES:
            src, dst = step[k], d[k]
            if isinstance(dst, list):
                for a, b in zip(src, dst):
                    b.set(a, stream=stream)
            else:
                dst.set(src, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        want = ref(cfg, step, padded)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {i}")
        assert planner.errors(stream) == (want.error_mask, want.error_key)


def test_torch_tensors_stream_and_graph():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    cfg, state = random_case(rng, max_num_reqs=128, num_reqs=128, block_sizes=(16, 64), max_query=3, spare_tokens=300)
    M, T, G = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups
    dev = torch.device("cuda", 0)
    out = dict(
        positions=torch.zeros(T, dtype=torch.int64, device=dev),
        seq_lens=torch.zeros(M, dtype=torch.int32, device=dev),
        slot_mappings=torch.zeros((G, T), dtype=torch.int64, device=dev),
        input_block_tables=[torch.zeros((M, w), dtype=torch.int32, device=dev) for w in cfg.widths],
        dcp_local_seq_lens=torch.zeros(M, dtype=torch.int32, device=dev),
    )
    planner = make_planner(cfg, out=out)
    n, padded = 100, 112

    def to_torch(x):
        return [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in x] if isinstance(x, list) else (
            torch.from_numpy(np.ascontiguousarray(x)).to(dev))  # fmt: skip

    first = new_batch(rng, cfg, state, n, max_query=3)
    t_in = {k: to_torch(first[k]) for k in INPUT_NAMES}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        res = planner.compute(*(t_in[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=side)
    side.synchronize()
    assert res.positions is out["positions"]
    assert_same(res, ref(cfg, first, padded).outputs.as_dict(), "torch stream")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.compute(*(t_in[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=torch.cuda.current_stream())
    for i in range(4):
        step = new_batch(rng, cfg, state, n, max_query=3)
        for k in INPUT_NAMES:
            src = to_torch(step[k])
            if isinstance(src, list):
                for a, b in zip(t_in[k], src):
                    a.copy_(b)
            else:
                t_in[k].copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(planner.outputs, ref(cfg, step, padded).outputs.as_dict(), f"torch replay {i}")


def test_graphs_of_different_sizes_replayed_in_turn():
    """Two captured steps (200 and 30 requests) replayed alternately: the rows the bigger one
    filled are zeroed by the smaller one's replay (state kept on the device, not the host)."""
    import cupy

    rng = np.random.default_rng(11)
    cfg, state = random_case(rng, max_num_reqs=256, num_reqs=256, block_sizes=(16, 64), max_query=3, spare_tokens=900)
    planner = make_planner(cfg)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    for n, padded in ((200, 208), (30, 32)):
        batch = new_batch(rng, cfg, state, n, max_query=3)
        d = on_device(batch)
        cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
        planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=stream)  # warm
        stream.synchronize()
        stream.begin_capture()
        planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded, stream=stream)
        graphs.append((stream.end_capture(), batch, padded, d))  # d: the graph reads these arrays
    for i in range(5):
        graph, batch, padded, _ = graphs[i % 2]
        graph.launch(stream)
        stream.synchronize()
        want = ref(cfg, batch, padded)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {i}")
        assert planner.errors(stream) == (want.error_mask, want.error_key)


@pytest.mark.parametrize("max_query", [1, 40])
def test_every_gather_width(max_query):
    """Batches whose (group, row) pairs take each gather width (auto_pair_lanes: 32, 16 and 8
    lanes per pair), one after the other on one planner."""
    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(max_query)
    cfg, state = random_case(
        rng, max_num_reqs=2000, num_reqs=2000, block_sizes=(16, 64, 5), max_query=max_query,
        spare_tokens=2000 * max_query, sliding_window_reach=[0, 0, 40], max_context=9000,
    )  # fmt: skip
    planner = make_planner(cfg)
    sizes = [1900, 3, 699, 100]
    assert {VllmStepPlanner.auto_pair_lanes(3 * n) for n in sizes} == {8, 16, 32}
    for step, n in enumerate(sizes):
        inputs = new_batch(rng, cfg, state, n, max_query=max_query)
        run_and_compare(planner, cfg, inputs, padded=min(2000, n + 5), label=f"step {step}, {n} requests")


# -- scale -------------------------------------------------------------------------------------


def test_more_than_4096_requests():
    rng = np.random.default_rng(8)
    cfg, inputs = random_case(rng, max_num_reqs=6000, num_reqs=5500, block_sizes=(16, 64), max_query=3)
    run_and_compare(make_planner(cfg), cfg, inputs, padded=5600)


# Batch sizes on each side of the token blocks' edges: below 2048 requests each token block
# copies the batch into shared memory, 1, 2, 4 or 8 entries a thread (query_start_loc[num_reqs]
# written by one thread when num_reqs fills them); from 2048 it searches global memory.
COPY_EDGES = [1, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049]


@pytest.mark.parametrize("memory", ["device", "pinned"])
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64], ids=["idx32", "idx64"])
def test_batch_sizes_at_each_edge_of_the_shared_memory_copy(memory, idx_dtype):
    """Decode, mixed and corrupted batches of every size in COPY_EDGES on one planner, against
    the reference (outputs and error record); num_blocks in device or pinned host memory, rows
    wider than the gather's first chunk."""
    import cupy

    from kvaddr.measure.vllm_workload import pinned_num_blocks
    from tests.support.vllm_cases import corrupt

    rng = np.random.default_rng(31 if idx_dtype is np.int32 else 32)
    M = 2100
    cfg, state = random_case(
        rng, max_num_reqs=M, num_reqs=M, block_sizes=(16, 64), max_query=9, max_context=5000,
        spare_tokens=9 * M, idx_dtype=idx_dtype,
    )  # fmt: skip
    assert max(cfg.widths) > 8 * 32
    planner = make_planner(cfg)
    host, view = pinned_num_blocks(np.stack(state["num_blocks"]).astype(np.int32))
    for n in COPY_EDGES:
        for max_query, bad in ((1, False), (9, False), (9, True)):
            x = new_batch(rng, cfg, state, n, max_query=max_query)
            if bad:
                x = corrupt(rng, cfg, x, rate=0.02)
            d = on_device(x)
            if memory == "pinned":
                host[...] = np.stack(x["num_blocks"])
                d["num_blocks"] = view
            padded = min(M, n + 3)
            out = planner.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded)
            cupy.cuda.get_current_stream().synchronize()
            assert planner.staged == (memory == "pinned")
            want = ref(cfg, x, padded)
            label = f"{n} requests, max_query {max_query}" + (", corrupted" if bad else "")
            assert_same(out, want.outputs.as_dict(), label)
            assert planner.errors() == (want.error_mask, want.error_key), label


def test_a_million_tokens():
    rng = np.random.default_rng(9)
    cfg, inputs = random_case(
        rng, max_num_reqs=400, num_reqs=300, block_sizes=(16, 64), max_query=7000, max_context=2000, dummy_fraction=0.05
    )
    assert cfg.max_num_batched_tokens > 1_000_000 or int(inputs["query_start_loc"][-1]) > 900_000
    run_and_compare(make_planner(cfg), cfg, inputs, padded=320)


def test_state_arrays_are_remembered_by_identity_and_replacements_are_seen():
    import cupy

    rng = np.random.default_rng(10)
    cfg, state = random_case(rng, max_num_reqs=64, num_reqs=64, block_sizes=(16, 64), max_query=2, spare_tokens=200)
    planner = make_planner(cfg)
    d = on_device(state)
    batch = new_batch(rng, cfg, state, 40, max_query=2)
    b = on_device({k: batch[k] for k in ("idx_mapping", "query_start_loc")})

    def step(host_state):
        out = planner.compute(
            b["idx_mapping"], b["query_start_loc"], d["num_computed_tokens"], d["block_tables"], d["num_blocks"], 48
        )
        cupy.cuda.get_current_stream().synchronize()
        want = ref(
            cfg, dict(host_state, idx_mapping=batch["idx_mapping"], query_start_loc=batch["query_start_loc"]), 48
        )
        assert_same(out, want.outputs.as_dict())

    step(state)
    # The same objects with new contents.
    state["block_tables"][0][:] = rng.integers(0, 1000, state["block_tables"][0].shape).astype(np.int32)
    d["block_tables"][0].set(state["block_tables"][0])
    step(state)
    # An element of the same list replaced by a new array (new pointer).
    state["block_tables"][1] = state["block_tables"][1] + 7
    d["block_tables"][1] = cupy.asarray(state["block_tables"][1])
    state["num_blocks"][0] = np.maximum(state["num_blocks"][0] - 1, 0)
    d["num_blocks"][0] = cupy.asarray(state["num_blocks"][0])
    step(state)
    # A new num_computed_tokens object.
    state["num_computed_tokens"] = np.zeros_like(state["num_computed_tokens"])
    d["num_computed_tokens"] = cupy.asarray(state["num_computed_tokens"])
    step(state)
    planner.forget_inputs()
    step(state)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cp", [1, 2])
def test_corrupted_inputs_match_the_reference_bits_and_keys(seed, cp):
    from tests.support.vllm_cases import corrupt

    rng = np.random.default_rng(100 + seed)
    cfg, inputs = random_case(
        rng, max_num_reqs=200, num_reqs=150, block_sizes=(4, 16), max_query=6, cp_size=cp,
        slot_dtype=np.int32 if seed % 2 else np.int64,
    )  # fmt: skip
    bad = corrupt(rng, cfg, inputs, rate=0.05)
    run_and_compare(make_planner(cfg), cfg, bad, padded=160, label=f"seed {seed}")


def test_readme_snippet_on_torch_tensors():
    """The README's vLLM example, verbatim apart from the asserts."""
    torch = pytest.importorskip("torch")
    from kvaddr.engines.vllm import VllmStepPlanner

    dev = "cuda"
    # vLLM's request state (rows r), persistent on the GPU
    num_computed_tokens = torch.tensor([9, 0, 5, 0], dtype=torch.int32, device=dev)
    block_table = torch.tensor(
        [[1, 3, 8, -1], [0, 0, 0, 0], [7, 2, -1, -1], [0, 0, 0, 0]], dtype=torch.int32, device=dev
    )
    num_blocks = torch.tensor([[3, 0, 2, 0]], dtype=torch.int32, device=dev)  # [groups, rows]
    # the engine's persistent output buffers (what its CUDA graphs read)
    positions = torch.zeros(6, dtype=torch.int64, device=dev)
    slot_mappings = torch.zeros((1, 6), dtype=torch.int64, device=dev)
    planner = VllmStepPlanner(
        max_num_reqs=4, max_num_batched_tokens=6, block_sizes=[4], widths=[4],
        out={"positions": positions, "slot_mappings": slot_mappings},
    )  # fmt: skip
    # this step: batch entry 0 is row 2 (1 token), entry 1 is row 0 (2 tokens)
    idx_mapping = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)
    out = planner.compute(
        idx_mapping, query_start_loc, num_computed_tokens, [block_table], num_blocks,
        num_reqs_padded=2, stream=torch.cuda.current_stream(),
    )  # fmt: skip
    planner.check()  # optional: synchronises; raises VllmAddressingError on bad values
    assert positions.tolist() == [5, 9, 10, 0, 0, 0]
    assert slot_mappings.tolist() == [[9, 33, 34, -1, -1, -1]]
    assert out.seq_lens.tolist() == [6, 11, 0, 0]
    assert out.input_block_tables[0][:2].tolist() == [[7, 2, 0, 0], [1, 3, 8, 0]]
