"""StepPlanner's attention plumbing on the CPU: a fake CuPy whose device arrays are NumPy
buffers, and a launch that runs the token outputs from the reference and the metadata
blocks through the line-by-line model of the kernel the dispatch table chose (reading the
launch's KvStepParams and geometry): tests/support/meta_small_model.py (step_small_attention),
tests/support/meta_wide_model.py (step_wide_attention), tests/support/meta_kernel_model.py
(step_multiblock). Checks the planner's sizing (grid, metadata blocks, entries per block,
error-record slots), the struct fields, the output views (shapes, dtypes, aliases, page_table)
and, through the models, the outputs and error records against the NumPy reference. The
kernels themselves run in tests/gpu."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr import dispatch, kernel_loader
from kvaddr.reference import step_addressing
from tests.support import meta_kernel_model
from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.gpu import reference
from tests.support.meta_small_model import run_meta_small
from tests.support.meta_wide_model import run_meta_wide

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


def _family(kernel: str) -> str:
    return kernel.split("<", 1)[0]


def _metadata(kernel, P, grid, block, round_size):
    """The metadata blocks' error records of one launch, through the model of its kernel."""
    family = _family(kernel)
    if family == "step_small_attention":
        return run_meta_small(P, grid, block, P.num_caches)
    if family == "step_wide_attention":
        return run_meta_wide(P, grid, block, P.num_caches, dispatch.WIDE_ATTENTION_PER_THREAD)
    if family == "step_multiblock" and P.attention:
        # the model's records are per block; a block has KV_WARPS records
        return [(slot * dispatch.WARPS, m, k) for slot, m, k in meta_kernel_model.run_meta_blocks(P, round_size)]
    return []


@pytest.fixture
def fake_planner(monkeypatch):
    """(StepPlanner class, launches, model): each launch records (kernel, grid, threads, the
    metadata blocks' error records); ``model["round"]`` is the multi-block model's round size."""
    cp = types.ModuleType("cupy")
    cp.zeros = lambda shape, dtype=float: _dev(np.zeros(shape, dtype))
    cp.full = lambda shape, v, dtype=None: _dev(np.full(shape, v, dtype))
    cp.asarray = lambda a: _dev(np.asarray(a))
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {"multiProcessorCount": 4}
        ),
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
    # a kernel "function" is its name: the launcher below runs the model of that kernel
    monkeypatch.setattr(kernel_loader, "load_kernels", lambda names, device_id=None: {n: n for n in names})
    launches = []
    model = {"round": dispatch.THREADS}

    class FakeLauncher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args
            self.driver = None

        def __call__(self, grid, block, stream):
            P = self.args
            bsz = P.bsz
            dec = meta_kernel_model._view(P.seq_lens_decoder, bsz)
            q = meta_kernel_model._view(P.seq_lens_this_time, bsz)
            # the token blocks' per-request outputs, as the reference has them
            ref = step_addressing(dec.copy(), q.copy(), [np.zeros((max(bsz, 1), 1), np.int32)], [1], P.capacity)
            meta_kernel_model._view(P.cu_seqlens_q, bsz + 1)[:] = ref.outputs.cu_seqlens_q
            meta_kernel_model._view(P.seq_lens_kv, bsz)[:] = ref.outputs.seq_lens_kv
            launches.append((self.fn, grid, block, _metadata(self.fn, P, grid, block, model["round"])))

    monkeypatch.setattr(kernel_loader, "Launcher", FakeLauncher)
    from kvaddr.planner import StepPlanner

    return StepPlanner, launches, model


def _reference(case, groups):
    return reference(case, attention=groups)


def _planner(StepPlanner, case, groups, max_requests=None):
    return StepPlanner(
        max_requests or max(len(case["seq_lens_decoder"]), 1),
        case["capacity"],
        case["block_sizes"],
        attention=groups,
        kv_indices_capacity=case["kv_indices_capacity"],
    )


