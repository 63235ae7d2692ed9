"""torch.ops.kvaddr.step on CUDA: equal to the reference (random steps, small and large path,
0 to 4 caches, both position dtypes), opcheck, torch.compile(fullgraph=True) with inductor
and aot_eager equal to eager, inside torch.cuda.graph with contents changed between replays,
and on a non-default torch stream. Skips without torch, CUDA or CuPy."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.gpu import assert_outputs_equal, reference
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, random_step
from tests.support.torch_ops import cuda_torch_skip_reason, run_op

SKIP = cuda_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _case(seed, bsz, num_caches, errors):
    rng = np.random.default_rng(seed)
    n = max(num_caches, 1)
    kw = {}
    if bsz > 1000:
        kw = dict(mix=("decode", "spec", "idle"), block_sizes=[16, 64, 96, 256][:n])
    case = random_step(rng, bsz=bsz, num_caches=n, errors=errors, **kw)
    if num_caches == 0:
        case["block_sizes"], case["block_tables"] = [], []
    return case


@pytest.mark.parametrize("position_dtype", ["int64", "int32"])
@pytest.mark.parametrize(
    "seed, bsz, num_caches, errors",
    [
        (1, 1, 1, False),
        (2, 37, 2, False),
        (3, 64, 4, True),
        (4, 0, 1, False),
        (5, 300, 0, False),
        (6, 4096, 3, True),
        (7, 4097, 1, False),
        (8, 9000, 4, True),
    ],
)
def test_cuda_op_equals_the_reference(position_dtype, seed, bsz, num_caches, errors):
    import torch

    case = _case(seed, bsz, num_caches, errors)
    np_dtype = np.int64 if position_dtype == "int64" else np.int32
    ref = reference(case, position_dtype=np_dtype)
    got, errs, _ = run_op(case, "cuda", position_dtype=getattr(torch, position_dtype), max_requests=bsz + 3)
    label = f"seed {seed} bsz {bsz} caches {num_caches} {position_dtype}"
    assert_outputs_equal(got, ref.outputs, label)
    assert errs == (ref.error_mask, ref.error_key), label


@pytest.mark.parametrize("name", [n for n, _, _ in WORKED_EXAMPLES] + sorted(edge_cases()))
def test_cuda_op_on_worked_examples_and_edge_cases(name):
    cases = {n: c for n, c, _ in WORKED_EXAMPLES} | edge_cases()
    case = cases[name]
    ref = reference(case)
    got, errs, _ = run_op(case, "cuda")
    assert_outputs_equal(got, ref.outputs, name)
    assert errs == (ref.error_mask, ref.error_key), name


def test_same_buffers_many_steps_with_bsz_changing():
    """The engine's pattern: one StepBuffers, new steps (new bsz) every call."""
    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(9000, 20000, [16, 64], device="cuda")
    rng = np.random.default_rng(4)
    for bsz in (5, 4097, 3, 0, 9000, 64):
        case = random_step(
            rng, bsz=bsz, num_caches=2, mix=("decode", "spec", "idle"), block_sizes=[16, 64], shared_table=True
        )
        case["capacity"] = 20000
        ref = reference(case)
        got, errs, _ = run_op(case, "cuda", buffers=bufs)
        assert_outputs_equal(got, ref.outputs, f"bsz {bsz}")
        assert errs == (ref.error_mask, ref.error_key)


def _args(bsz=40, seed=0, position_dtype=None):
    import torch

    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(seed)
    case = random_step(rng, bsz=bsz, num_caches=2, shared_table=True, block_sizes=[16, 64])
    bufs = StepBuffers(64, case["capacity"], [16, 64], position_dtype=position_dtype or torch.int64, device="cuda")
    dec = torch.from_numpy(case["seq_lens_decoder"]).cuda()
    q = torch.from_numpy(case["seq_lens_this_time"]).cuda()
    table = torch.from_numpy(np.ascontiguousarray(case["block_tables"])).cuda()
    return case, bufs, dec, q, table


def test_opcheck_on_cuda():
    import torch
    from torch.library import opcheck

    for dtype in (torch.int64, torch.int32):
        _, bufs, dec, q, table = _args(position_dtype=dtype)
        result = opcheck(torch.ops.kvaddr.step.default, (dec, q, [table], [16, 64], *bufs.outputs_args))
        assert all(v == "SUCCESS" for v in result.values()), result


