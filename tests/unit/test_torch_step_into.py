"""``torch.ops.kvaddr.step_into`` (the packed op) on the CPU: the packed layout of ``StepBuffers``,
equality with the old op and the reference, opcheck, torch.compile, argument checks (real and fake
kernels), ``kvaddr.torch.step``'s views kept per bsz, and the CUDA kernel's Python with the launch
faked. Skips without torch. tests/gpu/test_torch_ops_gpu.py runs the CUDA kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.reference import step_addressing
from tests.support.gpu import assert_outputs_equal
from tests.support.step_cases import random_step
from tests.support.torch_fakes import launch_params
from tests.support.torch_ops import case_tensors, torch_skip_reason

SKIP = torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

FIELDS = ("cu_seqlens_q", "num_tokens", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping")


def _ref(case, position_dtype=np.int64):
    return step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
        position_dtype=position_dtype,
    )


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


@pytest.mark.parametrize("position_int64", [True, False])
@pytest.mark.parametrize("sizes", [[], [16], [16, 64], [4, 8, 16, 32]])
@pytest.mark.parametrize("capacity,max_requests", [(1, 1), (7, 3), (300, 5000), (4097, 9000)])
def test_packed_views_are_aligned_disjoint_and_inside_the_storage(position_int64, sizes, capacity, max_requests):
    import torch

    from kvaddr.torch import StepBuffers, workspace_size

    dtype = torch.int64 if position_int64 else torch.int32
    bufs = StepBuffers(max_requests, capacity, sizes, position_dtype=dtype, device="cpu")
    C, M, G = capacity, max_requests, len(sizes)
    base = bufs.storage.data_ptr()
    end = base + 8 * bufs.storage.numel()
    want = {
        "cu_seqlens_q": (torch.int32, (M + 1,)),
        "num_tokens": (torch.int32, ()),
        "batch_id_per_token": (torch.int32, (C,)),
        "position_ids": (dtype, (C,)),
        "seq_lens_kv": (torch.int32, (M,)),
        "slot_mapping": (torch.int64, (G, C)),
        "workspace": (torch.int64, (workspace_size(C, M),)),
    }
    spans = []
    for name, (dt, shape) in want.items():
        t = getattr(bufs, name)
        assert (t.dtype, tuple(t.shape)) == (dt, shape), name
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == bufs.storage.untyped_storage().data_ptr()
        if t.numel() == 0:  # no cache: an empty slot_mapping (no pointer)
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        assert (lo - base) % 256 == 0 and base <= lo <= hi <= end, name
        spans.append((lo, hi, name))
    spans.sort()
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        assert hi <= lo, f"{a} overlaps {b}"
    # the initial values of the old separate tensors
    assert torch.all(bufs.batch_id_per_token == -1) and torch.all(bufs.slot_mapping == -1)
    assert bufs.errors() == (0, (1 << 64) - 1)


def test_layout_handles_name_equal_layouts_and_refuse_others():
    import torch

    from kvaddr.torch import StepBuffers, ops

    a = StepBuffers(8, 16, [4, 2], device="cpu")
    b = StepBuffers(8, 16, [4, 2], device="cpu")
    c = StepBuffers(8, 16, [4, 2], position_dtype=torch.int32, device="cpu")
    d = StepBuffers(8, 17, [4, 2], device="cpu")
    assert a.layout == b.layout and len({a.layout, c.layout, d.layout}) == 3
    assert a.storage is not b.storage
    for bad in (-1, len(ops._layouts), 10**9):
        with pytest.raises(ValueError, match=r"layout must be a StepBuffers.layout handle"):
            ops._layout_of(bad)


@pytest.mark.parametrize("seed", range(8))
def test_step_into_equals_the_old_op_and_the_reference(seed):
    import torch

    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(100 + seed)
    case = random_step(rng, errors=seed % 3 == 0, over_capacity=seed % 4 == 1)
    dtype = (torch.int64, torch.int32)[seed % 2]
    dec, q, tables = case_tensors(case, "cpu")
    bsz, sizes = dec.shape[0], case["block_sizes"]
    new = StepBuffers(max(bsz, 1) + 3, case["capacity"], sizes, position_dtype=dtype, device="cpu")
    old = StepBuffers(max(bsz, 1) + 3, case["capacity"], sizes, position_dtype=dtype, device="cpu")
    for b in (new, old):
        b.storage.fill_(0x5A5A5A5A)
        b.clear_errors()  # the sticky error records start clear (only their reader clears them)
    if len(tables) == 1 or (sizes and all(t is tables[0] for t in tables)):
        torch.ops.kvaddr.step_into.default(dec, q, tables[0], new.storage, new.layout)
    else:
        torch.ops.kvaddr.step_into.tables(dec, q, tables if sizes else [], new.storage, new.layout)
    torch.ops.kvaddr.step.default(dec, q, tables if sizes else [], list(sizes), *old.outputs_args)
    assert torch.equal(new.storage, old.storage)  # every word, padding included
    ref = _ref(case, (np.int64, np.int32)[seed % 2])
    assert_outputs_equal(_host(new, bsz), ref.outputs, f"seed {seed}")
    assert new.errors() == (ref.error_mask, ref.error_key)


@pytest.mark.parametrize("sizes,overload", [([4, 2], "one"), ([4, 2], "tables"), ([4], "one"), ([], "tables")])
@pytest.mark.parametrize("position_dtype", ["int64", "int32"])
def test_opcheck_passes_on_step_into(sizes, overload, position_dtype):
    import torch
    from torch.library import opcheck

    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(6, 16, sizes, position_dtype=getattr(torch, position_dtype), device="cpu")
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.tensor([1, 3, 2], dtype=torch.int32)
    t0 = torch.arange(24, dtype=torch.int32).reshape(3, 8)
    if overload == "one":
        result = opcheck(torch.ops.kvaddr.step_into.default, (dec, q, t0, bufs.storage, bufs.layout))
    else:
        tables = [t0, t0.flip(0).contiguous()][: len(sizes)]
        result = opcheck(torch.ops.kvaddr.step_into.tables, (dec, q, tables, bufs.storage, bufs.layout))
    assert all(v == "SUCCESS" for v in result.values()), result


def _packed_args(**over):
    import torch

    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(8, 16, [4, 2], device="cpu")
    a = dict(
        seq_lens_decoder=torch.tensor([5, 0, 9], dtype=torch.int32),
        seq_lens_this_time=torch.tensor([1, 3, 2], dtype=torch.int32),
        block_table=torch.zeros(3, 8, dtype=torch.int32),
        out=bufs.storage,
        layout=bufs.layout,
    )
    a.update(over)
    return list(a.values())


def _bad_cases():
    if SKIP:
        return []
    import torch

    from kvaddr.torch import StepBuffers

    other = StepBuffers(8, 300, [4, 2], device="cpu")  # another size of storage
    small = StepBuffers(2, 16, [4, 2], device="cpu")
    i32 = torch.int32
    return [
        (dict(layout=10**6), ValueError, r"layout must be a StepBuffers.layout handle"),
        (dict(out=other.storage), ValueError, r"out must be the StepBuffers.storage of this layout"),
        (dict(out=torch.zeros(4, dtype=i32)), ValueError, r"out must be the StepBuffers.storage .*torch.int32"),
        (dict(layout=small.layout, out=small.storage), ValueError, r"at most max_requests = 2 entries .*got 3"),
        (dict(seq_lens_decoder=torch.zeros(3, dtype=torch.int64)), TypeError, r"seq_lens_decoder must be int32"),
        (dict(seq_lens_this_time=torch.zeros(2, dtype=i32)), ValueError, r"seq_lens_this_time must have shape"),
        (dict(block_table=torch.zeros(2, 8, dtype=i32)), ValueError, r"block_tables must be .*2 rows for bsz = 3"),
        (dict(block_table=torch.zeros(3, 8)), TypeError, r"block_tables must be int32 .*float32"),
    ]


@pytest.mark.parametrize("over,exc,message", _bad_cases())
def test_bad_arguments_of_step_into_raise_naming_the_argument(over, exc, message):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _packed_args(**over)
    with pytest.raises(exc, match=message):
        torch.ops.kvaddr.step_into.default(*args)
    tables_args = [*args[:2], [args[2]], *args[3:]]
    with pytest.raises(exc, match=message):
        torch.ops.kvaddr.step_into.tables(*tables_args)
    with FakeTensorMode() as mode:  # the fake kernel checks the same way (trace time)
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(exc, match=message):
            torch.ops.kvaddr.step_into.default(*fake)


def test_step_into_tables_refuses_a_wrong_number_of_tables():
    import torch

    args = _packed_args()
    t = args[2]
    with pytest.raises(ValueError, match=r"block_tables must be one table or 2 .*got 3"):
        torch.ops.kvaddr.step_into.tables(*args[:2], [t, t, t], *args[3:])


def test_step_keeps_its_views_per_bsz_in_eager_mode():
    import kvaddr.torch as kt

    rng = np.random.default_rng(5)
    bufs = kt.StepBuffers(12, 64, [16, 8], device="cpu")
    seen = {}
    for i in range(6):
        bsz = (5, 9, 5, 12, 9, 5)[i]
        case = random_step(rng, bsz=bsz, num_caches=2, shared_table=i % 2 == 0, block_sizes=[16, 8])
        case["capacity"] = 64
        dec, q, tables = case_tensors(case, "cpu")
        out = kt.step(dec, q, tables[0] if i % 2 == 0 else tables, bufs)
        if bsz in seen:
            assert out is seen[bsz]  # the same StepOutputs, the same view objects
        seen[bsz] = out
        assert out.cu_seqlens_q.shape == (bsz + 1,) and out.seq_lens_kv.shape == (bsz,)
        ref = _ref(case)
        assert_outputs_equal(_host(out, bsz), ref.outputs, f"step {i}")
    assert len({id(v) for v in seen.values()}) == 3
    assert seen[5].position_ids is bufs.position_ids
    assert len(bufs._views) == 3
    kt.ops.VIEWS_CACHE_SIZE, old = 2, kt.ops.VIEWS_CACHE_SIZE
    try:
        case = random_step(rng, bsz=7, num_caches=2, shared_table=True, block_sizes=[16, 8])
        dec, q, tables = case_tensors(case, "cpu")
        kt.step(dec, q, tables[0], bufs)
        assert len(bufs._views) == 1  # bounded: forgotten all, then kept this one
    finally:
        kt.ops.VIEWS_CACHE_SIZE = old


def test_positions_only_buffers_take_the_tables_overload():
    import torch

    import kvaddr.torch as kt

    bufs = kt.StepBuffers(4, 16, [], device="cpu")
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.tensor([1, 3, 2], dtype=torch.int32)
    out = kt.step(dec, q, None, bufs)
    case = dict(seq_lens_decoder=dec.numpy(), seq_lens_this_time=q.numpy(), block_tables=[], block_sizes=[])
    ref = _ref(dict(case, capacity=16))
    assert_outputs_equal(_host(out, 3), ref.outputs, "positions only")


def _inputs(seed=0):
    import torch

    rng = np.random.default_rng(seed)
    case = random_step(rng, bsz=9, num_caches=1)
    dec, q, tables = case_tensors(case, "cpu")
    return case, dec.clone(), q.clone(), tables[0].contiguous().clone(), torch.randn(32, 8)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_the_old_op_on_packed_views_compiles_and_matches_eager(backend):
    """README's pattern: the old op on ``StepBuffers.outputs_args`` (views of one storage) under
    torch.compile(fullgraph=True): the mutations reach the storage, the outputs equal eager's."""
    import torch

    from kvaddr.torch import StepBuffers

    case, dec, q, table, hidden = _inputs(3)
    bufs = StepBuffers(16, case["capacity"], case["block_sizes"][:1], device="cpu")

    def model(dec, q, table, hidden):
        torch.ops.kvaddr.step(dec, q, [table], bufs.block_sizes, *bufs.outputs_args)
        h = hidden[bufs.position_ids % hidden.shape[0]]
        return h.sum(-1) + bufs.slot_mapping[0].to(h.dtype), bufs.seq_lens_kv[: dec.shape[0]] + 0

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for shift in (0, 2):
        dec.add_(shift)
        want = [x.clone() for x in model(dec, q, table, hidden)]
        want_storage = bufs.storage.clone()
        bufs.slot_mapping.fill_(9)
        bufs.position_ids.fill_(9)
        bufs.num_tokens.fill_(9)
        got = compiled(dec, q, table, hidden)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(bufs.storage, want_storage)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_step_into_with_a_list_of_tables_compiles_with_fullgraph(backend):
    import torch

    from kvaddr.torch import StepBuffers, step

    rng = np.random.default_rng(11)
    case = random_step(rng, bsz=6, num_caches=2, shared_table=False, block_sizes=[8, 4])
    dec, q, tables = case_tensors(case, "cpu")
    tables = [t.contiguous().clone() for t in tables]
    bufs = StepBuffers(8, case["capacity"], [8, 4], device="cpu")

    def model(dec, q, t0, t1):
        out = step(dec, q, [t0, t1], bufs)
        return out.slot_mapping + 0, out.cu_seqlens_q * 1, out.num_tokens + 0

    want = [x.clone() for x in model(dec, q, *tables)]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(dec, q, *tables)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    bufs.storage.fill_(1)
    got = torch.compile(model, fullgraph=True, backend=backend)(dec, q, *tables)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_autograd_fallthrough_covers_both_ops():
    import torch

    import kvaddr.torch as kt

    def has_fallthrough(name):
        dump = torch._C._dispatch_dump(name)
        return any(line.startswith("Autograd") and "fallthrough" in line for line in dump.splitlines())

    names = ("kvaddr::step", "kvaddr::step_into", "kvaddr::step_into.tables")
    try:
        assert all(has_fallthrough(n) for n in names)
        kt.set_autograd_fallthrough(False)
        assert not any(has_fallthrough(n) for n in names)
        args = _packed_args()
        v = args[3]._version
        torch.ops.kvaddr.step_into.default(*args)
        assert args[3]._version > v
    finally:
        kt.set_autograd_fallthrough(True)
    assert all(has_fallthrough(n) for n in names)


