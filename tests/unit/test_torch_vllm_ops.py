"""``torch.ops.kvaddr.vllm_step_into`` (the vLLM step as a PyTorch op) on the CPU: the packed layout of
``VllmStepBuffers``, equality with the NumPy reference (docs/vllm.md's worked example, random batches,
DCP, int32 slots, bad values), opcheck, torch.compile(fullgraph=True) equal to eager with no graph
break, and bad arguments raising errors that name the argument (real and fake kernels). Skips without
torch. tests/gpu/test_torch_vllm_ops_gpu.py runs the CUDA kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY, VllmAddressingError
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.torch_ops import torch_skip_reason, vllm_case_tensors
from tests.support.vllm_cases import (
    WORKED_EXAMPLE_OUTPUTS,
    assert_same,
    corrupt,
    new_batch,
    random_case,
    worked_example,
)

SKIP = torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def tensors(inputs, device="cpu"):
    return vllm_case_tensors(inputs, device)


def reference(cfg, inputs, padded=None):
    return vllm_step_reference(cfg, **inputs, num_reqs_padded=padded)


def run(cfg, inputs, bufs=None, padded=None, poison=True):
    from kvaddr.torch import VllmStepBuffers, vllm_step

    bufs = bufs or VllmStepBuffers(config=cfg, device="cpu")
    if poison:
        from kvaddr.errors import reset_error_records

        bufs.storage.fill_(0x5A5A5A5A)
        reset_error_records(bufs.records)  # sticky records: the caller clears them (or reads them)
    out = vllm_step(*tensors(inputs), bufs, num_reqs_padded=padded)
    return out, bufs


def test_worked_example_equals_the_docs():
    cfg, inputs = worked_example()
    out, bufs = run(cfg, inputs)
    want = WORKED_EXAMPLE_OUTPUTS
    assert_same(out, want, "worked example")
    assert out is bufs.outputs
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)
    bufs.check()


@pytest.mark.parametrize("rank,slot", [(0, -1), (1, 30)])
def test_worked_example_with_dcp(rank, slot):
    cfg, inputs = worked_example(cp_size=2, cp_rank=rank, cp_interleave=1)
    out, _ = run(cfg, inputs)
    assert int(out.slot_mappings[0, 0]) == slot
    assert int(out.dcp_local_seq_lens[0]) == 3


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_sizes,max_query", [((16,), 1), ((16, 32), 7), ((4, 8, 16, 64), 3)])
def test_random_batches_equal_the_reference(seed, block_sizes, max_query):
    rng = np.random.default_rng(seed)
    M = int(rng.integers(1, 40))
    n = int(rng.integers(0, M + 1))
    cfg, inputs = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=n,
        block_sizes=block_sizes,
        max_query=max_query,
        idx_dtype=np.int64 if seed % 2 else np.int32,
        slot_dtype=np.int32 if seed % 3 == 0 else np.int64,
    )
    padded = int(rng.integers(n, M + 1))
    out, bufs = run(cfg, inputs, padded=padded)
    ref = reference(cfg, inputs, padded)
    assert_same(out, ref.outputs.as_dict(), f"seed {seed}")
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    # The next step over the same request state, on the same buffers (nothing stale).
    n2 = int(rng.integers(0, min(n, cfg.max_num_batched_tokens) + 1))
    step2 = new_batch(rng, cfg, inputs, num_reqs=n2, max_query=1)
    out2, _ = run(cfg, step2, bufs=bufs, poison=False)
    assert_same(out2, reference(cfg, step2).outputs.as_dict(), f"seed {seed}, step 2")


@pytest.mark.parametrize("cp,interleave", [(2, 1), (4, 4)])
def test_dcp_every_rank_equals_the_reference(cp, interleave):
    for rank in range(cp):
        rng = np.random.default_rng(100 + rank)
        cfg, inputs = random_case(
            rng, max_num_reqs=12, num_reqs=9, block_sizes=(8, 16), cp_size=cp, cp_rank=rank, cp_interleave=interleave
        )
        out, _ = run(cfg, inputs)
        assert_same(out, reference(cfg, inputs).outputs.as_dict(), f"rank {rank}")


@pytest.mark.parametrize("seed", range(4))
def test_bad_values_are_recorded_like_the_reference(seed):
    rng = np.random.default_rng(seed)
    cfg, inputs = random_case(rng, max_num_reqs=20, num_reqs=15, block_sizes=(16, 8), max_query=4)
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    out, bufs = run(cfg, bad)
    ref = reference(cfg, bad)
    assert_same(out, ref.outputs.as_dict(), f"seed {seed}")
    assert ref.error_mask, "corrupt() made no error"
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)  # the read reset the records
    # sticky: the bad step, then a good one, then the read: the bad step's record
    run(cfg, bad, bufs=bufs, poison=False)
    run(cfg, inputs, bufs=bufs, poison=False)
    with pytest.raises(VllmAddressingError):
        bufs.check()
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)
    # two bad steps: the OR of the bits, the smaller key; clear_errors drops them unread
    run(cfg, bad, bufs=bufs, poison=False)
    run(cfg, bad, bufs=bufs, poison=False)
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    run(cfg, bad, bufs=bufs, poison=False)
    bufs.clear_errors()
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)


@pytest.mark.parametrize("slot_dtype", ["int64", "int32"])
@pytest.mark.parametrize(
    "block_sizes,widths,M,T", [([4], [4], 1, 1), ([16, 32], [5, 300], 7, 33), ([8] * 4, 3, 600, 9000)]
)
def test_packed_views_are_aligned_disjoint_and_inside_the_storage(slot_dtype, block_sizes, widths, M, T):
    import torch

    from kvaddr.torch import VllmStepBuffers
    from kvaddr.torch.vllm_ops import num_records

    bufs = VllmStepBuffers(M, T, block_sizes, widths, slot_dtype=getattr(torch, slot_dtype), device="cpu")
    G = len(block_sizes)
    W = [widths] * G if isinstance(widths, int) else widths
    want = [
        ("positions", bufs.positions, torch.int64, (T,)),
        ("seq_lens", bufs.seq_lens, torch.int32, (M,)),
        ("slot_mappings", bufs.slot_mappings, getattr(torch, slot_dtype), (G, T)),
        *((f"input_block_tables[{g}]", bufs.input_block_tables[g], torch.int32, (M, W[g])) for g in range(G)),
        ("dcp_local_seq_lens", bufs.dcp_local_seq_lens, torch.int32, (M,)),
        ("records", bufs.records, torch.int64, (num_records(bufs.config), 2)),
    ]
    base, end = bufs.storage.data_ptr(), bufs.storage.data_ptr() + 8 * bufs.storage.numel()
    spans = []
    for name, t, dt, shape in want:
        assert (t.dtype, tuple(t.shape)) == (dt, shape), name
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == bufs.storage.untyped_storage().data_ptr()
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        assert (lo - base) % 256 == 0 and base <= lo < hi <= end, name
        spans.append((lo, hi))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping views"
    # Initial contents: zeros, slots -1, no error.
    assert int(bufs.slot_mappings.min()) == int(bufs.slot_mappings.max()) == -1
    assert int(bufs.positions.abs().sum()) == 0 and bufs.errors() == (0, VLLM_NO_ERROR_KEY)


def test_layout_handles_name_equal_configs_and_refuse_others():
    import torch

    from kvaddr.torch import VllmStepBuffers

    a = VllmStepBuffers(4, 8, [4], [3], device="cpu")
    b = VllmStepBuffers(4, 8, [4], [3], device="cpu")
    c = VllmStepBuffers(4, 8, [4], [3], slot_dtype=torch.int32, device="cpu")
    assert a.layout == b.layout != c.layout
    _, inputs = worked_example()
    with pytest.raises(ValueError, match="layout must be a VllmStepBuffers.layout handle"):
        torch.ops.kvaddr.vllm_step_into(*tensors(inputs), 2, a.storage, 10**6)


def test_opcheck_passes():
    import torch
    from torch.library import opcheck

    from kvaddr.torch import VllmStepBuffers

    rng = np.random.default_rng(3)
    cfg, inputs = random_case(rng, max_num_reqs=9, num_reqs=6, block_sizes=(8, 16), max_query=3)
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    result = opcheck(torch.ops.kvaddr.vllm_step_into.default, (*tensors(inputs), 7, bufs.storage, bufs.layout))
    assert all(v == "SUCCESS" for v in result.values()), result


def _compile_case():
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(5)
    cfg, inputs = random_case(rng, max_num_reqs=16, num_reqs=11, block_sizes=(16, 8), max_query=4)
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    hidden = torch.randn(64, 8)

    def model(idx, qsl, nct, t0, t1, nb, hidden):
        out = vllm_step(idx, qsl, nct, [t0, t1], nb, bufs, num_reqs_padded=13)
        h = hidden[out.positions % hidden.shape[0]].sum(-1)
        return h + out.slot_mappings[1].to(h.dtype), out.seq_lens * 1, out.input_block_tables[0] + 0

    idx, qsl, nct, tables, nb = tensors(inputs)
    return cfg, inputs, bufs, model, (idx, qsl, nct, *tables, nb, hidden)


def test_no_graph_break():
    import torch

    _, _, _, model, args = _compile_case()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def _views(bufs):
    o = bufs.outputs
    return [o.positions, o.seq_lens, o.slot_mappings, *o.input_block_tables, o.dcp_local_seq_lens, bufs.records]


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_compiled_fullgraph_equals_eager_and_the_reference(backend):
    import torch

    cfg, inputs, bufs, model, args = _compile_case()
    want = [x.clone() for x in model(*args)]
    want_views = [x.clone() for x in _views(bufs)]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    bufs.storage.fill_(7)
    bufs.clear_errors()  # the sticky records: the op only merges into them
    got = compiled(*args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, w in zip(_views(bufs), want_views):  # the mutation reached the storage
        assert torch.equal(g, w)
    assert_same(bufs.outputs, reference(cfg, inputs, 13).outputs.as_dict(), backend)
    # New contents, the same tensors: the compiled function follows them.
    args[0].copy_(args[0].flip(0))
    args[2].add_(3)
    inputs2 = dict(inputs, idx_mapping=args[0].numpy().copy(), num_computed_tokens=args[2].numpy().copy())
    compiled(*args)
    assert_same(bufs.outputs, reference(cfg, inputs2, 13).outputs.as_dict(), f"{backend}, new contents")


def _bad_args(**over):
    import torch

    from kvaddr.torch import VllmStepBuffers

    cfg, inputs = worked_example(block_sizes=[4, 2], widths=[4, 8])
    inputs["block_tables"] = [inputs["block_tables"][0], np.zeros((4, 8), np.int32)]
    inputs["num_blocks"] = [inputs["num_blocks"][0], np.zeros(4, np.int32)]
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    idx, qsl, nct, tables, nb = tensors(inputs)
    a = dict(idx=idx, qsl=qsl, nct=nct, tables=tables, nb=nb, padded=2, out=bufs.storage, layout=bufs.layout)
    a.update(over)
    return a, torch


BAD = [
    (dict(idx=np.array([2, 0], np.int16)), TypeError, "idx_mapping must be int32 or int64"),
    (dict(idx=np.zeros((2, 1), np.int32)), ValueError, "idx_mapping must be int32 or int64 with shape"),
    (dict(idx=np.zeros(5, np.int32)), ValueError, "idx_mapping must have at most max_num_reqs = 4"),
    (dict(qsl=np.array([0, 1], np.int32)), ValueError, r"query_start_loc must be int32 with shape \(num_reqs \+ 1"),
    (dict(qsl=np.array([0, 1, 3], np.int64)), TypeError, "query_start_loc must be int32"),
    (dict(nct=np.zeros(3, np.int32)), ValueError, r"num_computed_tokens must be int32 with shape \(rows >= "),
    (dict(tables=[np.zeros((4, 4), np.int32)]), ValueError, "block_tables must be a list of 2 tables"),
    (dict(tables=[np.zeros((4, 4), np.int64), np.zeros((4, 8), np.int32)]), TypeError, r"block_tables\[0\] must"),
    (dict(tables=[np.zeros((4, 4), np.int32), np.zeros((4, 7), np.int32)]), ValueError, r"block_tables\[1\] must"),
    (dict(tables=[np.zeros((3, 4), np.int32), np.zeros((4, 8), np.int32)]), ValueError, r"rows >= 4"),
    (dict(nb=np.zeros((2, 3), np.int32)), ValueError, r"num_blocks must be int32 with shape \(2, rows >= 4\)"),
    (dict(nb=np.zeros((2, 4), np.int64)), TypeError, "num_blocks must be int32"),
    (dict(padded=1), ValueError, r"num_reqs_padded must be an int in \[num_reqs = 2, max_num_reqs = 4\]"),
    (dict(padded=5), ValueError, "num_reqs_padded must be an int in"),
    (dict(out=np.zeros(10, np.int64)), ValueError, "out must be the VllmStepBuffers.storage of this layout"),
]


def _apply(a, torch, over):
    for k, v in over.items():
        if isinstance(v, np.ndarray):
            a[k] = torch.from_numpy(v)
        elif isinstance(v, list):
            a[k] = [torch.from_numpy(x) for x in v]
    return a


@pytest.mark.parametrize("over,exc,message", BAD, ids=[m for _, _, m in BAD])
@pytest.mark.parametrize("mode", ["eager", "fake"])
def test_bad_arguments_raise_naming_the_argument(over, exc, message, mode):
    a, torch = _bad_args(**over)
    a = _apply(a, torch, over)
    args = (a["idx"], a["qsl"], a["nct"], a["tables"], a["nb"], a["padded"], a["out"], a["layout"])
    if mode == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as m:
            fargs = [
                [m.from_tensor(t) for t in x] if isinstance(x, list) else (m.from_tensor(x) if hasattr(x, "dim") else x)
                for x in args
            ]
            with pytest.raises(exc, match=message):
                torch.ops.kvaddr.vllm_step_into(*fargs)
        return
    with pytest.raises(exc, match=message):
        torch.ops.kvaddr.vllm_step_into(*args)


def test_tensors_on_another_device_are_refused():
    a, torch = _bad_args()
    nct = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises((ValueError, NotImplementedError, RuntimeError), match="num_computed_tokens must be on|meta"):
        torch.ops.kvaddr.vllm_step_into(a["idx"], a["qsl"], nct, a["tables"], a["nb"], 2, a["out"], a["layout"])


def test_one_group_takes_a_one_dimensional_num_blocks_and_a_list_of_counts():
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    cfg, inputs = worked_example()
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    idx, qsl, nct, tables, nb = tensors(inputs)
    want = reference(cfg, inputs).outputs.as_dict()
    assert_same(vllm_step(idx, qsl, nct, tables[0], nb[0], bufs), want, "1-d num_blocks")
    bufs.storage.fill_(3)
    assert_same(vllm_step(idx, qsl, nct, tables, [nb[0]], bufs), want, "list of counts")
    with pytest.raises(ValueError, match="num_blocks must be int32 with shape"):
        torch.ops.kvaddr.vllm_step_into(idx, qsl, nct, tables, nb[0][:3], 2, bufs.storage, bufs.layout)


def test_buffers_refuse_a_bad_configuration():
    from kvaddr.torch import VllmStepBuffers

    with pytest.raises(ValueError, match="block_sizes must name 1 to 4 groups"):
        VllmStepBuffers(4, 8, [], [], device="cpu")
    with pytest.raises(TypeError, match="config must be a VllmStepConfig"):
        VllmStepBuffers(config={"max_num_reqs": 4}, device="cpu")


def test_import_kvaddr_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, kvaddr, kvaddr.engines.vllm; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the CUDA kernel's Python, on the emulated GPU (the real planner and kernel, on host memory) --


class _RecordsView:
    """What ``cupy.asarray`` of the records' torch alias gives on the emulated GPU: zero-copy."""

    def __init__(self, t):
        self.t = t

    def view(self, dtype):
        from tests.support.vllm_fake_cupy import FakeArray

        return FakeArray(self.t.numpy().view(dtype))