def _model(bufs):
    import torch

    from kvaddr.torch import step

    def model(dec, q, table, hidden):
        out = step(dec, q, table, bufs)
        h = hidden[out.position_ids % hidden.shape[0]]
        return h.sum(-1) + out.slot_mapping[0].to(h.dtype), torch.cumsum(out.seq_lens_kv, 0), out.num_tokens * 1

    return model


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_fullgraph_equals_eager(backend):
    import torch

    _, bufs, dec, q, table = _args()
    hidden = torch.randn(97, 32, device="cuda")
    model = _model(bufs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    rng = np.random.default_rng(1)
    for _ in range(3):  # new contents every call, same tensors
        dec.copy_(torch.from_numpy(rng.integers(0, 200, dec.shape[0]).astype(np.int32)))
        want = [x.clone() for x in model(dec, q, table, hidden)]
        want_slots = bufs.slot_mapping.clone()
        bufs.slot_mapping.fill_(7)
        got = compiled(dec, q, table, hidden)
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            if g.is_floating_point():  # the model's own float math: inductor may fuse and round differently
                torch.testing.assert_close(g, w)
            else:
                assert torch.equal(g, w)
        assert torch.equal(bufs.slot_mapping, want_slots)  # the op's outputs: exactly equal


def test_no_graph_break_on_cuda():
    import torch

    _, bufs, dec, q, table = _args()
    hidden = torch.randn(97, 32, device="cuda")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_model(bufs))(dec, q, table, hidden)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_inside_torch_cuda_graph_with_contents_changed_between_replays():
    import torch

    from kvaddr.torch import step

    case, bufs, dec, q, table = _args(bsz=50)
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
        c = random_step(rng, bsz=50, num_caches=2, shared_table=True, block_sizes=[16, 64], errors=i == 2)
        t = np.asarray(c["block_tables"])
        tt = np.full(tuple(table.shape), -1, np.int32)  # the new table in the bound tensor's shape
        r, w = min(t.shape[0], tt.shape[0]), min(t.shape[1], tt.shape[1])
        tt[:r, :w] = t[:r, :w]
        dec.copy_(torch.from_numpy(c["seq_lens_decoder"]))
        q.copy_(torch.from_numpy(c["seq_lens_this_time"]))
        table.copy_(torch.from_numpy(tt))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(
            dict(
                seq_lens_decoder=c["seq_lens_decoder"],
                seq_lens_this_time=c["seq_lens_this_time"],
                block_tables=tt,
                block_sizes=[16, 64],
                capacity=case["capacity"],
            )
        )
        host = type(ref.outputs)(
            *(
                getattr(out, f).cpu().numpy()
                for f in (
                    "cu_seqlens_q",
                    "num_tokens",
                    "batch_id_per_token",
                    "position_ids",
                    "seq_lens_kv",
                    "slot_mapping",
                )
            )
        )
        assert_outputs_equal(host, ref.outputs, f"replay {i}")
        assert bufs.errors() == (ref.error_mask, ref.error_key)


def test_runs_on_the_current_non_default_torch_stream():
    import torch

    from kvaddr.torch import step

    case, bufs, dec, q, table = _args(bsz=33, seed=5)
    ref = reference(dict(case, block_tables=np.ascontiguousarray(case["block_tables"])))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        bufs.slot_mapping.fill_(3)  # ordered before the op only through the stream
        out = step(dec, q, table, bufs)
        slots = out.slot_mapping.clone()  # ordered after the op only through the stream
    s.synchronize()
    np.testing.assert_array_equal(slots.cpu().numpy(), ref.outputs.slot_mapping)


def test_tensors_on_the_wrong_device_are_refused():
    import torch

    _, bufs, dec, q, table = _args()
    with pytest.raises(
        ValueError,
        match=r"block_tables\[0\] must be on cuda:0 like seq_lens_decoder, got cpu|"
        r"block_tables must be on cuda:0 like seq_lens_decoder, got cpu",
    ):
        torch.ops.kvaddr.step.default(dec, q, [table.cpu()], [16, 64], *bufs.outputs_args)


