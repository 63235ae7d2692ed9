"""StepPlanner's attention plumbing on the CPU: a fake CuPy whose device arrays are NumPy
buffers, and a launch that runs the token outputs from the reference and the metadata
blocks through tests/support/meta_kernel_model.py (a line-by-line model of kernels.cu's
kv_meta_block reading the launch's KvStepParams). Checks the planner's sizing (grid,
metadata blocks, entries per block, error-record slots), the struct fields, the output
views (shapes, dtypes, aliases, page_table) and, through the model, the outputs against
the NumPy reference. The kernel itself runs in tests/gpu."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr import kernel_loader
from kvaddr.reference import step_addressing
from tests.support import meta_kernel_model
from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.gpu import reference

GROUPS = [
    ("flashinfer",),
    ("varlen",),
    ("page_table",),
    ("flashinfer", "varlen"),
    ("flashinfer", "page_table"),
    ("varlen", "page_table"),
    ALL_GROUPS,
]


class FakeDeviceArray(np.ndarray):
    """A NumPy array that kvaddr.validation.describe takes for a CuPy array on device 0."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    def get(self, stream=None, out=None):
        if out is not None:
            out[...] = np.asarray(self)
            return out
        return np.array(self)


FakeDeviceArray.__module__ = "cupy._fake"


def _dev(a):
    return np.ascontiguousarray(a).view(FakeDeviceArray)


class FakeStream:
    ptr = 0

    def synchronize(self):
        pass


@pytest.fixture
def fake_planner(monkeypatch):
    """(StepPlanner class, launches list); each launch records (grid, records of the metadata blocks)."""
    cp = types.ModuleType("cupy")
    cp.zeros = lambda shape, dtype=float: _dev(np.zeros(shape, dtype))
    cp.full = lambda shape, v, dtype=None: _dev(np.full(shape, v, dtype))
    cp.asarray = lambda a: _dev(np.asarray(a))
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {"multiProcessorCount": 4}
        ),
        Device=lambda i=0: types.SimpleNamespace(__enter__=None),
        get_current_stream=lambda: FakeStream(),
    )

    class Dev:
        def __init__(self, i=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cp.cuda.Device = Dev
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(kernel_loader, "get_function", lambda name, device_id=None: name)
    launches = []
    tile = {"size": 4096}

    class FakeLauncher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args

        def __call__(self, grid, block, stream):
            P = self.args
            bsz = P.bsz
            dec = meta_kernel_model._view(P.seq_lens_decoder, bsz)
            q = meta_kernel_model._view(P.seq_lens_this_time, bsz)
            # the token blocks' per-request outputs, as the reference has them
            ref = step_addressing(dec.copy(), q.copy(), [np.zeros((max(bsz, 1), 1), np.int32)], [1], P.capacity)
            meta_kernel_model._view(P.cu_seqlens_q, bsz + 1)[:] = ref.outputs.cu_seqlens_q
            meta_kernel_model._view(P.seq_lens_kv, bsz)[:] = ref.outputs.seq_lens_kv
            if P.meta_impl & 255 == 0:  # the first version (tile: its KV_TILE)
                launches.append((grid, meta_kernel_model.run_meta_blocks(P, tile["size"])))
            elif P.meta_impl & 255 == 3:  # one round (kv_meta_block3; block2 where rq > KV_THREADS)
                launches.append((grid, meta_kernel_model.run_meta_blocks3(P, pre=min(tile["size"], 16))))
            else:  # request-parallel (tile: its round of KV_THREADS requests)
                launches.append((grid, meta_kernel_model.run_meta_blocks2(P, min(tile["size"], 256))))

    monkeypatch.setattr(kernel_loader, "Launcher", FakeLauncher)
    from kvaddr.planner import StepPlanner

    # These tests model kvaddr_step_*'s metadata blocks: keep small batches with attention on
    # it (kvaddr_step1m_*'s model: tests/unit/test_planner_attention_one.py).
    monkeypatch.setattr(StepPlanner, "one_block_attention", False)
    return StepPlanner, launches, tile


def _reference(case, groups):
    return reference(case, attention=groups)


def _run(StepPlanner, launches, case, groups, planner=None, impl=None):
    if planner is None:
        planner = StepPlanner(
            max(len(case["seq_lens_decoder"]), 1),
            case["capacity"],
            case["block_sizes"],
            attention=groups,
            kv_indices_capacity=case["kv_indices_capacity"],
        )
    if impl is not None:
        planner._set_meta_impl(impl)
    tables = [_dev(t) for t in case["block_tables"]]
    out = planner.compute(_dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), tables)
    return planner, out, tables