@pytest.fixture
def emulated_cuda_op(emulated_gpu, monkeypatch):
    """``vllm_ops._cuda`` (the op's CUDA kernel) on CPU tensors: the real VllmStepPlanner's host code
    and the vLLM kernel emulated on the CPU (tests/support/vllm_emulated_gpu.py); a CPU torch tensor
    is described as a device-0 array."""
    import sys

    import torch

    from kvaddr import validation
    from kvaddr.engines import vllm, vllm_config
    from kvaddr.torch import vllm_ops
    from tests.support import vllm_emulator

    if vllm_emulator.CXX is None:
        pytest.skip("no C++ compiler: the vLLM kernel emulator cannot be built")
    real = validation.describe

    def describe(name, x):
        if isinstance(x, torch.Tensor):
            info = validation._torch_info(x)
            return info._replace(device=0)
        return real(name, x)

    monkeypatch.setattr(vllm, "describe", describe)
    monkeypatch.setattr(vllm_config, "describe", describe, raising=False)
    cp = sys.modules["cupy"]
    fallback = cp.asarray
    monkeypatch.setattr(cp, "asarray", lambda a: _RecordsView(a) if isinstance(a, torch.Tensor) else fallback(a))
    monkeypatch.setattr(cp, "uint64", np.uint64, raising=False)
    streams = []
    monkeypatch.setattr(vllm_ops, "_raw_stream", lambda dev: streams.append(dev) or 0x77)
    monkeypatch.setitem(vllm_ops._state, "multi_device", False)
    vllm_ops.clear_cache()
    yield vllm_ops
    vllm_ops.clear_cache()