# -- the CUDA kernel's Python, with the launch faked ----------------------------------------


def test_step_into_launches_on_the_storage_pointers_like_the_old_op(fake_cuda_launch):
    from kvaddr.torch import ops

    dec, q, table, out, layout = args = _packed_args()
    bufs_views = ops._layout_of(layout).views(out)
    ops._into_cuda(*args)
    ops._into_tables_cuda(dec, q, [table], out, layout)
    ops._step_cuda(dec, q, [table], [4, 2], *bufs_views)
    assert len(fake_cuda_launch) == 3
    P = [bytes(launch_params(c)) for c in fake_cuda_launch]
    assert P[0] == P[1] == P[2]  # the same kernel parameters, byte for byte
    assert all(c[:9] == fake_cuda_launch[0][:9] for c in fake_cuda_launch)  # function, grid, block, stream
    p = launch_params(fake_cuda_launch[0])
    cu, nt, batch, pos, kv, slots, ws = bufs_views
    assert (p.cu_seqlens_q, p.num_tokens, p.batch_id_per_token) == (cu.data_ptr(), nt.data_ptr(), batch.data_ptr())
    assert (p.position_ids, p.seq_lens_kv, p.slot_mapping) == (pos.data_ptr(), kv.data_ptr(), slots.data_ptr())
    assert p.tile_state == out.data_ptr() == ws.data_ptr() and p.bsz == 3
    assert list(p.block_size) == [4, 2, 1, 1] and list(p.block_tables)[:2] == [table.data_ptr()] * 2