def _check(planner, out, tables, launches, case, groups, label):
    ref = _reference(case, groups)
    want = ref.outputs.attention
    bsz = len(case["seq_lens_decoder"])
    grid, records = launches[-1]
    assert grid == planner.grid(bsz) and len(records) == planner._num_meta, label
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "seqused_k"):
        w, g = getattr(want, f), getattr(out.attention, f)
        assert (w is None) == (g is None), (label, f)
        if w is not None:
            g = np.asarray(g)
            assert g.dtype == w.dtype and g.shape == w.shape, (label, f, g.shape, w.shape)
            np.testing.assert_array_equal(g, w, err_msg=f"{label}: {f}")
    for f in ("max_seqlen_q", "max_seqlen_k"):
        w, g = getattr(want, f), getattr(out.attention, f)
        assert (w is None) == (g is None) and (w is None or (np.asarray(g).shape == () and int(g) == int(w))), f
    if "page_table" in groups:
        assert len(out.attention.page_table) == len(tables)
        for v, t in zip(out.attention.page_table, tables):
            assert v.shape == (bsz, t.shape[1]) and v.base is not None  # a view of the input
            np.testing.assert_array_equal(np.asarray(v), np.asarray(t)[:bsz])
    else:
        assert out.attention.page_table is None
    # the error records the metadata blocks write, in their slots, plus the token path's
    plain = step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    mask = plain.error_mask
    keys = [plain.error_key]
    slots = set()
    for slot, m, k in records:
        mask |= m
        keys.append(k)
        slots.add(slot)
        assert slot * 8 + 7 < planner._records.size // 2, "the planner allocates every metadata block's records"
    assert len(slots) == len(records)
    assert (mask, min(keys)) == (ref.error_mask, ref.error_key), label


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mixed_cases(max_bsz=40), st.sampled_from(GROUPS), st.sampled_from([1, 2, 3, 8, 4096]), st.sampled_from([0, 1, 3])
)
def test_planner_and_the_kernel_model_match_the_reference(fake_planner, case, groups, tile, impl):
    StepPlanner, launches, t = fake_planner
    t["size"] = tile
    planner, out, tables = _run(StepPlanner, launches, case, groups, impl=impl)
    _check(planner, out, tables, launches, case, groups, f"{groups}, tile {tile}, impl {impl}")


