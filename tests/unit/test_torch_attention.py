"""``kvaddr.torch.step`` / ``torch.ops.kvaddr.step_into`` with attention outputs, on the CPU:
``StepBuffers(..., attention=..., kv_indices_capacity=...)`` packs the metadata (docs/attention.md)
into ``storage``; the values equal ``kvaddr.attention_reference`` (docs/attention.md's worked
examples, random mixed batches, every group subset), the error records (bit 16 too) reach
``errors()``/``check()``, opcheck and torch.compile(fullgraph=True) pass, and the CUDA kernel's
Python (launch faked) fills the kernel's attention fields with pointers into ``storage`` and
launches the dispatch table's kernel and grid (its metadata blocks too). Skips without torch. tests/gpu/test_torch_attention_gpu.py runs
the CUDA kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import dispatch
from kvaddr.errors import ERR_KV_INDICES_CAPACITY, NO_ERROR_KEY, AddressingError, decode_error_key
from tests.support.fake_cupy import function_ptr
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
from tests.support.torch_fakes import launch_params
from tests.support.torch_ops import case_tensors, torch_skip_reason

SKIP = torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

I32 = np.int32


def _run(case, attention, n, *, max_requests=None, buffers=None, device="cpu"):
    import torch

    import kvaddr.torch as kt

    dec, q, tables = case_tensors(case, device)
    bsz = dec.shape[0]
    if buffers is None:
        buffers = kt.StepBuffers(
            max(max_requests or bsz, 1),
            case["capacity"],
            case["block_sizes"],
            device=device,
            attention=attention,
            kv_indices_capacity=n,
        )
    poison(buffers)
    out = kt.step(dec, q, tables[0] if len(set(map(id, tables))) == 1 else tables, buffers)
    if device != "cpu":
        torch.cuda.synchronize()
    return out, buffers, tables


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


# -- docs/attention.md's worked examples -------------------------------------------------


def test_example_1_every_group():
    out, bufs, tables = _run(EXAMPLE_1, ALL, 8, max_requests=5)
    a = out.attention
    assert a.qo_indptr.tolist() == [0, 1, 4, 6]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 6]]
    assert a.kv_indices.tolist() == [[7, 2, 4, 1, 3, 8, -1, -1]]
    assert a.kv_last_page_len.tolist() == [[2, 3, 3]]
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20]
    assert a.seqused_k.tolist() == [6, 3, 11]
    assert a.max_seqlen_q.shape == () and int(a.max_seqlen_q) == 3 and int(a.max_seqlen_k) == 11
    assert len(a.page_table) == 1 and a.page_table[0].tolist() == EXAMPLE_1["block_tables"].tolist()
    assert a.page_table[0].data_ptr() == tables[0].data_ptr()  # a view of the input, no copy
    assert a.qo_indptr.data_ptr() == bufs.cu_seqlens_q.data_ptr()  # the same buffer, as the planner's
    assert a.seqused_k.data_ptr() == bufs.seq_lens_kv.data_ptr()
    assert bufs.errors() == (0, NO_ERROR_KEY)
    bufs.check()


def test_example_2_mixed_batch_two_caches():
    out, bufs, _ = _run(EXAMPLE_2, "flashinfer,varlen", 9)
    a = out.attention
    assert a.qo_indptr.tolist() == [0, 0, 4, 6, 6]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 5, 5], [0, 4, 6, 9, 9]]
    assert a.kv_last_page_len.tolist() == [[4, 4, 1, 0], [2, 2, 1, 0]]
    assert a.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1, -1, -1, -1], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    assert a.cu_seqlens_k.tolist() == [0, 8, 12, 17, 17]
    assert a.seqused_k.tolist() == [8, 4, 5, 0]
    assert int(a.max_seqlen_q) == 4 and int(a.max_seqlen_k) == 8
    assert a.page_table is None
    assert bufs.errors()[0] == 0


def test_example_2_kv_indices_overflow_sets_bit_16_in_errors_and_check():
    out, bufs, _ = _run(EXAMPLE_2, "flashinfer", 6)
    a = out.attention
    assert a.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1], [10, 11, 12, 13, 14, 15]]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 5, 5], [0, 4, 6, 9, 9]]  # the true sums
    mask, key = bufs.errors()
    assert mask == ERR_KV_INDICES_CAPACITY and decode_error_key(key) == (4, 2, 1, 16)
    assert bufs.errors() == (0, NO_ERROR_KEY)  # the read reset the (sticky) records
    _run(EXAMPLE_2, "flashinfer", 6, buffers=bufs)
    with pytest.raises(AddressingError, match=r"token 4 of request 2, cache 1: more kv_indices entries"):
        bufs.check()
    # the next step within the capacity writes no record (check() reset them)
    small = dict(
        EXAMPLE_2, seq_lens_decoder=np.asarray([1, 0, 1, 0], I32), seq_lens_this_time=np.asarray([0, 1, 1, 0], I32)
    )
    _run(small, "flashinfer", 6, buffers=bufs)
    assert bufs.errors() == (0, NO_ERROR_KEY)


def test_example_3_bad_rows():
    out, bufs, _ = _run(EXAMPLE_3, "flashinfer", 8)
    a = out.attention
    assert a.kv_indptr.tolist() == [[0, 2, 6]]
    assert a.kv_indices.tolist() == [[3, -1, 1, 2, 4, -1, -1, -1]]
    assert a.kv_last_page_len.tolist() == [[1, 1]]
    mask, key = bufs.errors()
    assert mask == 3 and decode_error_key(key) == (0, 0, 0, 2)
    _run(EXAMPLE_3, "flashinfer", 8, buffers=bufs)
    with pytest.raises(AddressingError, match="token 0 of request 0, cache 0: negative"):
        bufs.check()


# -- random mixed batches ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(24))
def test_random_batches_equal_the_reference(seed):
    import torch

    rng = np.random.default_rng(7000 + seed)
    groups = GROUP_SETS[seed % len(GROUP_SETS)]
    case = random_step(rng, errors=seed % 3 == 0, over_capacity=seed % 5 == 1)
    need = total_pages(case)
    n = max(1, need + int(rng.integers(0, 9)) if seed % 4 else need // 2 + 1)  # every 4th: overflow
    if "flashinfer" not in groups:
        n = None
    out, bufs, _ = _run(case, groups, n, max_requests=len(case["seq_lens_decoder"]) + int(rng.integers(0, 5)))
    ref = reference(case, groups, n)
    bsz = len(case["seq_lens_decoder"])
    assert_outputs_equal(_host(out, bsz), ref.outputs, f"seed {seed}")
    assert_attention_equal(host_attention(out.attention), ref.outputs.attention, f"seed {seed} {groups}")
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    # the addressing words equal those of buffers without attention (the same op, the same values)
    plain, _, _ = _run(case, None, None, max_requests=bufs.max_requests)
    for f in ("cu_seqlens_q", "seq_lens_kv"):
        assert torch.equal(getattr(out, f), getattr(plain, f)), f
    for f in ("num_tokens", "batch_id_per_token", "position_ids", "slot_mapping"):
        assert torch.equal(getattr(out, f), getattr(plain, f)), f


def test_step_into_overloads_and_the_old_op_agree_on_attention_buffers():
    import torch

    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(3)
    case = random_step(rng, bsz=9, num_caches=2, shared_table=False, block_sizes=[4, 16])
    dec, q, tables = case_tensors(case, "cpu")
    kw = dict(device="cpu", attention=ALL, kv_indices_capacity=total_pages(case) + 3)
    a, b = StepBuffers(12, case["capacity"], [4, 16], **kw), StepBuffers(12, case["capacity"], [4, 16], **kw)
    assert a.layout == b.layout
    torch.ops.kvaddr.step_into.tables(dec, q, tables, a.storage, a.layout)
    torch.ops.kvaddr.step_into.tables(dec, q, [tables[0], tables[1]], b.storage, b.layout)
    assert torch.equal(a.storage, b.storage)
    # one table for both caches: the .default overload and .tables with one table agree
    torch.ops.kvaddr.step_into.default(dec, q, tables[0], a.storage, a.layout)
    torch.ops.kvaddr.step_into.tables(dec, q, [tables[0]], b.storage, b.layout)
    assert torch.equal(a.storage, b.storage)
    # the old op on outputs_args writes the addressing (its workspace: the addressing's records)
    c = StepBuffers(12, case["capacity"], [4, 16], device="cpu")
    torch.ops.kvaddr.step.default(dec, q, [tables[0]], [4, 16], *a.outputs_args)
    torch.ops.kvaddr.step.default(dec, q, [tables[0]], [4, 16], *c.outputs_args)
    for x, y in zip(a.outputs_args[:6], c.outputs_args[:6]):
        assert torch.equal(x, y)


# -- the packing -------------------------------------------------------------------------


@pytest.mark.parametrize("groups", GROUP_SETS)
@pytest.mark.parametrize("sizes,capacity,max_requests,n", [([16], 7, 3, 5), ([4, 8, 16, 32], 300, 5000, 70000)])
def test_attention_views_are_aligned_disjoint_and_inside_the_storage(groups, sizes, capacity, max_requests, n):
    import torch

    from kvaddr.torch import StepBuffers, ops, workspace_size

    bufs = StepBuffers(max_requests, capacity, sizes, device="cpu", attention=groups, kv_indices_capacity=n)
    C, M, G = capacity, max_requests, len(sizes)
    fi, vl = "flashinfer" in groups, "varlen" in groups
    lay = bufs._layout
    rec = dispatch.step_records(lay.config)  # every kernel the layout may run has its records
    E, per_cache, num_meta = lay.meta
    assert num_meta == (G * per_cache if fi or "page_table" in groups else 1) and E % 256 == 0 and E >= 2048
    assert per_cache == (-(-n // E) if fi else 1)
    want = {
        "cu_seqlens_q": (torch.int32, (M + 1,)),
        "num_tokens": (torch.int32, ()),
        "batch_id_per_token": (torch.int32, (C,)),
        "position_ids": (torch.int64, (C,)),
        "seq_lens_kv": (torch.int32, (M,)),
        "slot_mapping": (torch.int64, (G, C)),
        "workspace": (torch.int64, (workspace_size(C, M) + 2 * (rec.records - (rec.chunks + rec.tiles) * ops._WARPS),)),
        "kv_indptr": (torch.int32, (G, M + 1)) if fi else None,
        "kv_last_page_len": (torch.int32, (G, M + 1)) if fi else None,
        "kv_indices": (torch.int32, (G, n)) if fi else None,
        "cu_seqlens_k": (torch.int32, (M + 1,)) if vl else None,
        "max_seqlen": (torch.int32, (2,)) if vl else None,
    }
    base, end = bufs.storage.data_ptr(), bufs.storage.data_ptr() + 8 * bufs.storage.numel()
    spans = []
    for name, w in want.items():
        t = getattr(bufs, name)
        if w is None:
            assert t is None, name
            continue
        assert (t.dtype, tuple(t.shape)) == w, name
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == bufs.storage.untyped_storage().data_ptr()
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert (lo - base) % 256 == 0 and base <= lo <= hi <= end, name
        spans.append((lo, hi, name))
    spans.sort()
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        assert hi <= lo, f"{a} overlaps {b}"
    if fi:
        assert torch.all(bufs.kv_indices == -1)
    assert bufs.errors() == (0, NO_ERROR_KEY)
    # the old op's workspace is the addressing part, a prefix of the whole workspace
    ws = bufs.outputs_args[6]
    assert ws.numel() == workspace_size(C, M) and ws.data_ptr() == bufs.workspace.data_ptr()


def test_layouts_without_attention_are_unchanged_and_attention_settings_name_other_layouts():
    import torch

    from kvaddr.torch import StepBuffers, ops

    plain = StepBuffers(8, 16, [4, 2], device="cpu")
    none = StepBuffers(8, 16, [4, 2], device="cpu", attention=None, kv_indices_capacity=99)  # N ignored
    empty = StepBuffers(8, 16, [4, 2], device="cpu", attention="")
    assert plain.layout == none.layout == empty.layout
    assert plain._layout.key() == (16, 8, (4, 2), True)  # the key before attention existed
    lay = ops._Layout(16, 8, (4, 2), True)
    assert lay.words == plain.storage.numel() and plain.attention == () and plain.kv_indices is None
    handles = {
        plain.layout,
        StepBuffers(8, 16, [4, 2], device="cpu", attention="varlen").layout,
        StepBuffers(8, 16, [4, 2], device="cpu", attention="page_table").layout,
        StepBuffers(8, 16, [4, 2], device="cpu", attention="flashinfer", kv_indices_capacity=64).layout,
        StepBuffers(8, 16, [4, 2], device="cpu", attention="flashinfer", kv_indices_capacity=65).layout,
        StepBuffers(8, 16, [4, 2], device="cpu", attention="flashinfer,varlen", kv_indices_capacity=64).layout,
    }
    assert len(handles) == 6
    a = StepBuffers(8, 16, [4, 2], device="cpu", attention=["varlen", "flashinfer"], kv_indices_capacity=64)
    b = StepBuffers(8, 16, [4, 2], device="cpu", attention="flashinfer,varlen", kv_indices_capacity=64)
    assert a.layout == b.layout and a.attention == ("flashinfer", "varlen")
    # a storage of another layout is refused, also between layouts of the same settings but attention
    dec = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out must be the StepBuffers.storage of this layout"):
        torch.ops.kvaddr.step_into.default(dec, dec, torch.zeros(2, 4, dtype=torch.int32), plain.storage, a.layout)


def test_bad_attention_settings_raise_naming_the_argument():
    import torch

    from kvaddr.torch import StepBuffers

    with pytest.raises(ValueError, match=r"kv_indices_capacity must be an int in \[1, 2147483647\]"):
        StepBuffers(4, 8, [4], device="cpu", attention="flashinfer")
    with pytest.raises(ValueError, match=r"kv_indices_capacity"):
        StepBuffers(4, 8, [4], device="cpu", attention="flashinfer", kv_indices_capacity=0)
    with pytest.raises(ValueError, match=r"attention must name groups among"):
        StepBuffers(4, 8, [4], device="cpu", attention="flashinfo")
    for groups in ("flashinfer", "page_table"):
        with pytest.raises(ValueError, match=r"need at least one cache"):
            StepBuffers(4, 8, [], device="cpu", attention=groups, kv_indices_capacity=8)
    # varlen alone on positions-only buffers: cu_seqlens_k and the maxima of the lengths
    bufs = StepBuffers(4, 8, [], device="cpu", attention="varlen")
    dec, q = torch.tensor([5, 0, 9], dtype=torch.int32), torch.tensor([1, 3, 2], dtype=torch.int32)
    import kvaddr.torch as kt

    a = kt.step(dec, q, None, bufs).attention
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20] and int(a.max_seqlen_q) == 3 and int(a.max_seqlen_k) == 11


def test_eager_step_keeps_views_per_bsz_and_sets_the_page_table_per_call():
    import kvaddr.torch as kt

    rng = np.random.default_rng(21)
    bufs = kt.StepBuffers(12, 64, [16, 8], device="cpu", attention=ALL, kv_indices_capacity=400)
    seen = {}
    for i, bsz in enumerate((5, 9, 5, 12, 9, 5)):
        case = random_step(rng, bsz=bsz, num_caches=2, shared_table=i % 2 == 0, block_sizes=[16, 8])
        case["capacity"] = 64
        dec, q, tables = case_tensors(case, "cpu")
        out = kt.step(dec, q, tables[0] if i % 2 == 0 else tables, bufs)
        if bsz in seen:
            assert out is seen[bsz]
        seen[bsz] = out
        ref = reference(case, ALL, 400)
        assert_attention_equal(host_attention(out.attention), ref.outputs.attention, f"step {i}")
        assert out.attention.page_table[1].data_ptr() == tables[1].data_ptr()  # this call's tables
    assert len(bufs._pt_views) == 3 and not bufs._views
    # without page_table the views go to the plain per-bsz cache
    b2 = kt.StepBuffers(12, 64, [16, 8], device="cpu", attention="flashinfer,varlen", kv_indices_capacity=400)
    o1 = kt.step(dec, q, tables, b2)
    assert kt.step(dec, q, tables, b2) is o1 and len(b2._views) == 1 and o1.attention.page_table is None


# -- opcheck and torch.compile -----------------------------------------------------------


@pytest.mark.parametrize("groups", [ALL, ("flashinfer",), ("varlen",), ("page_table",)])
@pytest.mark.parametrize("overload", ["one", "tables"])
def test_opcheck_passes_with_attention(groups, overload):
    import torch
    from torch.library import opcheck

    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(6, 16, [4, 2], device="cpu", attention=groups, kv_indices_capacity=40)
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.tensor([1, 3, 2], dtype=torch.int32)
    t0 = torch.arange(24, dtype=torch.int32).reshape(3, 8)
    if overload == "one":
        result = opcheck(torch.ops.kvaddr.step_into.default, (dec, q, t0, bufs.storage, bufs.layout))
    else:
        tables = [t0, t0.flip(0).contiguous()]
        result = opcheck(torch.ops.kvaddr.step_into.tables, (dec, q, tables, bufs.storage, bufs.layout))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_step_with_attention_compiles_with_fullgraph_and_matches_eager(backend):
    import torch

    from kvaddr.torch import StepBuffers, step

    rng = np.random.default_rng(17)
    case = random_step(rng, bsz=7, num_caches=2, shared_table=False, block_sizes=[8, 4])
    dec, q, tables = case_tensors(case, "cpu")
    tables = [t.contiguous().clone() for t in tables]
    n = total_pages(case) + 5
    bufs = StepBuffers(8, case["capacity"], [8, 4], device="cpu", attention=ALL, kv_indices_capacity=n)

    def model(dec, q, t0, t1):
        a = step(dec, q, [t0, t1], bufs).attention
        return (
            a.qo_indptr + 0,
            a.kv_indptr * 1,
            a.kv_indices + 0,
            a.kv_last_page_len + 0,
            a.cu_seqlens_k + 0,
            a.seqused_k + 0,
            a.max_seqlen_q + a.max_seqlen_k * 1000,
            a.page_table[0] + 0,
            a.page_table[1] + 0,
        )

    want = [x.clone() for x in model(dec, q, *tables)]
    ref = reference(dict(case, block_tables=[t.numpy() for t in tables]), ALL, n).outputs.attention
    assert want[2].tolist() == ref.kv_indices.tolist()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(dec, q, *tables)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for shift in (0, 3):
        dec.add_(shift)
        want = [x.clone() for x in model(dec, q, *tables)]
        bufs.storage.fill_(1)
        got = compiled(dec, q, *tables)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_fake_kernel_checks_attention_buffers_like_the_real_one():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvaddr.torch import StepBuffers

    bufs = StepBuffers(2, 16, [4], device="cpu", attention=ALL, kv_indices_capacity=8)
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    t = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"at most max_requests = 2 entries .*got 3"):
        torch.ops.kvaddr.step_into.default(dec, dec, t, bufs.storage, bufs.layout)
    d2 = dec[:2].clone()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (dec, dec, t, bufs.storage)]
        ok = [mode.from_tensor(x) for x in (d2, d2, t, bufs.storage)]
        with pytest.raises(ValueError, match=r"at most max_requests = 2 entries .*got 3"):
            torch.ops.kvaddr.step_into.default(*fake, bufs.layout)
        torch.ops.kvaddr.step_into.default(*ok, bufs.layout)  # passes: checks only


# -- the CUDA kernel's Python, with the launch faked -------------------------------------


@pytest.mark.parametrize("groups", [ALL, ("flashinfer",), ("varlen",), ("page_table",), ("flashinfer", "varlen")])
def test_step_into_launches_the_metadata_blocks_on_the_storage_pointers(fake_cuda_launch, groups):
    import torch

    from kvaddr import dispatch, kernel_loader
    from kvaddr.torch import ops

    consts = kernel_loader.constants()
    n = 70000
    bufs = ops.StepBuffers(8, 16, [4, 2], device="cpu", attention=groups, kv_indices_capacity=n)
    plain = ops.StepBuffers(8, 16, [4, 2], device="cpu")
    dec = torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.tensor([1, 3, 2], dtype=torch.int32)
    table = torch.zeros(3, 8, dtype=torch.int32)
    ops._into_cuda(dec, q, table, bufs.storage, bufs.layout)
    ops._into_cuda(dec, q, table, plain.storage, plain.layout)
    ops._into_cuda(dec, q, table, bufs.storage, bufs.layout)  # the remembered set: the same launch
    assert len(fake_cuda_launch) == 3 and fake_cuda_launch[0] == fake_cuda_launch[2]
    p, p0 = launch_params(fake_cuda_launch[0]), launch_params(fake_cuda_launch[1])
    E, per_cache, num_meta = bufs._layout.meta
    fi, vl = "flashinfer" in groups, "varlen" in groups
    assert num_meta > 0
    # each launch is the dispatch table's for its layout (the attention kernel: its metadata blocks too)
    for call, lay in ((fake_cuda_launch[0], bufs._layout), (fake_cuda_launch[1], plain._layout)):
        launch = dispatch.step_launch(lay.config, 3)
        assert (call[0], call[1], call[4]) == (function_ptr(launch.kernel), launch.blocks, launch.threads)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    assert (p.kv_indptr, p.kv_indices, p.kv_last_page_len) == tuple(
        map(ptr, (bufs.kv_indptr, bufs.kv_indices, bufs.kv_last_page_len))
    )
    assert (p.cu_seqlens_k, p.max_seqlen) == (ptr(bufs.cu_seqlens_k), ptr(bufs.max_seqlen))
    flags = (
        (consts["KV_ATTN_FLASHINFER"] if fi else 0)
        | (consts["KV_ATTN_VARLEN"] if vl else 0)
        | (consts["KV_ATTN_PAGE_TABLE"] if "page_table" in groups else 0)
    )
    assert p.attention == flags and p.attn_stride == 9 and p.kv_indices_capacity == (n if fi else 1)
    assert (p.meta_entries, p.meta_per_cache, p.num_meta) == (E, per_cache, num_meta)
    # the addressing fields on the buffers' views (the workspace first: its metadata records shift the rest)
    for f in ("cu_seqlens_q", "num_tokens", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping"):
        assert getattr(p, f) == getattr(bufs, f).data_ptr() and getattr(p0, f) == getattr(plain, f).data_ptr(), f
    assert (p.bsz, p.capacity, p.num_caches, list(p.block_size)) == (3, 16, 2, [4, 2, 1, 1])
    assert p.tile_state == bufs.storage.data_ptr() and p.max_tiles == p0.max_tiles == ops._max_tiles(16, 8)
    # the records of every kernel of the layout (dispatch.step_records) end at the workspace's end
    rec_end = p.error_records + 16 * dispatch.step_records(bufs._layout.config).records
    assert rec_end == bufs.workspace.data_ptr() + 8 * bufs.workspace.numel()
    # the plain launch has no attention (as before)
    assert p0.attention == 0 and p0.num_meta == 0 and p0.kv_indices == 0