def _cuda_call(vllm_ops, cfg, inputs, bufs, padded=None):
    idx, qsl, nct, tables, nb = tensors(inputs)
    n = idx.shape[0]
    vllm_ops._cuda(idx, qsl, nct, tables, nb, n if padded is None else padded, bufs.storage, bufs.layout)
    return idx, qsl, nct, tables, nb


@pytest.mark.parametrize("seed", range(3))
def test_cuda_kernel_writes_the_reference_into_out_on_the_emulated_gpu(emulated_cuda_op, seed):
    from kvaddr.torch import VllmStepBuffers

    vllm_ops = emulated_cuda_op
    rng = np.random.default_rng(seed)
    cfg, inputs = random_case(
        rng, max_num_reqs=20, num_reqs=14, block_sizes=(16, 8), max_query=5, slot_dtype=[np.int64, np.int32][seed % 2]
    )
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    bufs.storage.fill_(0x5A5A5A5A)  # a caller's out: the planner zeroes its gathered tables in full once
    _cuda_call(vllm_ops, cfg, inputs, bufs, padded=17)
    ref = reference(cfg, inputs, 17)
    assert_same(bufs.outputs, ref.outputs.as_dict(), f"seed {seed}")
    assert bufs.errors() == (ref.error_mask, ref.error_key) == (0, VLLM_NO_ERROR_KEY)
    # Bad values: the planner's error records are out's (bufs.errors() reads them from the storage).
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    _cuda_call(vllm_ops, cfg, bad, bufs)
    ref = reference(cfg, bad)
    assert ref.error_mask
    assert_same(bufs.outputs, ref.outputs.as_dict(), f"seed {seed}, bad values")
    planner = vllm_ops._planners[(bufs.layout, id(bufs.storage))][0]
    assert planner.errors() == (ref.error_mask, ref.error_key)  # the same records (and reset by the read)
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)
    _cuda_call(vllm_ops, cfg, bad, bufs)
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    # A smaller batch next: nothing stale in the tables the previous steps filled.
    step3 = new_batch(rng, cfg, inputs, num_reqs=5)
    _cuda_call(vllm_ops, cfg, step3, bufs)
    assert_same(bufs.outputs, reference(cfg, step3).outputs.as_dict(), f"seed {seed}, step 3")
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)