@pytest.mark.parametrize("lanes", [4, 8, 16, 32])
def test_one_round_blocks_match_the_reference(fake_planner, lanes):
    """kv_meta_block3's model (impl 3) at every lane count: many blocks of a few long rows
    (B = 1: rows longer than the pre-barrier columns, several requests per group), a block of
    exactly KV_THREADS requests (several warps' totals), one more (the block2 fallback),
    unallocated pages in long rows, capacity overflow."""
    StepPlanner, launches, t = fake_planner
    t["size"] = 4096  # 16 columns per lane before the barrier, as the kernel
    rng = np.random.default_rng(40 + lanes)
    cases = [
        make_case(rng, bsz=250, block_sizes=[1, 4], max_ctx=300, spare_capacity=2),
        make_case(rng, bsz=256, block_sizes=[16], spare_capacity=2),
        make_case(rng, bsz=257, block_sizes=[16], spare_capacity=2),
        make_case(rng, bsz=120, block_sizes=[1], max_ctx=600, bad="unallocated", spare_capacity=2),
    ]
    cases.append(dict(cases[0], kv_indices_capacity=cases[0]["kv_indices_capacity"] * 2 // 3))
    for i, case in enumerate(cases):
        planner = StepPlanner(
            len(case["seq_lens_decoder"]),
            case["capacity"],
            case["block_sizes"],
            attention=ALL_GROUPS,
            kv_indices_capacity=case["kv_indices_capacity"],
        )
        planner._set_meta_impl(3, lanes)
        planner, out, tables = _run(StepPlanner, launches, case, ALL_GROUPS, planner)
        _check(planner, out, tables, launches, case, ALL_GROUPS, f"lanes {lanes}, case {i}")


@pytest.mark.parametrize("impl", [0, 1, 3])
def test_many_metadata_blocks_and_small_after_big(fake_planner, impl):
    StepPlanner, launches, t = fake_planner
    rng = np.random.default_rng(3)
    big = make_case(rng, bsz=300, block_sizes=[1, 4], spare_capacity=5000, max_ctx=200)
    planner, out, tables = _run(StepPlanner, launches, big, ALL_GROUPS, impl=impl)
    assert planner._meta_per_cache * planner._meta_entries >= planner.kv_indices_capacity
    assert planner._meta_per_cache > 1 and planner._num_meta == 2 * planner._meta_per_cache
    _check(planner, out, tables, launches, big, ALL_GROUPS, "big")
    small = dict(make_case(rng, bsz=5, block_sizes=[1, 4]), kv_indices_capacity=big["kv_indices_capacity"])
    small["capacity"] = big["capacity"]
    t["size"] = 2
    planner, out, tables = _run(StepPlanner, launches, small, ALL_GROUPS, planner)
    _check(planner, out, tables, launches, small, ALL_GROUPS, "small after big")


@pytest.mark.parametrize("impl", [0, 1, 3])
def test_fewer_fatter_metadata_blocks(fake_planner, impl):
    """_set_meta_impl(entries=...): fewer blocks (grid, struct), the records they no longer write
    kept (sticky: an unread error stays until read), outputs still the reference's; E below the
    construction's or not a multiple of 256 refused."""
    StepPlanner, launches, _ = fake_planner
    rng = np.random.default_rng(9)
    # another bsz for the second step: the fake's scalar views (max_seqlen) are copies, cached per bsz
    case = make_case(rng, bsz=299, block_sizes=[1, 4], spare_capacity=5000, max_ctx=200)
    bad = make_case(rng, bsz=300, block_sizes=[1, 4], bad="unallocated", spare_capacity=5000, max_ctx=200)
    case = dict(case, kv_indices_capacity=bad["kv_indices_capacity"], capacity=bad["capacity"])
    planner, out, tables = _run(StepPlanner, launches, bad, ALL_GROUPS, impl=impl)
    _check(planner, out, tables, launches, bad, ALL_GROUPS, "bad, default E")
    E, blocks = planner._meta_entries, planner._num_meta
    # an "unread error" in every record slot: the ones the fewer blocks no longer write keep it
    planner._records[0::2] = 7
    planner._set_meta_impl(impl, entries=4 * E)
    assert planner._meta_entries == planner._params.meta_entries == 4 * E
    assert planner._num_meta == planner._params.num_meta == 2 * planner._meta_per_cache < blocks
    assert planner.grid(300) == planner._num_chunks + planner._num_meta
    first = (planner._num_chunks + planner._max_tiles + planner._num_meta) * 8
    assert (np.asarray(planner._records)[2 * first :: 2] == 7).all()
    planner._records[:] = np.tile(np.array([0, 2**64 - 1], np.uint64), planner._records.size // 2)  # read
    planner, out, tables = _run(StepPlanner, launches, case, ALL_GROUPS, planner)
    _check(planner, out, tables, launches, case, ALL_GROUPS, "4 E")
    with pytest.raises(ValueError, match="multiple of 256 and at least"):
        planner._set_meta_impl(impl, entries=E - 256)
    with pytest.raises(ValueError, match="multiple of 256 and at least"):
        planner._set_meta_impl(impl, entries=4 * E + 1)
    v = StepPlanner(8, 16, [4], attention="varlen")
    with pytest.raises(ValueError, match="only be set with attention 'flashinfer'"):
        v._set_meta_impl(1, entries=4096)


def test_struct_fields_and_attention_off(fake_planner):
    StepPlanner, launches, _ = fake_planner
    off = StepPlanner(8, 16, [4, 8])
    P = off._params
    assert (P.attention, P.num_meta, P.kv_indptr, P.kv_indices, P.cu_seqlens_k, P.max_seqlen) == (0, 0, 0, 0, 0, 0)
    assert off.grid(8) == 1 and off.grid(5000) == 1 + 2
    case = make_case(np.random.default_rng(0), bsz=8, block_sizes=[4, 8])
    case["capacity"] = 16
    out = off.compute(
        _dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), [_dev(t) for t in case["block_tables"]]
    )
    assert out.attention is None and launches[-1][1] == []
    on = StepPlanner(8, 16, [4, 8], attention="varlen,flashinfer", kv_indices_capacity=100)
    P = on._params
    assert P.attention == 3 and P.kv_indices_capacity == 100 and P.attn_stride == 9
    assert P.num_meta == on._num_meta == 2 * P.meta_per_cache and P.meta_entries >= 2048
    assert on.kv_indices.shape == (2, 100) and (np.asarray(on.kv_indices) == -1).all()
    assert on.grid(8) == 1 + on._num_meta
    v = StepPlanner(8, 16, [4], attention="varlen")
    assert v._params.attention == 2 and v._num_meta == 1 and v.kv_indices is None and v._params.kv_indices == 0
    pt = StepPlanner(8, 16, [4, 8, 16], attention="page_table")
    assert pt._num_meta == 3 and pt.kv_indptr is None and pt._params.attention == 4
    # the metadata implementation: request-parallel with 32 lanes by default, switchable
    assert (P.meta_impl, P.meta_lanes) == (StepPlanner._META_IMPL_DEFAULT, 32) == (1, 32)
    on._set_meta_impl(0)
    assert (P.meta_impl, P.meta_lanes) == (0, 32)
    on._set_meta_impl(2, 8)
    assert (P.meta_impl, P.meta_lanes, on._meta_impl, on._meta_lanes) == (2, 8, 2, 8)
    on._set_meta_impl(3, 16)
    assert (P.meta_impl, P.meta_lanes, on._meta_impl, on._meta_lanes) == (3, 16, 3, 16)
    # timing ablations (impl 3 only): bits above the implementation, cleared by the next call
    on._set_meta_impl(3, ablate=StepPlanner.META_NO_PREFIX | StepPlanner.META_NO_COPY)
    assert P.meta_impl == 3 | 256 | 512 and on._meta_impl == 3
    on._set_meta_impl(3)
    assert P.meta_impl == 3
    with pytest.raises(ValueError, match="meta impl must be 0, 1, 2 or 3"):
        on._set_meta_impl(4)
    with pytest.raises(ValueError, match="meta lanes must be 4, 8, 16 or 32"):
        on._set_meta_impl(1, 12)
    with pytest.raises(ValueError, match="meta ablate must be a combination of 256 and 512"):
        on._set_meta_impl(1, ablate=StepPlanner.META_NO_COPY)
    with pytest.raises(ValueError, match="meta ablate must be a combination of 256 and 512"):
        on._set_meta_impl(3, ablate=1024)
    assert P.meta_impl == 3  # a refused call changes nothing


def test_meta_ablation_bits_are_the_kernels():
    from kvaddr.planner import StepPlanner

    c = kernel_loader.constants()
    assert (c["KV_META_NO_PREFIX"], c["KV_META_NO_COPY"]) == (StepPlanner.META_NO_PREFIX, StepPlanner.META_NO_COPY)
    assert c["KV_META_IMPL_MASK"] == 255 and (StepPlanner.META_NO_PREFIX | StepPlanner.META_NO_COPY) & 255 == 0


# ---- the GPU baselines' EngineAttention: arguments against the kernels' C signatures, and a model ----


def _c_params(name):
    import re

    m = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", kernel_loader.source())
    assert m, name
    out = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        out.append("ptr" if "*" in p else ("i64" if p.startswith(("i64", "const i64")) else "i32"))
    return out


def _kind(a):
    if isinstance(a, (FakeDeviceArray, np.uint64)):
        return "ptr"
    if isinstance(a, np.int64):
        return "i64"
    if isinstance(a, np.int32):
        return "i32"
    raise AssertionError(f"argument {a!r} of type {type(a)} is no explicit kernel type")


def _ptr_view(a, count):
    ptr = a.data.ptr if isinstance(a, FakeDeviceArray) else int(a)
    return meta_kernel_model._view(ptr, count)


def _engine_model(name, grid, args):
    """NumPy models of the kvaddr_engine_* kernels (the whole grid at once)."""
    if name == "pages":
        L, n, B, out = args
        Lv = _ptr_view(L, int(n))
        _ptr_view(out, int(n))[:] = np.where(Lv > 0, -(-Lv.astype(np.int64) // int(B)), 0)
    elif name == "cumsum":
        x, n, out = args
        o = _ptr_view(out, int(n) + 1)
        o[0] = 0
        o[1:] = np.minimum(np.cumsum(np.maximum(_ptr_view(x, int(n)).astype(np.int64), 0)), 2**31 - 1)
    elif name == "copy_pages":
        indptr, table, stride, width, N, out = args
        bsz = grid
        ip = _ptr_view(indptr, bsz + 1)
        o = _ptr_view(out, int(N))
        t = _ptr_view(table, (bsz - 1) * int(stride) + int(width))
        for b in range(bsz):
            for j in range(int(ip[b + 1] - ip[b])):
                if ip[b] + j < int(N):
                    o[ip[b] + j] = t[b * int(stride) + j] if j < int(width) else -1
    elif name == "pad_pages":
        indptr, bsz, N, out = args
        end = int(_ptr_view(indptr, int(bsz) + 1)[int(bsz)])
        _ptr_view(out, int(N))[end:] = -1
    elif name == "last_page":
        L, n, B, out = args
        Lv = _ptr_view(L, int(n)).astype(np.int64)
        _ptr_view(out, int(n))[:] = np.where(Lv > 0, (Lv - 1) % int(B) + 1, 0)
    elif name == "max":
        x, n, diff, out = args
        xv = _ptr_view(x, int(n) + int(diff)).astype(np.int64)
        v = (np.diff(xv) if int(diff) else xv) if int(n) else np.zeros(1, np.int64)
        _ptr_view(out, 1)[0] = max(int(v.max()), 0)
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("groups", [ALL_GROUPS, ("flashinfer",), ("varlen",), ("page_table",)])
def test_engine_attention_arguments_match_the_kernels_and_the_reference(fake_planner, monkeypatch, groups):
    from kvaddr.outputs import StepOutputs
    from kvaddr.strategies import gpu
    from kvaddr.validation import describe

    calls = []

    def get_function(name, device_id=None):
        short = name.removeprefix("kvaddr_engine_")

        def fn(grid, block, args, shared_mem=0, stream=None):
            assert [_kind(a) for a in args] == _c_params(name), (name, args)
            calls.append(short)
            _engine_model(short, grid[0], args)

        return fn

    monkeypatch.setattr(kernel_loader, "get_function", get_function)
    rng = np.random.default_rng(4)
    for bsz in (0, 1, 37):
        case = make_case(rng, bsz=bsz, block_sizes=[16, 3], spare_capacity=3)
        ref = _reference(case, groups)
        eng = gpu.EngineAttention(
            groups, ref.outputs.attention.kv_indices.shape[1] if "flashinfer" in groups else None, 40, [16, 3], 0
        )
        if "flashinfer" in groups:
            eng.kv_indices[...] = 12345  # stale: every entry must be rewritten
        pos = StepOutputs(_dev(ref.outputs.cu_seqlens_q), None, None, None, _dev(ref.outputs.seq_lens_kv), None)
        tables = [_dev(t) for t in case["block_tables"]]
        infos = [describe("block_tables", t) for t in tables]
        calls.clear()
        a = eng.build(pos, tables, infos, 0)
        assert len(calls) <= eng.launches
        want = ref.outputs.attention
        for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "seqused_k"):
            w, g = getattr(want, f), getattr(a, f)
            assert (w is None) == (g is None), f
            if w is not None:
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"bsz {bsz}: {f}")
        for f in ("max_seqlen_q", "max_seqlen_k"):
            w, g = getattr(want, f), getattr(a, f)
            assert (w is None) == (g is None) and (w is None or int(g) == int(w)), f
        if "page_table" in groups:
            for v, t in zip(a.page_table, case["block_tables"]):
                np.testing.assert_array_equal(np.asarray(v), t[:bsz])