def hard_cases(rng, bsz: int, long_rows_sizes) -> list:
    """Cases of ``bsz`` requests that reach every branch of a metadata block: long rows (B = 1 in
    ``long_rows_sizes``: more columns than those loaded before the barrier), unallocated pages,
    narrow rows, negative lengths, kv_indices capacity overflow, 1-3 caches with different B."""
    cases = [
        make_case(rng, bsz=bsz, block_sizes=long_rows_sizes, max_ctx=700, spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[16, 5, 3], bad="unallocated", spare_capacity=0),
        make_case(rng, bsz=bsz, block_sizes=[2], bad="narrow-row", spare_capacity=3),
        make_case(rng, bsz=bsz, block_sizes=[64], bad="negative-length", spare_capacity=None),
    ]
    return [*cases, dict(cases[0], kv_indices_capacity=max(1, cases[0]["kv_indices_capacity"] * 2 // 3))]


def compute_and_check(planner, launches, case, groups, label, family=None):
    """Compute ``case``; check the launch (the dispatch table's, of kernel ``family`` if given),
    the attention outputs, the page table views and the error records (the metadata blocks'
    in their own slots, after the token blocks', merged with the token path's) against the
    reference. Returns the outputs."""
    tables = [_dev(t) for t in case["block_tables"]]
    out = planner.compute(_dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), tables)
    bsz = len(case["seq_lens_decoder"])
    kernel, grid, threads, records = launches[-1]
    assert (kernel, grid, threads) == planner.kernel_for(bsz), label
    assert family is None or _family(kernel) == family, (label, kernel)
    want = _reference(case, groups).outputs.attention
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
    _check_records(planner, case, groups, kernel, threads, records, label)
    return out


def _check_records(planner, case, groups, kernel, threads, records, label):
    ref = _reference(case, groups)
    plain = step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    mask, keys, seen = plain.error_mask, [plain.error_key], set()
    n_rec = planner._records.size // 2
    for rec, m, k in records:
        assert rec < n_rec, (label, "the planner allocates every metadata block's records")
        seen.add(rec)
        mask |= m
        keys.append(k)
    assert len(seen) == len(records), label
    # the token blocks' (and scan tiles') records come first
    if _family(kernel) == "step_multiblock":
        assert len(records) == planner._num_meta, label
        first = (planner._num_chunks + planner._max_tiles) * dispatch.WARPS
    else:
        first = -(-case["capacity"] // threads) * threads // 32
    assert min(seen, default=n_rec) >= first, label
    assert (mask, min(keys)) == (ref.error_mask, ref.error_key), label


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mixed_cases(max_bsz=40), st.sampled_from(GROUPS))
def test_planner_and_the_kernel_model_match_the_reference(fake_planner, case, groups):
    StepPlanner, launches, _ = fake_planner
    planner = _planner(StepPlanner, case, groups)
    compute_and_check(planner, launches, case, groups, f"{groups}", family="step_small_attention")


@pytest.mark.parametrize("groups", [ALL_GROUPS, ("varlen",), ("flashinfer", "page_table")])
def test_multi_block_metadata_model_matches_the_reference(fake_planner, groups):
    """Past 4096 requests (step_multiblock): several metadata blocks per cache, several rounds
    per block (a small round size too), unallocated pages, capacity overflow; then a small
    batch after the big one on the same planner (step_small_attention rewrites every output)."""
    StepPlanner, launches, model = fake_planner
    rng = np.random.default_rng(len(groups))
    big = make_case(rng, bsz=dispatch.TILE + 3, block_sizes=[1, 4], spare_capacity=5000, max_ctx=40)
    planner = _planner(StepPlanner, big, groups, max_requests=dispatch.TILE + 40)
    if "flashinfer" in groups:
        assert planner._meta_per_cache * planner._meta_entries >= planner.kv_indices_capacity
        assert planner._meta_per_cache > 1 and planner._num_meta == 2 * planner._meta_per_cache
    for round_size in (dispatch.THREADS, 100):
        model["round"] = round_size
        compute_and_check(planner, launches, big, groups, f"big, round {round_size}", family="step_multiblock")
    bad = make_case(rng, bsz=dispatch.TILE + 40, block_sizes=[1, 4], bad="unallocated", spare_capacity=None)
    bad = dict(bad, capacity=big["capacity"], kv_indices_capacity=big["kv_indices_capacity"])
    compute_and_check(planner, launches, bad, groups, "bad", family="step_multiblock")
    small = dict(make_case(rng, bsz=5, block_sizes=[1, 4]), kv_indices_capacity=big["kv_indices_capacity"])
    small["capacity"] = big["capacity"]
    compute_and_check(planner, launches, small, groups, "small after big", family="step_small_attention")


def test_struct_fields_and_attention_off(fake_planner):
    StepPlanner, launches, _ = fake_planner
    off = StepPlanner(8, 16, [4, 8])
    P = off._params
    assert (P.attention, P.num_meta, P.kv_indptr, P.kv_indices, P.cu_seqlens_k, P.max_seqlen) == (0, 0, 0, 0, 0, 0)
    assert off.grid(8) == dispatch.step_launch(off.config, 8).blocks
    case = make_case(np.random.default_rng(0), bsz=8, block_sizes=[4, 8])
    case["capacity"] = 16
    out = off.compute(
        _dev(case["seq_lens_decoder"]), _dev(case["seq_lens_this_time"]), [_dev(t) for t in case["block_tables"]]
    )
    assert out.attention is None and launches[-1][3] == []
    on = StepPlanner(8, 16, [4, 8], attention="varlen,flashinfer", kv_indices_capacity=100)
    P = on._params
    assert P.attention == 3 and P.kv_indices_capacity == 100 and P.attn_stride == 9
    assert P.num_meta == on._num_meta == 2 * P.meta_per_cache and P.meta_entries >= 2048
    assert (P.meta_entries, P.meta_per_cache, P.num_meta) == on.config.meta
    assert on.kv_indices.shape == (2, 100) and (np.asarray(on.kv_indices) == -1).all()
    assert on.grid(8) == dispatch.step_launch(on.config, 8).blocks
    v = StepPlanner(8, 16, [4], attention="varlen")
    assert v._params.attention == 2 and v._num_meta == 1 and v.kv_indices is None and v._params.kv_indices == 0
    pt = StepPlanner(8, 16, [4, 8, 16], attention="page_table")
    assert pt._num_meta == 3 and pt.kv_indptr is None and pt._params.attention == 4


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
