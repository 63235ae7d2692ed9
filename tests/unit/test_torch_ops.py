"""torch.ops.kvaddr.step on the CPU: the reference kernel, opcheck, torch.compile(fullgraph=True),
argument checks, and the CUDA kernel's remembered argument sets (with the launch faked).

Skips without torch (the CI venv has none), except the check that ``import kvaddr`` never
imports torch. tests/gpu/test_torch_ops_gpu.py runs the CUDA kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvaddr import dispatch
from kvaddr.errors import NO_ERROR_KEY, AddressingError
from kvaddr.reference import step_addressing
from tests.support import skips
from tests.support.fake_cupy import function_ptr
from tests.support.gpu import assert_outputs_equal
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, random_step
from tests.support.torch_ops import run_op, torch_skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = torch_skip_reason()
requires_torch = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def test_importing_kvaddr_never_imports_torch():
    code = (
        "import sys, kvaddr, kvaddr.planner, kvaddr.bound_step, kvaddr.reference, kvaddr.validation\n"
        "import kvaddr.strategies.cpu, kvaddr.measure.profile_run\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def _ref(case, position_dtype=np.int64):
    return step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
        position_dtype=position_dtype,
    )


CASES = [(name, inputs) for name, inputs, _ in WORKED_EXAMPLES] + sorted(edge_cases().items())


@requires_torch
@pytest.mark.parametrize("name,case", CASES, ids=[n for n, _ in CASES])
def test_cpu_kernel_equals_the_reference(name, case):
    got, (mask, key), _ = run_op(case, "cpu")
    ref = _ref(case)
    assert_outputs_equal(got, ref.outputs, name)
    assert (mask, key) == (ref.error_mask, ref.error_key)


@requires_torch
@pytest.mark.parametrize("seed", range(12))
def test_cpu_kernel_equals_the_reference_on_random_steps(seed):
    import torch

    rng = np.random.default_rng(seed)
    case = random_step(rng, errors=seed % 3 == 0, over_capacity=seed % 4 == 1)
    dtype = (torch.int64, torch.int32)[seed % 2]
    got, (mask, key), _ = run_op(case, "cpu", position_dtype=dtype, max_requests=80)
    ref = _ref(case, (np.int64, np.int32)[seed % 2])
    assert_outputs_equal(got, ref.outputs, f"seed {seed}")
    assert (mask, key) == (ref.error_mask, ref.error_key)


@requires_torch
def test_buffers_persist_across_steps_and_check_raises():
    _, case, _ = WORKED_EXAMPLES[0]
    _, errs, bufs = run_op(case, "cpu", max_requests=8)
    assert errs == (0, NO_ERROR_KEY)
    bufs.check()
    bad = dict(case, seq_lens_this_time=np.array([1, 30, 2], np.int32))  # over capacity: bit 4
    got, (mask, key), _ = run_op(bad, "cpu", buffers=bufs)
    ref = _ref(bad)
    assert_outputs_equal(got, ref.outputs, "over capacity")
    assert (mask, key) == (ref.error_mask, ref.error_key) and mask & 4
    bufs.check()  # errors() above read and cleared the (sticky) records
    run_op(bad, "cpu", buffers=bufs)  # (reads them: run_op returns errors())
    from kvaddr.torch import step
    from tests.support.torch_ops import case_tensors

    dec, q, tables = case_tensors(bad, "cpu")
    step(dec, q, tables, bufs)
    dec, q, tables = case_tensors(case, "cpu")
    step(dec, q, tables, bufs)  # a good step after the bad one: the bad one's record stays
    with pytest.raises(AddressingError, match="bad step addressing"):
        bufs.check()
    _, errs, _ = run_op(case, "cpu", buffers=bufs)  # check() cleared them, a good step adds none
    assert errs == (0, NO_ERROR_KEY)


@requires_torch
def test_op_writes_only_the_first_bsz_entries_of_longer_buffers():
    import torch

    _, case, _ = WORKED_EXAMPLES[0]
    _, _, bufs = run_op(case, "cpu", max_requests=10)
    assert torch.all(bufs.cu_seqlens_q[4:] == 0x5A5A5A5A) and torch.all(bufs.seq_lens_kv[3:] == 0x5A5A5A5A)


@requires_torch
def test_opcheck_passes():
    import torch
    from torch.library import opcheck

    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(7)
    for dtype, caches in ((torch.int64, 2), (torch.int32, 1), (torch.int64, 0)):
        case = random_step(rng, bsz=9, num_caches=max(caches, 1))
        sizes = case["block_sizes"][:caches]
        bufs = StepBuffers(16, case["capacity"], sizes, position_dtype=dtype, device="cpu")
        dec = torch.from_numpy(case["seq_lens_decoder"])
        q = torch.from_numpy(case["seq_lens_this_time"])
        tables = case["block_tables"] if isinstance(case["block_tables"], list) else [case["block_tables"]]
        tables = [torch.from_numpy(np.ascontiguousarray(t)) for t in tables][: max(caches, 1)] if caches else []
        args = (dec, q, tables, sizes, *bufs.outputs_args)
        result = opcheck(torch.ops.kvaddr.step.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def _model(bufs):
    import torch

    from kvaddr.torch import step

    def model(dec, q, table, hidden):
        out = step(dec, q, table, bufs)
        # use the addressing in the same graph: gather rows by position, scatter by slot
        h = hidden[out.position_ids % hidden.shape[0]]
        return h.sum(-1) + out.slot_mapping[0].to(h.dtype), out.num_tokens + 0, torch.cumsum(out.seq_lens_kv, 0)

    return model


def _inputs(seed=3):
    import torch

    rng = np.random.default_rng(seed)
    case = random_step(rng, bsz=11, num_caches=1, errors=False)
    t = case["block_tables"]
    t = t[0] if isinstance(t, list) else t
    return (
        case,
        torch.from_numpy(case["seq_lens_decoder"]),
        torch.from_numpy(case["seq_lens_this_time"]),
        torch.from_numpy(np.ascontiguousarray(t)),
        torch.randn(32, 8, generator=torch.Generator().manual_seed(seed)),
    )


@requires_torch
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_compiles_with_fullgraph_and_matches_eager(backend):
    import torch

    from kvaddr.torch import StepBuffers

    case, dec, q, table, hidden = _inputs()
    bufs = StepBuffers(16, case["capacity"], case["block_sizes"][:1], device="cpu")
    model = _model(bufs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    calls = 0
    for shift in (0, 1, 5):  # contents change between calls (the same tensors)
        dec.add_(shift)
        table.copy_(table.roll(1, 0))
        calls += 1
        want = [x.clone() for x in model(dec, q, table, hidden)]
        want_slots = bufs.slot_mapping.clone()
        bufs.slot_mapping.fill_(123)
        got = compiled(dec, q, table, hidden)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(bufs.slot_mapping, want_slots)  # the mutation reached the caller's buffer
    assert calls == 3


@requires_torch
def test_no_graph_break():
    import torch

    from kvaddr.torch import StepBuffers

    case, dec, q, table, hidden = _inputs()
    bufs = StepBuffers(16, case["capacity"], case["block_sizes"][:1], device="cpu")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_model(bufs))(dec, q, table, hidden)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@requires_torch
@pytest.mark.skipif(
    os.environ.get("KVADDR_TEST_INDUCTOR") != "1",
    reason=skips.INDUCTOR_OPT_IN,
)
def test_compiles_with_inductor_on_the_cpu():
    import torch

    from kvaddr.torch import StepBuffers

    case, dec, q, table, hidden = _inputs()
    bufs = StepBuffers(16, case["capacity"], case["block_sizes"][:1], device="cpu")
    model = _model(bufs)
    want = [x.clone() for x in model(dec, q, table, hidden)]
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="inductor")(dec, q, table, hidden)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _args(**over):
    import torch

    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(8, 16, [4, 2], device="cpu")
    a = dict(
        seq_lens_decoder=torch.tensor([5, 0, 9], dtype=torch.int32),
        seq_lens_this_time=torch.tensor([1, 3, 2], dtype=torch.int32),
        block_tables=[torch.zeros(3, 8, dtype=torch.int32)],
        block_sizes=[4, 2],
        cu_seqlens_q=bufs.cu_seqlens_q,
        num_tokens=bufs.num_tokens,
        batch_id_per_token=bufs.batch_id_per_token,
        position_ids=bufs.position_ids,
        seq_lens_kv=bufs.seq_lens_kv,
        slot_mapping=bufs.slot_mapping,
        workspace=bufs.workspace,
    )
    a.update(over)
    return list(a.values())


def _bad_cases():
    if SKIP:
        return []
    import torch

    i32 = torch.int32
    return [
        (dict(seq_lens_decoder=torch.zeros(3, dtype=torch.int64)), TypeError, r"seq_lens_decoder must be int32"),
        (dict(seq_lens_this_time=torch.zeros(2, dtype=i32)), ValueError, r"seq_lens_this_time must have shape"),
        (dict(seq_lens_this_time=torch.zeros(6, dtype=i32)[::2]), ValueError, r"seq_lens_this_time must be contig"),
        (dict(block_tables=[torch.zeros(2, 8, dtype=i32)]), ValueError, r"block_tables must be .*2 rows for bsz = 3"),
        (dict(block_tables=[torch.zeros(8, 3, dtype=i32).t()]), ValueError, r"block_tables .*transposed or strided"),
        (dict(block_tables=[torch.zeros(3, 8)]), TypeError, r"block_tables must be int32 .*float32"),
        (
            dict(block_tables=[torch.zeros(3, 8, dtype=i32)] * 3),
            ValueError,
            r"block_tables must be one table or 2 .*got 3",
        ),
        (dict(block_sizes=[4, 0]), ValueError, r"block_sizes\[1\] must be an int in \[1, "),
        (dict(block_sizes=[4, 2, 1, 1, 1]), ValueError, r"block_sizes must hold at most 4 caches"),
        (dict(cu_seqlens_q=torch.zeros(3, dtype=i32)), ValueError, r"cu_seqlens_q must have at least bsz \+ 1 = 4"),
        (dict(num_tokens=torch.zeros(2, dtype=i32)), TypeError, r"num_tokens must be int32 with one element"),
        (dict(position_ids=torch.zeros(16, dtype=torch.float32)), TypeError, r"position_ids must be int64 or int32"),
        (dict(position_ids=torch.zeros(15, dtype=torch.int64)), ValueError, r"position_ids must have shape \(16,\)"),
        (dict(seq_lens_kv=torch.zeros(2, dtype=i32)), ValueError, r"seq_lens_kv must have at least bsz = 3"),
        (
            dict(slot_mapping=torch.zeros(1, 16, dtype=torch.int64)),
            ValueError,
            r"slot_mapping must have shape \(2, 16\)",
        ),
        (dict(workspace=torch.zeros(10, dtype=torch.int64)), ValueError, r"workspace must have workspace_size"),
        (dict(workspace=torch.zeros(10, dtype=i32)), TypeError, r"workspace must be a contiguous int64 vector"),
    ]


@requires_torch
@pytest.mark.parametrize("over,exc,message", _bad_cases())
def test_bad_arguments_raise_naming_the_argument(over, exc, message):
    import torch

    args = _args(**over)
    with pytest.raises(exc, match=message):
        torch.ops.kvaddr.step.default(*args)
    # the fake kernel checks the same way (torch.compile raises at trace time)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args[:2]]
        fake += [[mode.from_tensor(t) for t in args[2]], args[3]]
        fake += [mode.from_tensor(a) for a in args[4:]]
        with pytest.raises(exc, match=message):
            torch.ops.kvaddr.step.default(*fake)


@requires_torch
def test_workspace_sized_for_fewer_requests_is_refused():
    import torch

    from kvaddr.torch import StepBuffers, ops

    tile = dispatch.TILE
    bufs = StepBuffers(tile, 16, [4], device="cpu")
    # its scan tiles (padded so that every kernel's records fit) take this many requests at most
    most = max(ops._max_tiles(16, tile), 1) * tile
    n = most + 1
    with pytest.raises(ValueError, match=rf"workspace was sized for at most {most} requests, got bsz = {n}"):
        torch.ops.kvaddr.step.default(
            torch.zeros(n, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int32),
            [torch.zeros(n, 1, dtype=torch.int32)],
            [4],
            torch.zeros(n + 1, dtype=torch.int32),
            bufs.num_tokens,
            bufs.batch_id_per_token,
            bufs.position_ids,
            torch.zeros(n, dtype=torch.int32),
            bufs.slot_mapping,
            bufs.workspace,
        )


@requires_torch
@pytest.mark.parametrize("capacity", [1, 256, 257, 5000])
@pytest.mark.parametrize("max_requests", [1, 4096, 4097, 3 * 4096, 100_000])
def test_workspace_size_round_trips(capacity, max_requests):
    from kvaddr.torch import ops

    n = ops.workspace_size(capacity, max_requests)
    assert ops._tiles_of_workspace(n, capacity) == ops._max_tiles(capacity, max_requests)
    assert ops._tiles_of_workspace(n + 1, capacity) is None or ops._max_tiles(capacity, max_requests) == 0


# -- the CUDA kernel's Python, with the launch faked -----------------------------------------


@requires_torch
def test_cuda_kernel_launches_with_the_tensors_pointers(fake_cuda_launch):
    import ctypes

    from kvaddr import kernel_loader
    from kvaddr.torch import ops

    args = _args()
    ops._step_cuda(*args)
    ((fptr, grid, _, _, block, _, _, smem, stream, params, _),) = fake_cuda_launch
    # the dispatch table's launch for 3 requests, C = 16, 2 caches, int64 positions
    launch = dispatch.step_launch(dispatch.StepConfig(2, True, 16, 8), 3)
    assert (fptr, grid, block, smem, stream) == (function_ptr(launch.kernel), launch.blocks, launch.threads, 0, 0x5)
    P = kernel_loader.StepParams.from_address(ctypes.c_void_p.from_address(params).value)
    dec, q, tables, _sizes, cu, nt, batch, pos, kv, slots, ws = args
    assert (P.seq_lens_decoder, P.seq_lens_this_time, P.bsz) == (dec.data_ptr(), q.data_ptr(), 3)
    assert list(P.block_tables)[:2] == [tables[0].data_ptr()] * 2 and list(P.block_size) == [4, 2, 1, 1]
    assert (P.cu_seqlens_q, P.num_tokens, P.batch_id_per_token) == (cu.data_ptr(), nt.data_ptr(), batch.data_ptr())
    assert (P.position_ids, P.seq_lens_kv, P.slot_mapping) == (pos.data_ptr(), kv.data_ptr(), slots.data_ptr())
    tiles = ops._max_tiles(16, 8)  # the workspace's (StepBuffers(8, 16, ...)): every kernel's records
    assert (P.capacity, P.num_caches, P.max_tiles) == (16, 2, tiles)
    assert P.tile_state == ws.data_ptr() and P.tile_status == ws.data_ptr() + 16
    assert P.error_records == ws.data_ptr() + 8 * (2 + max(tiles, 1))  # 2 state words, then the tile-status words


@requires_torch
def test_cuda_kernel_remembers_argument_sets_by_identity(fake_cuda_launch, monkeypatch):
    from kvaddr.torch import ops

    binds = []
    real = ops._bind
    monkeypatch.setattr(ops, "_bind", lambda *a: binds.append(1) or real(*a))
    args = _args()
    for _ in range(3):
        ops._step_cuda(*args)
    assert len(binds) == 1 and len(fake_cuda_launch) == 3
    args2 = list(args)
    args2[0] = args[0].clone()  # a new object: checked again
    ops._step_cuda(*args2)
    assert len(binds) == 2
    args3 = list(args)
    args3[3] = [4, 3]  # other block sizes: checked again
    ops._step_cuda(*args3)
    assert len(binds) == 3
    ops.set_debug(True)  # debug: every call checked
    ops._step_cuda(*args)
    ops._step_cuda(*args)
    assert len(binds) == 5
    ops.set_debug(False)
    ops._step_cuda(*args)
    ops._step_cuda(*args)
    assert len(binds) == 6  # set_debug cleared the cache; remembered again after one check


@requires_torch
def test_cuda_kernel_checks_before_launching(fake_cuda_launch):
    import torch

    from kvaddr.torch import ops

    with pytest.raises(ValueError, match="seq_lens_kv must have at least bsz = 3"):
        ops._step_cuda(*_args(seq_lens_kv=torch.zeros(2, dtype=torch.int32)))
    assert fake_cuda_launch == []


@requires_torch
def test_the_cache_is_bounded(fake_cuda_launch):
    import torch

    from kvaddr.torch import ops

    args = _args()
    for _ in range(ops.CACHE_SIZE + 5):
        a = list(args)
        a[0] = torch.tensor([5, 0, 9], dtype=torch.int32)
        ops._step_cuda(*a)
    assert len(ops._cache) <= ops.CACHE_SIZE


@requires_torch
def test_a_remembered_set_is_forgotten_when_a_tensor_dies_and_keeps_none_alive(fake_cuda_launch):
    import gc
    import weakref

    import torch

    from kvaddr.torch import ops

    args = _args()
    args[0] = torch.tensor([5, 0, 9], dtype=torch.int32)
    ops._step_cuda(*args)
    assert len(ops._cache) == 1
    ref = weakref.ref(args[0])
    args[0] = None
    gc.collect()
    assert ref() is None  # the cache did not keep the tensor alive
    assert len(ops._cache) == 0  # and forgot the set (its id may be reused now)


@requires_torch
def test_a_remembered_set_launches_exactly_as_its_first_call(fake_cuda_launch):
    import ctypes

    from kvaddr import kernel_loader
    from kvaddr.torch import ops

    args = _args()
    ops._step_cuda(*args)
    first = fake_cuda_launch[0]
    P = kernel_loader.StepParams.from_address(ctypes.c_void_p.from_address(first[9]).value)
    before = bytes(P)
    for _ in range(3):
        ops._step_cuda(*args)
    assert len(fake_cuda_launch) == 4 and all(c == first for c in fake_cuda_launch)
    assert bytes(P) == before and P.bsz == 3  # the hot path writes nothing into the struct
    args[2] = list(args[2])  # a new list of the same tables (the dispatcher builds one per call)
    ops._step_cuda(*args)
    assert fake_cuda_launch[-1] == first


@requires_torch
def test_a_host_with_several_gpus_takes_the_checked_path(fake_cuda_launch, monkeypatch):
    import torch

    from kvaddr.torch import ops

    monkeypatch.setitem(ops._state, "multi_device", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (a CPU tensor's device index)
    seen = []
    real = ops._step_cuda_checked
    monkeypatch.setattr(ops, "_step_cuda_checked", lambda *a: seen.append(a[0] is None) or real(*a))
    args = _args()
    for _ in range(3):
        ops._step_cuda(*args)
    assert seen == [True, False, False] and len(fake_cuda_launch) == 3
    assert all(c == fake_cuda_launch[0] for c in fake_cuda_launch)


@requires_torch
def test_autograd_fallthrough_is_switchable_and_opcheck_passes_both_ways():
    import torch
    from torch.library import opcheck

    import kvaddr.torch as kt

    def autograd_line():
        dump = torch._C._dispatch_dump("kvaddr::step")
        return [line for line in dump.splitlines() if line.startswith("Autograd")]

    rng = np.random.default_rng(3)
    case = random_step(rng, bsz=5, num_caches=1)
    bufs = kt.StepBuffers(8, case["capacity"], case["block_sizes"][:1], device="cpu")
    tables = case["block_tables"] if isinstance(case["block_tables"], list) else [case["block_tables"]]
    args = (
        torch.from_numpy(case["seq_lens_decoder"]),
        torch.from_numpy(case["seq_lens_this_time"]),
        [torch.from_numpy(np.ascontiguousarray(tables[0]))],
        case["block_sizes"][:1],
        *bufs.outputs_args,
    )
    try:
        for on in (True, False, True):
            kt.set_autograd_fallthrough(on)
            lines = autograd_line()
            assert bool(lines) == on and all("fallthrough" in line for line in lines), lines
            result = opcheck(torch.ops.kvaddr.step.default, args)
            assert all(v == "SUCCESS" for v in result.values()), result
            v = bufs.slot_mapping._version
            torch.ops.kvaddr.step.default(*args)
            assert bufs.slot_mapping._version > v, "a mutated output's version counter was not bumped"
            ref = _ref(dict(case, block_tables=tables[0], block_sizes=case["block_sizes"][:1]))
            assert np.array_equal(bufs.slot_mapping.numpy(), ref.outputs.slot_mapping)
    finally:
        kt.set_autograd_fallthrough(True)