def test_readme_snippet():
    """README's "Using kvaddr from PyTorch: compiled and bound", as written (default inductor backend)."""
    import torch

    import kvaddr
    import kvaddr.torch  # registers torch.ops.kvaddr.step
    from kvaddr.torch import StepBuffers

    M, C = 256, 8192
    bufs = StepBuffers(M, C, block_sizes=[64], device="cuda")
    dec = torch.zeros(M, dtype=torch.int32, device="cuda")
    q = torch.ones(M, dtype=torch.int32, device="cuda")
    table = torch.arange(M * 128, dtype=torch.int32, device="cuda").reshape(M, 128)

    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def prepare(dec, q, table):
        torch.ops.kvaddr.step(dec, q, [table], bufs.block_sizes, *bufs.outputs_args)
        return bufs.position_ids, bufs.slot_mapping[0]

    positions, slots = prepare(dec, q, table)
    bufs.check()
    ref = reference(
        dict(
            seq_lens_decoder=dec.cpu().numpy(),
            seq_lens_this_time=q.cpu().numpy(),
            block_tables=table.cpu().numpy(),
            block_sizes=[64],
            capacity=C,
        )
    )
    np.testing.assert_array_equal(positions.cpu().numpy(), ref.outputs.position_ids)
    np.testing.assert_array_equal(slots.cpu().numpy(), ref.outputs.slot_mapping[0])

    planner = kvaddr.StepPlanner(max_requests=M, capacity=C, block_sizes=[64])
    bound = planner.bind(dec, q, table, stream=torch.cuda.current_stream())
    out = bound.launch(100)
    torch.cuda.synchronize()
    ref = reference(
        dict(
            seq_lens_decoder=dec[:100].cpu().numpy(),
            seq_lens_this_time=q[:100].cpu().numpy(),
            block_tables=table.cpu().numpy(),
            block_sizes=[64],
            capacity=C,
        )
    )
    assert_outputs_equal(out, ref.outputs, "README bound launch")


# -- the packed op, torch.ops.kvaddr.step_into (StepBuffers.storage, an int layout handle) --------


@pytest.mark.parametrize("position_dtype", ["int64", "int32"])
@pytest.mark.parametrize(
    "seed, bsz, num_caches, errors",
    [
        (11, 1, 1, False),
        (12, 37, 2, True),
        (13, 0, 1, False),
        (14, 300, 0, False),
        (15, 4097, 3, True),
        (16, 9000, 4, False),
    ],
)
def test_step_into_equals_the_old_op_and_the_reference_on_cuda(position_dtype, seed, bsz, num_caches, errors):
    import torch

    from kvaddr.torch import StepBuffers
    from tests.support.torch_ops import case_tensors

    case = _case(seed, bsz, num_caches, errors)
    dtype = getattr(torch, position_dtype)
    dec, q, tables = case_tensors(case, "cuda")
    sizes = case["block_sizes"]
    new = StepBuffers(bsz + 3, case["capacity"], sizes, position_dtype=dtype, device="cuda")
    old = StepBuffers(bsz + 3, case["capacity"], sizes, position_dtype=dtype, device="cuda")
    from kvaddr.torch import ops

    for b in (new, old):  # poison every output word; a valid (initial) workspace
        b.storage.fill_(0x5A5A5A5A)
        ops._init_workspace(b.workspace, ops._max_tiles(case["capacity"], bsz + 3))
    torch.cuda.synchronize()
    if sizes and all(t is tables[0] for t in tables):
        torch.ops.kvaddr.step_into.default(dec, q, tables[0], new.storage, new.layout)
    else:
        torch.ops.kvaddr.step_into.tables(dec, q, tables if sizes else [], new.storage, new.layout)
    torch.ops.kvaddr.step.default(dec, q, tables if sizes else [], list(sizes), *old.outputs_args)
    torch.cuda.synchronize()
    label = f"seed {seed} bsz {bsz} caches {num_caches} {position_dtype}"
    ws = new.workspace.numel()  # the workspace's device state may differ (dynamic tile tickets): errors() below
    assert torch.equal(new.storage[ws:], old.storage[ws:]), label  # every output word, padding included
    errors = new.errors()  # (each read resets the sticky records)
    assert errors == old.errors(), label
    ref = reference(case, position_dtype=np.int64 if position_dtype == "int64" else np.int32)
    out = new.outputs(bsz)
    host = type(ref.outputs)(
        *(getattr(out, f).cpu().numpy() for f in ref.outputs.__dataclass_fields__ if f not in ("attention", "dsa"))
    )
    assert_outputs_equal(host, ref.outputs, label)
    assert errors == (ref.error_mask, ref.error_key), label


@pytest.mark.parametrize("overload", ["default", "tables"])
def test_opcheck_step_into_on_cuda(overload):
    import torch
    from torch.library import opcheck

    for dtype in (torch.int64, torch.int32):
        _, bufs, dec, q, table = _args(position_dtype=dtype)
        if overload == "default":
            result = opcheck(torch.ops.kvaddr.step_into.default, (dec, q, table, bufs.storage, bufs.layout))
        else:
            t2 = table.flip(0).contiguous()
            result = opcheck(torch.ops.kvaddr.step_into.tables, (dec, q, [table, t2], bufs.storage, bufs.layout))
        assert all(v == "SUCCESS" for v in result.values()), result