def test_cuda_kernel_remembers_one_planner_per_out_and_forgets_it_with_out(emulated_cuda_op):
    import gc

    from kvaddr.torch import VllmStepBuffers

    vllm_ops = emulated_cuda_op
    cfg, inputs = worked_example()
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    args = tensors(inputs)
    vllm_ops._cuda(*args, 2, bufs.storage, bufs.layout)
    key = (bufs.layout, id(bufs.storage))
    planner = vllm_ops._planners[key][0]
    vllm_ops._cuda(*args, 4, bufs.storage, bufs.layout)
    assert vllm_ops._planners[key][0] is planner and planner._memo is not None  # the memo: no checks
    assert planner._params.num_reqs_padded == 4
    # Another out (a clone, as opcheck or aot_eager's functional copy passes): its own planner.
    other = bufs.storage.clone()
    vllm_ops._cuda(*args, 2, other, bufs.layout)
    assert len(vllm_ops._planners) == 2
    assert_same(bufs._layout.views(other)[0], reference(cfg, inputs).outputs.as_dict(), "clone")
    del other
    gc.collect()
    assert list(vllm_ops._planners) == [key]
    # Bad arguments raise before anything is remembered, naming the argument.
    fresh = VllmStepBuffers(config=cfg, device="cpu")
    with pytest.raises(ValueError, match="num_reqs_padded must be an int in"):
        vllm_ops._cuda(*args, 9, fresh.storage, fresh.layout)
    with pytest.raises(ValueError, match="idx_mapping must have at most max_num_reqs"):
        import torch

        vllm_ops._cuda(torch.zeros(7, dtype=torch.int32), *args[1:], 2, bufs.storage, bufs.layout)
    assert list(vllm_ops._planners) == [key]