def test_step_into_remembers_argument_sets_by_identity(fake_cuda_launch, monkeypatch):
    import torch

    from kvaddr.torch import ops

    binds = []
    real = ops._bind
    monkeypatch.setattr(ops, "_bind", lambda *a: binds.append(1) or real(*a))
    args = _packed_args()
    for _ in range(3):
        ops._into_cuda(*args)
    assert len(binds) == 1 and len(fake_cuda_launch) == 3
    first = fake_cuda_launch[0]
    assert all(c == first for c in fake_cuda_launch)
    ops._into_cuda(args[0].clone(), *args[1:])  # a new object: checked again
    assert len(binds) == 2
    # the other overload with the same one table: the same key, the same (identical) entry
    ops._into_tables_cuda(args[0], args[1], [args[2]], *args[3:])
    assert len(binds) == 2
    t2 = args[2].clone()
    ops._into_tables_cuda(args[0], args[1], [args[2], t2], *args[3:])  # two tables: a new set
    ops._into_tables_cuda(args[0], args[1], [args[2], t2], *args[3:])
    assert len(binds) == 3
    other = ops.StepBuffers(8, 16, [4, 2], position_dtype=torch.int32, device="cpu")
    ops._into_cuda(*args[:3], other.storage, other.layout)  # another storage and layout
    assert len(binds) == 4
    ops.set_debug(True)
    ops._into_cuda(*args)
    ops._into_cuda(*args)
    assert len(binds) == 6
    ops.set_debug(False)
    ops._into_cuda(*args)
    ops._into_cuda(*args)
    assert len(binds) == 7


def test_step_into_checks_before_launching_and_forgets_dead_tensors(fake_cuda_launch):
    import gc
    import weakref

    import torch

    from kvaddr.torch import ops

    args = _packed_args()
    with pytest.raises(ValueError, match=r"out must be the StepBuffers.storage"):
        ops._into_cuda(*args[:3], torch.zeros(5, dtype=torch.int64), args[4])
    with pytest.raises(ValueError, match=r"layout must be a StepBuffers.layout handle"):
        ops._into_cuda(*args[:4], -3)
    assert fake_cuda_launch == [] and len(ops._cache) == 0
    args[0] = torch.tensor([5, 0, 9], dtype=torch.int32)
    ops._into_cuda(*args)
    assert len(ops._cache) == 1
    ref = weakref.ref(args[0])
    args[0] = None
    gc.collect()
    assert ref() is None and len(ops._cache) == 0


def test_step_without_tables_for_buffers_with_caches_names_the_argument():
    import torch

    import kvaddr.torch as kt

    bufs = kt.StepBuffers(4, 16, [4, 2], device="cpu")
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    for tables in (None, []):
        with pytest.raises(ValueError, match=r"block_tables must be one table or 2 .*got 0 tables"):
            kt.step(dec, dec, tables, bufs)