def test_step_returns_the_same_views_per_bsz_on_cuda():
    import torch

    from kvaddr.torch import step

    case, bufs, dec, q, table = _args(bsz=40, seed=3)
    a = step(dec, q, table, bufs)
    torch.cuda.synchronize()
    ref = reference(dict(case, block_tables=np.ascontiguousarray(case["block_tables"])))
    np.testing.assert_array_equal(a.slot_mapping.cpu().numpy(), ref.outputs.slot_mapping)
    np.testing.assert_array_equal(a.seq_lens_kv.cpu().numpy(), ref.outputs.seq_lens_kv)
    b = step(dec, q, table, bufs)
    c = step(dec[:20], q[:20], table, bufs)  # another bsz: other views (of the same storage)
    torch.cuda.synchronize()
    assert a is b and a is not c and c.seq_lens_kv.shape == (20,) and c.cu_seqlens_q.shape == (21,)
    assert c.slot_mapping is a.slot_mapping is bufs.slot_mapping


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_step_into_tables_compiled_inside_a_cuda_graph(backend):
    """Two distinct tables (the .tables overload) through torch.compile(fullgraph=True), then the
    compiled function captured in torch.cuda.graph and replayed on new contents."""
    import torch

    from kvaddr.torch import StepBuffers, step

    rng = np.random.default_rng(21)
    case = random_step(rng, bsz=48, num_caches=2, shared_table=False, block_sizes=[16, 32])
    from tests.support.torch_ops import case_tensors

    dec, q, tables = case_tensors(case, "cuda")
    t0, t1 = (t.contiguous().clone() for t in tables)
    bufs = StepBuffers(64, case["capacity"], [16, 32], device="cuda")

    def prepare(dec, q, t0, t1):
        out = step(dec, q, [t0, t1], bufs)
        return out.slot_mapping * 1, out.position_ids + 0, out.cu_seqlens_q + 0

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
        c = random_step(rng, bsz=48, num_caches=2, shared_table=False, block_sizes=[16, 32], errors=i == 1)
        new = []
        for t, src in zip((t0, t1), c["block_tables"]):
            tt = np.full(tuple(t.shape), -1, np.int32)
            src = np.asarray(src)
            r, w = min(src.shape[0], tt.shape[0]), min(src.shape[1], tt.shape[1])
            tt[:r, :w] = src[:r, :w]
            t.copy_(torch.from_numpy(tt))
            new.append(tt)
        dec.copy_(torch.from_numpy(c["seq_lens_decoder"]))
        q.copy_(torch.from_numpy(c["seq_lens_this_time"]))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(
            dict(
                seq_lens_decoder=c["seq_lens_decoder"],
                seq_lens_this_time=c["seq_lens_this_time"],
                block_tables=new,
                block_sizes=[16, 32],
                capacity=case["capacity"],
            )
        )
        np.testing.assert_array_equal(outs[0].cpu().numpy(), ref.outputs.slot_mapping, f"replay {i}")
        np.testing.assert_array_equal(outs[1].cpu().numpy(), ref.outputs.position_ids, f"replay {i}")
        np.testing.assert_array_equal(outs[2].cpu().numpy(), ref.outputs.cu_seqlens_q, f"replay {i}")
        assert bufs.errors() == (ref.error_mask, ref.error_key)


def test_readme_snippet_step_into():
    """README's step_into snippet (section "From PyTorch"), as written."""
    import torch

    import kvaddr.torch  # registers torch.ops.kvaddr.step and step_into
    from kvaddr.torch import StepBuffers

    M, C = 256, 8192
    bufs = StepBuffers(M, C, block_sizes=[64], device="cuda")  # every output packed in bufs.storage
    dec = torch.zeros(M, dtype=torch.int32, device="cuda")
    q = torch.ones(M, dtype=torch.int32, device="cuda")
    table = torch.arange(M * 128, dtype=torch.int32, device="cuda").reshape(M, 128)

    out = kvaddr.torch.step(dec, q, table, bufs)  # eager: one op call, the same views for the same bsz
    torch.ops.kvaddr.step_into(dec, q, table, bufs.storage, bufs.layout)  # the op itself
    bufs.check()
    ref = reference(
        dict(
            seq_lens_decoder=dec.cpu().numpy(),
            seq_lens_this_time=q.cpu().numpy(),
            block_tables=table.cpu().numpy(),
            block_sizes=[64],
            capacity=C,
        )
    )
    np.testing.assert_array_equal(out.position_ids.cpu().numpy(), ref.outputs.position_ids)
    np.testing.assert_array_equal(out.slot_mapping.cpu().numpy(), ref.outputs.slot_mapping)
    np.testing.assert_array_equal(bufs.slot_mapping.cpu().numpy(), ref.outputs.slot_mapping)
