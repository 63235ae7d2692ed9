"""``kvaddr.torch.step`` / ``torch.ops.kvaddr.step_into`` with attention outputs on CUDA
(``StepBuffers(..., attention=..., kv_indices_capacity=...)``): equal to the reference
(docs/attention.md's worked examples; random mixed batches for every group subset, at batch sizes
of every kernel of the dispatch table), equal to ``StepPlanner``'s fused kernel on the same
inputs (the same kernel and grid), the kv_indices overflow bit (16) through
``errors()``/``check()``, opcheck on CUDA, torch.compile(fullgraph=True) with inductor and
aot_eager equal to eager, and inside torch.cuda.graph (eager and compiled) with contents changed
between replays. Mirrors tests/gpu/test_torch_ops_gpu.py. Skips without torch, CUDA or CuPy.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvaddr.errors import ERR_KV_INDICES_CAPACITY, NO_ERROR_KEY, AddressingError, decode_error_key
from tests.support.gpu import assert_attention_equal, assert_outputs_equal
from tests.support.step_cases import random_step
from tests.support.torch_attention import (
    ALL,
    EXAMPLE_1,
    EXAMPLE_2,
    EXAMPLE_3,
    GROUP_SETS,
    host_attention,
    poison,
    reference,
    total_pages,
)
from tests.support.torch_ops import case_tensors, cuda_torch_skip_reason

SKIP = cuda_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

I32 = np.int32


def _tables_arg(tables):
    return tables[0] if len(set(map(id, tables))) == 1 else tables


def _run(case, attention, n, *, max_requests=None, buffers=None):
    import torch

    import kvaddr.torch as kt

    dec, q, tables = case_tensors(case, "cuda")
    bsz = dec.shape[0]
    if buffers is None:
        buffers = kt.StepBuffers(
            max(max_requests or bsz, 1),
            case["capacity"],
            case["block_sizes"],
            device="cuda",
            attention=attention,
            kv_indices_capacity=n,
        )
    poison(buffers)
    out = kt.step(dec, q, _tables_arg(tables), buffers)
    torch.cuda.synchronize()
    return out, buffers, (dec, q, tables)


def _host(out, bsz):
    from kvaddr.outputs import StepOutputs

    return StepOutputs(
        out.cu_seqlens_q[: bsz + 1].cpu().numpy(),
        out.num_tokens.cpu().numpy(),
        out.batch_id_per_token.cpu().numpy(),
        out.position_ids.cpu().numpy(),
        out.seq_lens_kv[:bsz].cpu().numpy(),
        out.slot_mapping.cpu().numpy(),
    )


def _check_step(case, groups, n, out, bufs, label, ref=None):
    ref = reference(case, groups, n) if ref is None else ref
    bsz = len(case["seq_lens_decoder"])
    assert_outputs_equal(_host(out, bsz), ref.outputs, label)
    assert_attention_equal(host_attention(out.attention), ref.outputs.attention, label)
    assert bufs.errors() == (ref.error_mask, ref.error_key), label
    return ref


# -- docs/attention.md's worked examples -------------------------------------------------


def test_worked_examples_on_cuda():
    out, bufs, (_, _, tables) = _run(EXAMPLE_1, ALL, 8, max_requests=5)
    a = out.attention
    assert a.kv_indices.tolist() == [[7, 2, 4, 1, 3, 8, -1, -1]] and a.kv_indptr.tolist() == [[0, 2, 3, 6]]
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20] and int(a.max_seqlen_q) == 3 and int(a.max_seqlen_k) == 11
    assert a.page_table[0].data_ptr() == tables[0].data_ptr()
    _check_step(EXAMPLE_1, ALL, 8, out, bufs, "example 1")
    out, bufs, _ = _run(EXAMPLE_2, "flashinfer,varlen", 9)
    assert out.attention.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1, -1, -1, -1], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    _check_step(EXAMPLE_2, ("flashinfer", "varlen"), 9, out, bufs, "example 2")
    out, bufs, _ = _run(EXAMPLE_2, "flashinfer", 6)  # overflow: bit 16
    assert out.attention.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1], [10, 11, 12, 13, 14, 15]]
    mask, key = bufs.errors()
    assert mask == ERR_KV_INDICES_CAPACITY and decode_error_key(key) == (4, 2, 1, 16)
    assert bufs.errors() == (0, NO_ERROR_KEY)  # the read reset the (sticky) records
    out, bufs, _ = _run(EXAMPLE_2, "flashinfer", 6, buffers=bufs)
    with pytest.raises(AddressingError, match=r"token 4 of request 2, cache 1: more kv_indices entries"):
        bufs.check()
    out, bufs, _ = _run(EXAMPLE_3, "flashinfer", 8)
    assert out.attention.kv_indices.tolist() == [[3, -1, 1, 2, 4, -1, -1, -1]]
    mask, key = bufs.errors()
    assert mask == 3 and decode_error_key(key) == (0, 0, 0, 2)


# -- random mixed batches ----------------------------------------------------------------


def _case(rng, bsz, errors):
    kw = {}
    if bsz > 1000:
        kw = dict(mix=("decode", "spec", "idle"), block_sizes=[16, 64, 96, 256][: int(rng.integers(1, 5))])
    return random_step(rng, bsz=bsz, errors=errors, **kw)


@functools.lru_cache(maxsize=1)
def _random_steps(bsz, groups):
    """Three steps (clean, bad values, kv_indices overflow) with their references (cached: the NumPy
    reference of the large batches runs once)."""
    rng = np.random.default_rng(1000 * bsz + GROUP_SETS.index(groups))
    steps = []
    for i in range(3):
        case = _case(rng, bsz, errors=i == 1)
        need = total_pages(case)
        n = (need + 7 if i != 2 else max(1, need // 2)) if "flashinfer" in groups else None  # i == 2: overflow
        steps.append((case, n, reference(case, groups, n)))
    return tuple(steps)


@pytest.mark.parametrize("bsz", [0, 1, 37, 300, 4096, 4097, 9000])
@pytest.mark.parametrize("groups", GROUP_SETS, ids=lambda g: "+".join(g))
def test_random_batches_equal_the_reference_on_cuda(bsz, groups):
    for i, (case, n, ref) in enumerate(_random_steps(bsz, groups)):
        out, bufs, _ = _run(case, groups, n, max_requests=bsz + 3)
        _check_step(case, groups, n, out, bufs, f"bsz {bsz} {groups} step {i}", ref)


def test_same_buffers_many_steps_with_bsz_changing_and_the_overflow_record_cleared():
    """One StepBuffers (max_requests 9000: tiles > 0, so the metadata records sit after the tiles'),
    new steps every call, small and large batches, an overflowing step between clean ones."""
    from kvaddr.torch import StepBuffers

    N = 200_000
    bufs = StepBuffers(9000, 20000, [16, 64], device="cuda", attention=ALL, kv_indices_capacity=N)
    rng = np.random.default_rng(4)
    overflowed = []
    for i, bsz in enumerate((5, 4097, 3, 0, 9000, 64, 9000, 7)):
        case = random_step(
            rng, bsz=bsz, num_caches=2, mix=("decode", "spec", "idle"), block_sizes=[16, 64], shared_table=True
        )
        case["capacity"] = 20000
        out, _, _ = _run(case, ALL, N, buffers=bufs)
        ref = _check_step(case, ALL, N, out, bufs, f"step {i} bsz {bsz}")
        overflowed.append(bool(ref.error_mask & ERR_KV_INDICES_CAPACITY))
    # 9000 requests of up to 5000 tokens need more than N entries; 7 requests don't (errors() read and
    # cleared the overflowing step's records: it equalled the reference's on each step)
    assert overflowed[4] and overflowed[6] and not overflowed[7], overflowed


@pytest.mark.parametrize("groups", GROUP_SETS, ids=lambda g: "+".join(g))
def test_equals_the_planner_on_the_same_inputs(groups):
    """The op's fused launch and StepPlanner's write the same outputs, records and geometry."""
    import cupy as cp
    import torch

    from kvaddr import StepPlanner
    from kvaddr.torch import StepBuffers, step

    rng = np.random.default_rng(31)
    for bsz in (40, 1000, 5000):  # the small, across-blocks and multi-block kernels
        case = random_step(
            rng, bsz=bsz, num_caches=3, block_sizes=[16, 8, 96], errors=True, mix=("decode", "spec", "idle", "prefill")
        )
        n = total_pages(case) // 2 + 1 if "flashinfer" in groups else None
        dec, q, tables = case_tensors(case, "cuda")
        bufs = StepBuffers(
            bsz, case["capacity"], case["block_sizes"], device="cuda", attention=groups, kv_indices_capacity=n
        )
        planner = StepPlanner(bsz, case["capacity"], case["block_sizes"], attention=groups, kv_indices_capacity=n)
        assert bufs._layout.config == planner.config  # the same dispatch: the same kernel and grid
        assert bufs._layout.meta == (planner._meta_entries, planner._meta_per_cache, planner._num_meta)
        got = step(dec, q, tables, bufs)
        want = planner.compute(
            cp.asarray(dec), cp.asarray(q), [cp.asarray(t) for t in tables], stream=torch.cuda.current_stream()
        )
        torch.cuda.synchronize()
        # (the planner's CuPy arrays first: the helpers take .get() of the first argument)
        assert_outputs_equal(want, _host(got, bsz), f"bsz {bsz} {groups}")
        assert_attention_equal(want.attention, host_attention(got.attention), f"bsz {bsz} {groups}")
        assert bufs.errors() == planner.errors()


# -- opcheck, torch.compile, CUDA graphs ---------------------------------------------------


def _args(bsz=40, seed=0, groups=ALL):
    import torch

    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(seed)
    case = random_step(rng, bsz=bsz, num_caches=2, shared_table=True, block_sizes=[16, 64])
    n = 64 * 512
    bufs = StepBuffers(64, case["capacity"], [16, 64], device="cuda", attention=groups, kv_indices_capacity=n)
    dec = torch.from_numpy(case["seq_lens_decoder"]).cuda()
    q = torch.from_numpy(case["seq_lens_this_time"]).cuda()
    table = torch.from_numpy(np.ascontiguousarray(case["block_tables"])).cuda()
    return case, bufs, dec, q, table, n


@pytest.mark.parametrize("overload", ["default", "tables"])
@pytest.mark.parametrize("groups", [ALL, ("flashinfer",), ("varlen",), ("page_table",)], ids=lambda g: "+".join(g))
def test_opcheck_step_into_with_attention_on_cuda(overload, groups):
    import torch
    from torch.library import opcheck

    _, bufs, dec, q, table, _ = _args(groups=groups)
    if overload == "default":
        result = opcheck(torch.ops.kvaddr.step_into.default, (dec, q, table, bufs.storage, bufs.layout))
    else:
        t2 = table.flip(0).contiguous()
        result = opcheck(torch.ops.kvaddr.step_into.tables, (dec, q, [table, t2], bufs.storage, bufs.layout))
    assert all(v == "SUCCESS" for v in result.values()), result


def _model(bufs):
    from kvaddr.torch import step

    def model(dec, q, table):
        out = step(dec, q, table, bufs)
        a = out.attention
        return (
            out.slot_mapping * 1,
            a.qo_indptr + 0,
            a.kv_indptr + 0,
            a.kv_indices + 0,
            a.kv_last_page_len + 0,
            a.cu_seqlens_k + 0,
            a.seqused_k + 0,
            a.max_seqlen_q + a.max_seqlen_k * 100000,
            a.page_table[0] + 0,
        )

    return model


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_fullgraph_equals_eager_with_attention(backend):
    import torch

    _, bufs, dec, q, table, _ = _args()
    model = _model(bufs)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(dec, q, table)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    rng = np.random.default_rng(1)
    for _ in range(3):  # new contents every call, same tensors
        dec.copy_(torch.from_numpy(rng.integers(0, 200, dec.shape[0]).astype(np.int32)))
        want = [x.clone() for x in model(dec, q, table)]
        want_storage_views = {n: getattr(bufs, n).clone() for n in ("slot_mapping", "kv_indices", "max_seqlen")}
        poison(bufs)
        got = compiled(dec, q, table)
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        for name in ("slot_mapping", "kv_indices", "max_seqlen"):  # written whole by every step
            assert torch.equal(getattr(bufs, name), want_storage_views[name]), name


def _refill(rng, dec, q, tables, block_sizes, bsz, errors):
    """New random contents in the bound tensors (their shapes kept); returns the reference case's tables."""
    import torch

    c = random_step(
        rng, bsz=bsz, num_caches=len(block_sizes), shared_table=len(tables) == 1, block_sizes=block_sizes, errors=errors
    )
    src_tables = c["block_tables"] if isinstance(c["block_tables"], list) else [c["block_tables"]]
    new = []
    for t, src in zip(tables, src_tables):
        tt = np.full(tuple(t.shape), -1, np.int32)
        src = np.asarray(src)
        r, w = min(src.shape[0], tt.shape[0]), min(src.shape[1], tt.shape[1])
        tt[:r, :w] = src[:r, :w]
        t.copy_(torch.from_numpy(tt))
        new.append(tt)
    dec.copy_(torch.from_numpy(c["seq_lens_decoder"]))
    q.copy_(torch.from_numpy(c["seq_lens_this_time"]))
    return c, new


def test_inside_torch_cuda_graph_with_contents_changed_between_replays():
    import torch

    from kvaddr.torch import step

    case, bufs, dec, q, table, n = _args(bsz=50)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(dec, q, table, bufs)  # warm-up: compile, remember the argument set
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(dec, q, table, bufs)
    rng = np.random.default_rng(9)
    for i in range(4):
        c, new = _refill(rng, dec, q, [table], [16, 64], 50, errors=i == 2)
        poison(bufs)  # every output the graph promises is rewritten by the replay
        g.replay()
        torch.cuda.synchronize()
        rc = dict(c, block_tables=new[0], block_sizes=[16, 64], capacity=case["capacity"])
        _check_step(rc, ALL, n, out, bufs, f"replay {i}")


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_step_with_attention_inside_a_cuda_graph(backend):
    """Two distinct tables through torch.compile(fullgraph=True), the compiled function captured in
    torch.cuda.graph and replayed on new contents: every attention output equals the reference."""
    import torch

    from kvaddr.torch import StepBuffers, step

    rng = np.random.default_rng(21)
    case = random_step(rng, bsz=48, num_caches=2, shared_table=False, block_sizes=[16, 32])
    dec, q, tables = case_tensors(case, "cuda")
    t0, t1 = (t.contiguous().clone() for t in tables)
    n = 48 * 300
    bufs = StepBuffers(64, case["capacity"], [16, 32], device="cuda", attention=ALL, kv_indices_capacity=n)

    def prepare(dec, q, t0, t1):
        a = step(dec, q, [t0, t1], bufs).attention
        return (
            a.kv_indptr + 0,
            a.kv_indices + 0,
            a.kv_last_page_len + 0,
            a.cu_seqlens_k + 0,
            a.max_seqlen_q + 0,
            a.max_seqlen_k + 0,
            a.page_table[1] + 0,
        )

    torch._dynamo.reset()
    compiled = torch.compile(prepare, fullgraph=True, backend=backend)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            compiled(dec, q, t0, t1)  # compile, remember the argument set
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = compiled(dec, q, t0, t1)
    for i in range(3):
        c, new = _refill(rng, dec, q, [t0, t1], [16, 32], 48, errors=i == 1)
        g.replay()
        torch.cuda.synchronize()
        ref = reference(dict(c, block_tables=new, block_sizes=[16, 32], capacity=case["capacity"]), ALL, n)
        a = ref.outputs.attention
        want = (a.kv_indptr, a.kv_indices, a.kv_last_page_len, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k)
        for got, w in zip(outs, want):
            np.testing.assert_array_equal(got.cpu().numpy(), w, f"replay {i}")
        np.testing.assert_array_equal(outs[6].cpu().numpy(), new[1][:48], f"replay {i}")
        assert bufs.errors() == (ref.error_mask, ref.error_key)


def test_no_error_after_construction_and_the_readme_pattern():
    """The README's pattern: StepBuffers with attention, step, hand the views to the attention call."""
    import torch

    import kvaddr.torch as kt

    bufs = kt.StepBuffers(3, 8, [4], device="cuda", attention="flashinfer,varlen,page_table", kv_indices_capacity=8)
    assert bufs.errors() == (0, NO_ERROR_KEY)
    dec = torch.tensor([5, 0, 9], dtype=torch.int32, device="cuda")
    q = torch.tensor([1, 3, 2], dtype=torch.int32, device="cuda")
    table = torch.tensor([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]], dtype=torch.int32, device="cuda")
    a = kt.step(dec, q, table, bufs).attention
    assert a.qo_indptr.tolist() == [0, 1, 4, 6]
    assert a.kv_indptr[0].tolist() == [0, 2, 3, 6]
    assert a.kv_indices[0].tolist() == [7, 2, 4, 1, 3, 8, -1, -1]
    assert a.kv_last_page_len[0].tolist() == [2, 3, 3]
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20] and a.seqused_k.tolist() == [6, 3, 11]
    assert (int(a.max_seqlen_q), int(a.max_seqlen_k)) == (3, 11)
    assert a.page_table[0].tolist() == table.tolist()
    bufs.check()
