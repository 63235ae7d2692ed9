"""VllmStepPlanner.compute()'s memo of checked inputs on the GPU, against the NumPy reference.

An engine passes the same persistent buffers every step with new contents, and sometimes
with new metadata in place (torch's ``resize_``, CuPy's ``shape`` setter). Every step here is
compared with the reference; the memoised calls are proven to skip the checks (``describe``
is counted) and the changed ones to be checked and launched with the new values. The
one-launch kernel (``vllm_step<false>``). Skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines import vllm as vllm_module
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import assert_same, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


@pytest.fixture
def described(monkeypatch):
    names: list = []
    real = vllm_module.describe

    def describe(name, x):
        if not name.startswith("out."):
            names.append(name)
        return real(name, x)

    monkeypatch.setattr(vllm_module, "describe", describe)
    return names


def _ref(cfg, x, padded):
    return vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded)


def test_cupy_steps_on_persistent_buffers(described):
    import cupy

    rng = np.random.default_rng(21)
    cfg, state = random_case(rng, max_num_reqs=300, num_reqs=200, block_sizes=(16, 64), max_query=1, spare_tokens=50)
    planner = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    n = 200
    x = new_batch(rng, cfg, state, n, max_query=1)
    d = {k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}
    cupy.cuda.runtime.deviceSynchronize()
    checked = None
    for step, padded in enumerate((200, 240, 200, 300, 210, 210)):
        out = planner.compute(*(d[k] for k in NAMES), padded, stream=stream)
        stream.synchronize()
        want = _ref(cfg, x, padded)
        assert_same(out, want.outputs.as_dict(), f"step {step}")
        assert planner.errors(stream) == (want.error_mask, want.error_key)
        if step == 0:  # the first call checks everything; the second (the same objects) idx_mapping and
            # query_start_loc again (the request state is remembered) and makes the memo
            assert len(described) == 3 + 2 * cfg.num_groups and planner._memo is None
        elif checked is None:
            checked = len(described)
            assert checked == 3 + 2 * cfg.num_groups + 2 and planner._memo is not None
        else:
            assert len(described) == checked, f"step {step}: a memoised call checked its inputs again"
        # the next step: new contents in the same buffers, and new request state contents
        x = new_batch(rng, cfg, state, n, max_query=1)
        d["idx_mapping"].set(x["idx_mapping"], stream=stream)
        d["query_start_loc"].set(x["query_start_loc"], stream=stream)
        stream.synchronize()
    assert planner._memo is not None


def test_cupy_changes_in_place_are_checked(described):
    import cupy

    rng = np.random.default_rng(22)
    cfg, state = random_case(rng, max_num_reqs=64, num_reqs=40, block_sizes=(16, 4), max_query=1, spare_tokens=50)
    planner = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
    x = new_batch(rng, cfg, state, 40, max_query=1)
    d = {k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}

    def step(label):
        out = planner.compute(*(d[k] for k in NAMES), 48)
        cupy.cuda.get_current_stream().synchronize()
        assert_same(out, _ref(cfg, x, 48).outputs.as_dict(), f"{label}")

    step("first")
    step("memoised")
    n = len(described)
    nct = d["num_computed_tokens"]
    nct.shape = (cfg.max_num_reqs // 2, 2)  # CuPy's shape setter: the same object, now 2-D
    with pytest.raises(ValueError, match=r"num_computed_tokens must be int32 with shape"):
        planner.compute(*(d[k] for k in NAMES), 48)
    assert planner._memo is None
    nct.shape = (cfg.max_num_reqs,)
    step("restored")
    assert len(described) > n
    # a table of the same list replaced by a copy with new contents (a new pointer)
    x["block_tables"][1] = x["block_tables"][1].copy()
    x["block_tables"][1][::3] = 0
    d["block_tables"][1] = cupy.asarray(x["block_tables"][1])
    step("new table")
    n = len(described)
    step("memoised again")
    assert len(described) == n


def test_torch_resize_in_place_and_graph_capture(described):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    cfg, state = random_case(rng, max_num_reqs=160, num_reqs=160, block_sizes=(16, 64), max_query=1, spare_tokens=60)
    M = cfg.max_num_reqs
    dev = torch.device("cuda", 0)
    planner = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    d = {k: [t(a) for a in state[k]] if isinstance(state[k], list) else t(state[k]) for k in NAMES[2:]}
    # idx_mapping and query_start_loc: persistent tensors whose length follows the batch (resize_ in place)
    idx = torch.zeros(M, dtype=torch.int32, device=dev)
    qsl = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    ptrs = idx.data_ptr(), qsl.data_ptr()
    s = torch.cuda.Stream()

    def load(x):
        n = x["idx_mapping"].shape[0]
        idx.resize_(n)
        qsl.resize_(n + 1)
        idx.copy_(t(x["idx_mapping"].astype(np.int32)))
        qsl.copy_(t(x["query_start_loc"]))
        assert (idx.data_ptr(), qsl.data_ptr()) == ptrs  # the same memory: only the shape changed

    for i, n in enumerate((120, 120, 60, 160, 160, 90)):
        x = new_batch(rng, cfg, state, n, max_query=1)
        load(x)
        padded = min(n + 8, M)
        before = len(described)
        s.wait_stream(torch.cuda.current_stream())  # load()'s copies ran on the current stream; s is non-blocking
        with torch.cuda.stream(s):
            out = planner.compute(idx, qsl, *(d[k] for k in NAMES[2:]), padded, stream=s)
        s.synchronize()
        want = _ref(cfg, x, padded)
        assert_same(out, want.outputs.as_dict(), f"step {i} (n = {n})")
        assert planner.errors() == (want.error_mask, want.error_key)
        assert planner._params.num_reqs == n
        if i == 4:  # the same shapes as step 3, whose checked call (the same objects again) made the memo
            assert len(described) == before, f"step {i}"
        else:  # idx_mapping and query_start_loc changed in place, or (step 1) the second call with the
            # same objects, which makes the memo: checked again
            assert len(described) >= before + 2, f"step {i}"

    # a bad change in place after a memoised call: refused as on a first call
    nct = d["num_computed_tokens"]
    nct.resize_(M - 1)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be int32 with shape \(rows >= max_num_reqs"):
        planner.compute(idx, qsl, *(d[k] for k in NAMES[2:]), 96, stream=s)
    nct.resize_(M)

    # captured (the memoised path launches inside the capture), contents changed between replays
    n = 96
    x = new_batch(rng, cfg, state, n, max_query=1)
    load(x)
    planner.compute(idx, qsl, *(d[k] for k in NAMES[2:]), n, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.compute(idx, qsl, *(d[k] for k in NAMES[2:]), n, stream=torch.cuda.current_stream())
    for r in range(3):
        x = new_batch(rng, cfg, state, n, max_query=1)
        load(x)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        want = _ref(cfg, x, n)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {r}")


def test_memo_on_and_off_agree():
    import cupy

    rng = np.random.default_rng(24)
    cfg, state = random_case(rng, max_num_reqs=500, num_reqs=400, block_sizes=(16, 64, 5), max_query=1, spare_tokens=40)
    kw = planner_kwargs(cfg)
    on = vllm_module.VllmStepPlanner(**kw)
    off = vllm_module.VllmStepPlanner(**kw)
    off.memoize_checks = False
    x = new_batch(rng, cfg, state, 400, max_query=1)
    d = {k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}
    for step in range(4):
        a = on.compute(*(d[k] for k in NAMES), 450)
        b = off.compute(*(d[k] for k in NAMES), 450)
        cupy.cuda.get_current_stream().synchronize()
        want = _ref(cfg, x, 450).outputs.as_dict()
        assert_same(a, want, f"memo on, step {step}")
        assert_same(b, want, f"memo off, step {step}")
        x = new_batch(rng, cfg, state, 400, max_query=1)
        d["idx_mapping"].set(x["idx_mapping"])
        d["query_start_loc"].set(x["query_start_loc"])
    assert on._memo is not None and off._memo is None


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_one_table_object_for_two_groups_then_resized_in_place(described, lib):
    """Two groups of the same block size given the SAME table object (and the same num_blocks
    array): memoised (the guard reads that object's signature once), then the table is resized
    in place (torch ``resize_`` to more rows: new memory; CuPy's shape setter to fewer rows than
    max_num_reqs: refused as on a first call). Every launch against the reference."""
    rng = np.random.default_rng(25)
    cfg, state = random_case(rng, max_num_reqs=64, num_reqs=48, block_sizes=(16, 16), max_query=2, spare_tokens=40)
    M = cfg.max_num_reqs
    state["block_tables"][1] = state["block_tables"][0]
    state["num_blocks"][1] = state["num_blocks"][0]
    planner = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
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

    table, nb = dev(state["block_tables"][0]), dev(state["num_blocks"][0])
    nct = dev(state["num_computed_tokens"])
    tables, nbs = [table, table], [nb, nb]

    def step(label, n=48, checked=None):
        x = new_batch(rng, cfg, state, n, max_query=2)
        idx, qsl = dev(x["idx_mapping"]), dev(x["query_start_loc"])
        before = len(described)
        out = planner.compute(idx, qsl, nct, tables, nbs, n)
        sync()
        want = _ref(cfg, x, n)
        assert_same(out, want.outputs.as_dict(), f"{lib} {label}")
        assert planner.errors() == (want.error_mask, want.error_key), label
        if checked is not None:  # the request state (one table and one num_blocks object) checked again or not
            assert (len(described) - before > 2) == checked, label
        return idx, qsl

    idx, qsl = step("first")
    planner.compute(idx, qsl, nct, tables, nbs, 48)  # the same objects again: checked, and memoised
    for _ in range(2):  # the same objects: memoised
        before = len(described)
        planner.compute(idx, qsl, nct, tables, nbs, 48)
        assert len(described) == before and planner._memo is not None
    if lib == "torch":
        ptr = table.data_ptr()
        table.resize_(2 * M, table.shape[1])  # more rows: new memory, the old rows copied
        table[M:] = -7  # rows beyond max_num_reqs: never read
        assert table.data_ptr() != ptr
        before = len(described)
        planner.compute(idx, qsl, nct, tables, nbs, 48)
        assert len(described) > before, "the resized table was not checked again"
        assert planner._params.block_table[0] == planner._params.block_table[1] == table.data_ptr()
        assert planner._params.table_stride[0] == table.stride(0)
        step("resized, memoised again")
        table.resize_(M - 1, table.shape[1])  # fewer rows than max_num_reqs, the same memory
    else:
        table.shape = (M // 2, 2 * table.shape[1])  # the same memory, another shape
    with pytest.raises(ValueError, match=r"block_tables\[0\] must be int32 with shape \(rows >= 64"):
        planner.compute(idx, qsl, nct, tables, nbs, 48)
    assert planner._memo is None
    if lib == "torch":
        table.resize_(M, table.shape[1])
    else:
        table.shape = (M, table.shape[1] // 2)
    step("restored", checked=True)
    step("memoised after the restore", checked=False)
