"""VllmStepPlanner.bind(..., idx_mapping=, query_start_loc=): the batch buffers bound whole, a step
launched with two ints (CPU, fake CuPy); num_blocks in pinned host memory (UVA); torch batch tensors
read by their attributes; torch stream objects resolved by their handle.

Every launch's parameter block is read back (tests/support/vllm_fake_cupy.py) and compared with
compute()'s on the slices ``idx_mapping[:num_reqs]`` / ``query_start_loc[:num_reqs + 1]`` of the same
buffers; every bad buffer is refused at bind naming the argument, every bad int at launch naming it
(nothing launched); ``debug=True`` and ``check_bound()`` name an array changed in place; with the C++
kernel emulator the bound launches agree with the NumPy reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import dispatch
from kvaddr.engines import vllm as vllm_module
from kvaddr.engines.vllm_bound import BoundVllmBatch, BoundVllmStep, torch_batch_check
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_emulator
from tests.support.vllm_cases import assert_same, new_batch, planner_kwargs, random_case, worked_example
from tests.support.vllm_fake_cupy import FakeArray, install

STATE = ("num_computed_tokens", "block_tables", "num_blocks")
M = 4  # the worked example's max_num_reqs


@pytest.fixture
def fake(monkeypatch):
    ns = install(monkeypatch)
    described = []
    real = vllm_module.describe

    def describe(name, x):
        if not name.startswith("out."):
            described.append(name)
        return real(name, x)

    monkeypatch.setattr(vllm_module, "describe", describe)
    ns.described = described
    return ns


def _planner(G=2, **kw):
    return vllm_module.VllmStepPlanner(M, 600, [4] * G, [4] * G, **kw)


def _state(G=2):
    _, x = worked_example()
    return {
        "num_computed_tokens": FakeArray(x["num_computed_tokens"].copy()),
        "block_tables": [FakeArray(x["block_tables"][0].copy()) for _ in range(G)],
        "num_blocks": [FakeArray(x["num_blocks"][0].copy()) for _ in range(G)],
    }


def _buffers(rows=M, idx_dtype=np.int32):
    idx = FakeArray(np.array([2, 0, 3, -1, 1, 1][:rows], idx_dtype))
    qsl = FakeArray(np.arange(rows + 1, dtype=np.int32))
    return idx, qsl


def _same_launch(a, b):
    assert (a["fn"], a["grid"], a["block"], a["stream"]) == (b["fn"], b["grid"], b["block"], b["stream"])
    assert a["params"] == b["params"]


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_launch_with_two_ints_equals_compute_on_the_slices(fake, idx_dtype):
    st = _state()
    idx, qsl = _buffers(idx_dtype=idx_dtype)
    pl = _planner()
    bound = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl)
    assert isinstance(bound, BoundVllmBatch) and bound.max_num_reqs == M
    for n, padded in ((2, 2), (2, 4), (0, 0), (0, None), (4, None), (3, 4), (1, 1), (1, 1)):
        pl.compute(idx[:n], qsl[: n + 1], *(st[k] for k in STATE), padded, stream=9)
        want = fake.launches[-1]
        out = bound.launch(n, padded, 9)
        _same_launch(fake.launches[-1], want)
        assert out is pl.outputs
    assert bound.params is not pl._params


def test_nothing_is_described_per_launch(fake):
    st = _state()
    idx, qsl = _buffers()
    bound = _planner().bind(**st, idx_mapping=idx, query_start_loc=qsl)
    assert fake.described[-2:] == ["idx_mapping", "query_start_loc"]  # checked once, at bind
    fake.described.clear()
    for n in (1, 2, 3, 2, 4):
        bound.launch(n, 4, stream=9)
    assert fake.described == [] and len(fake.launches) == 5


def test_the_rows_are_the_shortest_buffer(fake):
    st = _state()
    idx, qsl = _buffers(rows=3)
    pl = _planner()
    assert pl.bind(**st, idx_mapping=idx, query_start_loc=qsl).max_num_reqs == 3
    idx2 = FakeArray(np.zeros(4, np.int32))
    qsl2 = FakeArray(np.zeros(3, np.int32))  # two requests' worth
    bound = pl.bind(**st, idx_mapping=idx2, query_start_loc=qsl2)
    assert bound.max_num_reqs == 2
    with pytest.raises(ValueError, match=r"num_reqs must be an int in \[0, 2\], got 3"):
        bound.launch(3, 4, stream=9)


#: (which buffer, change, error, message): each a bad batch buffer, refused at bind naming it.
BAD_BUFFERS = [
    ("idx_mapping", lambda a: a.astype(np.float32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.astype(np.uint32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.reshape(2, 2), ValueError, r"idx_mapping must be .* got shape \(2, 2\)"),
    ("idx_mapping", lambda a: np.repeat(a, 2)[::2], ValueError, "idx_mapping must be contiguous"),
    ("query_start_loc", lambda a: a.astype(np.int64), TypeError, "query_start_loc must be int32"),
    ("query_start_loc", lambda a: a[:0], ValueError, r"query_start_loc must be .* got shape \(0,\)"),
    ("query_start_loc", lambda a: np.repeat(a, 2)[::2], ValueError, "query_start_loc must be contiguous"),
]


@pytest.mark.parametrize("which, change, exc, message", BAD_BUFFERS)
def test_bad_buffers_are_refused_at_bind(fake, which, change, exc, message):
    st = _state()
    idx, qsl = _buffers()
    x = idx if which == "idx_mapping" else qsl
    x.a = change(x.a)
    with pytest.raises(exc, match=message):
        _planner().bind(**st, idx_mapping=idx, query_start_loc=qsl)
    assert fake.launches == []


def test_buffer_device_and_kind_and_pairing(fake):
    st = _state()
    idx, qsl = _buffers()
    pl = _planner()
    qsl.dev = 1
    with pytest.raises(ValueError, match="query_start_loc must be on CUDA device 0, got an array in device 1"):
        pl.bind(**st, idx_mapping=idx, query_start_loc=qsl)
    qsl.dev = 0
    with pytest.raises(TypeError, match="idx_mapping must be a CUDA array"):
        pl.bind(**st, idx_mapping=np.zeros(4, np.int32), query_start_loc=qsl)
    with pytest.raises(TypeError, match="query_start_loc is missing"):
        pl.bind(**st, idx_mapping=idx)
    with pytest.raises(TypeError, match="idx_mapping is missing"):
        pl.bind(**st, query_start_loc=qsl)
    bad = _state()
    bad["num_computed_tokens"].a = bad["num_computed_tokens"].a.astype(np.int64)
    with pytest.raises(TypeError, match="num_computed_tokens must be int32"):  # the state: compute()'s checks
        pl.bind(**bad, idx_mapping=idx, query_start_loc=qsl)
    assert type(pl.bind(**st)) is BoundVllmStep  # the form without buffers: unchanged


def test_the_two_ints_are_checked(fake):
    st = _state()
    idx, qsl = _buffers()
    bound = _planner().bind(**st, idx_mapping=idx, query_start_loc=qsl)
    bound.launch(2, 3, stream=9)
    n = len(fake.launches)
    for args, exc, message in (
        ((5,), ValueError, r"num_reqs must be an int in \[0, 4\], got 5"),
        ((-1,), ValueError, r"num_reqs must be an int in \[0, 4\], got -1"),
        ((2.0,), TypeError, "num_reqs must be an int >= 0, got 2.0"),
        ((True,), TypeError, "num_reqs must be an int >= 0, got True"),
        (("2",), TypeError, "num_reqs must be an int >= 0, got '2'"),
        ((None,), TypeError, "num_reqs must be an int >= 0, got None"),
        ((3, 2), ValueError, r"num_reqs_padded must be an int in \[3, 4\], got 2"),
        ((3, 5), ValueError, r"num_reqs_padded must be an int in \[3, 4\], got 5"),
        ((2, 3.0), TypeError, "num_reqs_padded must be an int >= 2, got 3.0"),
        ((2, True), TypeError, "num_reqs_padded must be an int >= 2, got True"),
    ):
        with pytest.raises(exc, match=message):
            bound.launch(*args, stream=9)
    assert len(fake.launches) == n
    # NumPy ints are ints: taken as their value
    bound.launch(np.int64(3), np.int32(4), stream=9)
    assert fake.launches[-1]["params"]["num_reqs"] == 3 and fake.launches[-1]["params"]["num_reqs_padded"] == 4


def test_grid_and_lanes_follow_num_reqs(fake):
    pl = vllm_module.VllmStepPlanner(600, 600, [4, 4], [4, 4])
    st = {
        "num_computed_tokens": FakeArray(np.zeros(600, np.int32)),
        "block_tables": [FakeArray(np.zeros((600, 4), np.int32)) for _ in range(2)],
        "num_blocks": FakeArray(np.zeros((2, 600), np.int32)),
    }
    idx, qsl = FakeArray(np.zeros(600, np.int32)), FakeArray(np.zeros(601, np.int32))
    bound = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl)
    for n, padded in ((2, 2), (2, 600), (300, 300), (500, 520), (2, 2), (590, 600), (5, 5)):
        pl.compute(idx[:n], qsl[: n + 1], *(st[k] for k in STATE), padded, stream=9)
        want = fake.launches[-1]
        bound.launch(n, padded, stream=9)
        _same_launch(fake.launches[-1], want)


def test_streams(fake):
    st = _state()
    idx, qsl = _buffers()
    pl = _planner()

    class Stream:  # a torch stream: a new object per torch.cuda.current_stream() call
        def __init__(self, h):
            self.cuda_stream = h

    Stream.__module__ = "torch.cuda.streams"
    bound = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl, stream=55)
    for s, want in ((None, 55), (12, 12), (Stream(0x77), 0x77), (Stream(0x78), 0x78), (Stream(0x77), 0x77)):
        bound.launch(1, 2, s)
        assert fake.launches[-1]["stream"] == want
    assert bound._resolve._torch_cls is Stream  # the class is remembered, each object read once
    plain = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl)
    plain.launch(1)
    assert fake.launches[-1]["stream"] == 1234  # CuPy's current stream
    with pytest.raises(TypeError, match="stream must be"):
        plain.launch(1, 1, "s")


def test_debug_and_check_bound_name_a_changed_array(fake):
    st = _state()
    idx, qsl = _buffers()
    pl = _planner()
    quiet = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl)
    loud = pl.bind(**st, idx_mapping=idx, query_start_loc=qsl, debug=True)
    assert loud.debug and not quiet.debug
    loud.launch(2, 2, stream=9)
    quiet.check_bound()  # nothing changed
    # an in-place change (a new pointer, as torch's set_ / resize_): the quiet binding launches as
    # bound, debug refuses naming the array, check_bound too
    for which, name in (
        (lambda: st["block_tables"][1], r"block_tables\[1\]"),
        (lambda: st["num_blocks"][0], r"num_blocks\[0\]"),
        (lambda: st["num_computed_tokens"], "num_computed_tokens"),
        (lambda: qsl, "query_start_loc"),
        (lambda: idx, "idx_mapping"),
    ):
        x = which()
        good = x.a
        x.a = x.a.copy()
        n = len(fake.launches)
        quiet.launch(2, 2, stream=9)
        assert len(fake.launches) == n + 1
        with pytest.raises(ValueError, match=f"{name} changed since bind .*: bind again"):
            loud.launch(2, 2, stream=9)
        with pytest.raises(ValueError, match=f"{name} changed since bind"):
            quiet.check_bound()
        assert len(fake.launches) == n + 1
        x.a = good
        loud.launch(2, 2, stream=9)
    # an item of a bound list replaced
    keep = st["block_tables"][0]
    st["block_tables"][0] = FakeArray(keep.a)
    with pytest.raises(ValueError, match=r"block_tables \(the list's items\) changed since bind"):
        loud.launch(2, 2, stream=9)
    st["block_tables"][0] = keep
    loud.launch(2, 2, stream=9)


def test_the_binding_form_without_buffers_takes_debug_too(fake):
    st = _state()
    idx, qsl = _buffers()
    bound = _planner().bind(**st, debug=True)
    bound.launch(idx[:2], qsl[:3], 2, stream=9)
    st["num_computed_tokens"].a = st["num_computed_tokens"].a.copy()
    with pytest.raises(ValueError, match="num_computed_tokens changed since bind"):
        bound.launch(idx[:2], qsl[:3], 2, stream=9)


# -- num_blocks in pinned host memory (UVA) ------------------------------------------------------


def test_num_blocks_in_pinned_host_memory(fake):
    """A NumPy array in pinned memory (as cupyx.empty_pinned makes): its device pointer (here its
    address + an offset, to tell the two apart) is what the launch's copy reads (num_blocks_src), the
    step reading the planner's device copy; pageable memory is refused naming the argument; a
    stacked [G, rows] array too."""
    st = _state()
    idx, qsl = _buffers()
    pl = _planner()
    nbs = [fake.pin(a.a.copy(), device_offset=0x1000) for a in st["num_blocks"]]
    bound = pl.bind(st["num_computed_tokens"], st["block_tables"], nbs, idx_mapping=idx, query_start_loc=qsl)
    bound.launch(2, 2, stream=9)
    _assert_staged(fake, pl, [a.ctypes.data + 0x1000 for a in nbs])
    pl.compute(idx[:2], qsl[:3], st["num_computed_tokens"], st["block_tables"], nbs, 2, stream=9)
    _assert_staged(fake, pl, [a.ctypes.data + 0x1000 for a in nbs])
    stacked = fake.pin(np.stack([a.a for a in st["num_blocks"]]), device_offset=0x2000)
    pl.bind(st["num_computed_tokens"], st["block_tables"], stacked).launch(idx[:2], qsl[:3], stream=9)
    _assert_staged(fake, pl, [stacked.ctypes.data + 0x2000 + 4 * g * M for g in (0, 1)])
    # num_blocks in device memory again: one launch, the arrays read where they are
    pl.compute(idx[:2], qsl[:3], st["num_computed_tokens"], st["block_tables"], st["num_blocks"], 2, stream=9)
    last = fake.launches[-1]
    assert last["name"] == dispatch.vllm_kernel(False) and not fake.launches[-2]["name"].startswith("vllm_stage")
    assert last["params"]["num_blocks"][:2] == [a.a.ctypes.data for a in st["num_blocks"]] and not pl.staged
    pageable = [a.a.copy() for a in st["num_blocks"]]
    with pytest.raises(TypeError, match=r"num_blocks\[0\] must be a CUDA array or pinned host memory"):
        pl.bind(st["num_computed_tokens"], st["block_tables"], pageable)
    with pytest.raises(TypeError, match=r"num_blocks\[1\] must be a CUDA array or pinned host memory"):
        pl.bind(st["num_computed_tokens"], st["block_tables"], [nbs[0], pageable[1]])
    with pytest.raises(ValueError, match=r"num_blocks\[0\] must be .* got shape \(3,\)"):  # the other checks hold
        pl.bind(st["num_computed_tokens"], st["block_tables"], [fake.pin(nbs[0][:3].copy()), nbs[1]])
    # only num_blocks may be host memory
    with pytest.raises(TypeError, match="num_computed_tokens must be a CUDA array"):
        pl.bind(fake.pin(np.zeros(M, np.int32)), st["block_tables"], nbs)
    with pytest.raises(TypeError, match=r"block_tables\[1\] must be a CUDA array"):
        pl.bind(st["num_computed_tokens"], [st["block_tables"][0], fake.pin(np.zeros((M, 4), np.int32))], nbs)


class HostView:
    """A ``__cuda_array_interface__`` view of host memory (as a library's view of a pinned buffer)."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {
            "data": (a.ctypes.data, False),
            "shape": a.shape,
            "typestr": a.dtype.str,
            "strides": None,
            "version": 3,
        }


def test_num_blocks_as_an_array_interface_view_of_pinned_memory(fake):
    st = _state()
    idx, qsl = _buffers()
    pl = _planner()
    stacked = fake.pin(np.stack([a.a for a in st["num_blocks"]]), device_offset=0x3000)
    bound = pl.bind(
        st["num_computed_tokens"], st["block_tables"], HostView(stacked), idx_mapping=idx, query_start_loc=qsl
    )
    bound.launch(2, 2, stream=9)
    _assert_staged(fake, pl, [stacked.ctypes.data + 0x3000 + 4 * g * M for g in (0, 1)])
    with pytest.raises(TypeError, match="num_blocks must be a CUDA array or pinned host memory"):
        pl.bind(st["num_computed_tokens"], st["block_tables"], HostView(stacked.copy()))  # pageable
    # one group: a [1, rows] view (no .shape attribute, only the interface's) is the stacked layout
    one = _planner(G=1)
    st1 = _state(G=1)
    stacked1 = fake.pin(np.stack([st1["num_blocks"][0].a]))
    one.bind(st1["num_computed_tokens"], st1["block_tables"], HostView(stacked1)).launch(idx[:2], qsl[:3], stream=9)
    _assert_staged(fake, one, [stacked1.ctypes.data])


def _assert_staged(fake, planner, sources):
    """The last two launches are the staged pair: the copy of num_blocks (pinned host memory, at the
    device pointers ``sources``) into the planner's device copy, then the step reading that copy."""
    copy, G = planner._num_blocks_copy, len(sources)
    rows = [copy.data.ptr + 4 * g * copy.shape[1] for g in range(G)]
    stage, step = dispatch.vllm_staged_kernels(False, num_groups=G)
    first, last = fake.launches[-2], fake.launches[-1]
    assert (first["name"], last["name"]) == (stage, step)
    assert first["grid"][0] == -(-planner.config.max_num_reqs // 256) and first["block"] == 256
    for launch in (first, last):  # one parameter block for both
        assert launch["params"]["num_blocks_src"][:G] == sources and launch["params"]["num_blocks"][:G] == rows


def test_a_pageable_torch_tensor_is_refused_naming_num_blocks(fake):
    torch = pytest.importorskip("torch")
    st = _state()
    t = torch.zeros(M, dtype=torch.int32)  # CPU, not pinned
    with pytest.raises(TypeError, match=r"num_blocks\[1\] must be a CUDA array or pinned host memory .* pageable"):
        _planner().bind(st["num_computed_tokens"], st["block_tables"], [st["num_blocks"][0], t])


def test_bound_batch_and_uva_num_blocks_match_the_emulated_kernel(monkeypatch):
    """Steps over persistent request state and persistent batch buffers (new contents in place every
    step, a new num_reqs and num_reqs_padded), num_blocks in (fake) pinned host memory: every launch
    agrees with the reference, outputs and error record."""
    ns = install(monkeypatch, on_launch=vllm_emulator.run)
    if vllm_emulator.CXX is None:
        pytest.skip("no C++ compiler: the vLLM kernel emulator cannot be built")
    rng = np.random.default_rng(13)
    cfg, x = random_case(rng, max_num_reqs=40, num_reqs=30, block_sizes=(4, 16), max_query=3)
    pl = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
    nct = FakeArray(x["num_computed_tokens"].copy())
    tables = [FakeArray(a.copy()) for a in x["block_tables"]]
    nbs = ns.pin(np.stack(x["num_blocks"]))  # vLLM's layout: one [G, rows] int32 array, pinned
    idx_buf = FakeArray(np.zeros(cfg.max_num_reqs, np.int32))
    qsl_buf = FakeArray(np.zeros(cfg.max_num_reqs + 1, np.int32))
    bound = pl.bind(nct, tables, nbs, idx_mapping=idx_buf, query_start_loc=qsl_buf)
    batch = x
    for step in range(6):
        n = len(batch["idx_mapping"])
        idx_buf.a[:n] = batch["idx_mapping"]
        qsl_buf.a[: n + 1] = batch["query_start_loc"]
        idx_buf.a[n:] = 7  # stale entries past the batch: never read
        qsl_buf.a[n + 1 :] = 10**6
        padded = min(n + step, cfg.max_num_reqs)
        out = bound.launch(n, padded)
        host = dict(num_computed_tokens=nct.a, block_tables=[t.a for t in tables], num_blocks=list(nbs))
        want = vllm_step_reference(cfg, batch["idx_mapping"], batch["query_start_loc"], **host, num_reqs_padded=padded)
        got = {
            k: (tuple(t.a.copy() for t in v) if isinstance(v, tuple) else v.a.copy()) for k, v in out.as_dict().items()
        }
        assert_same(got, want.outputs.as_dict(), f"step {step}")
        assert pl.errors() == (want.error_mask, want.error_key), f"step {step}"
        nct.a[:] //= 2
        nbs[1, rng.integers(0, 40)] = 10**6 if step % 2 else nbs[1, 0]  # a bad count every other step
        batch = new_batch(rng, cfg, dict(host, idx_mapping=batch["idx_mapping"]), int(rng.integers(0, 31)), max_query=2)


# -- torch batch tensors, read by their attributes ----------------------------------------------


def test_torch_batch_check_on_slices_views_and_other_buffers():
    """torch_batch_check on real (CPU) torch tensors posing as device -1's (``require_cuda=False``):
    a fresh slice of a buffer gives its own pointer and length; a slice of another buffer gives that
    buffer's pointer (nothing is taken from a buffer seen before); a strided view, a 2-D view, a
    reinterpreted dtype where int32 is needed, a length mismatch or another device are declined
    (None: the launch then runs check_batch, which raises its message)."""
    torch = pytest.importorskip("torch")
    check = torch_batch_check(8, -1, torch.int32, torch.int64, require_cuda=False)
    ibuf = torch.arange(16, dtype=torch.int32)
    qbuf = torch.arange(17, dtype=torch.int32)
    other_i = torch.arange(16, dtype=torch.int32)
    other_q = torch.arange(17, dtype=torch.int32)
    got = check(ibuf[:0], qbuf[:1])  # (torch gives an empty tensor pointer 0)
    assert got[1:] == (0, False, qbuf.data_ptr()) and got[0] in (0, ibuf.data_ptr())
    for n in (1, 5, 8):
        assert check(ibuf[:n], qbuf[: n + 1]) == (ibuf.data_ptr(), n, False, qbuf.data_ptr())
        assert check(other_i[:n], other_q[: n + 1]) == (other_i.data_ptr(), n, False, other_q.data_ptr())
        assert check(ibuf[3 : 3 + n], qbuf[2 : 3 + n]) == (ibuf.data_ptr() + 12, n, False, qbuf.data_ptr() + 8)
    i64 = torch.arange(8, dtype=torch.int64)
    assert check(i64[:4], qbuf[:5]) == (i64.data_ptr(), 4, True, qbuf.data_ptr())
    assert check(ibuf[:8].view(torch.int64), qbuf[:5]) == (ibuf.data_ptr(), 4, True, qbuf.data_ptr())
    declined = [
        (ibuf[:8:2], qbuf[:5]),  # strided idx_mapping
        (ibuf[:4], qbuf[:10:2]),  # strided query_start_loc
        (ibuf[:8].view(2, 4), qbuf[:3]),  # 2-D
        (ibuf[:4], qbuf[:10].view(torch.int64)),  # int64 query_start_loc (a reinterpreted int32 buffer)
        (ibuf[:4].float(), qbuf[:5]),
        (ibuf[:4], qbuf[:4]),  # length mismatch
        (ibuf[:4], qbuf[:6]),
        (ibuf[:9], qbuf[:10]),  # more than max_num_reqs
        (ibuf[:4].to(torch.int16), qbuf[:5]),
    ]
    for i, q in declined:
        assert check(i, q) is None, (i.shape, i.stride(), i.dtype, q.shape, q.stride(), q.dtype)
    assert torch_batch_check(8, 0, torch.int32, torch.int64)(ibuf[:4], qbuf[:5]) is None  # a CPU tensor: not CUDA
    assert check(ibuf[2:3], qbuf[:2]) == (ibuf.data_ptr() + 8, 1, False, qbuf.data_ptr())
    # a one-entry view with a stride: contiguous (one element), as check_batch has it
    assert check(ibuf[0:1:5], qbuf[0:2]) == (ibuf.data_ptr(), 1, False, qbuf.data_ptr())


def test_compute_checks_fresh_batch_objects_inline_over_a_repeated_state(fake):
    """compute() with new batch objects every call (vLLM's slices) over the same request state:
    from the third call on nothing is described, every launch carries the new objects' pointers and
    equals a fresh planner's, and a bad batch still raises compute()'s message."""
    st = _state()
    idx_buf, qsl_buf = _buffers()
    pl = _planner()
    checked = _planner()
    checked.memoize_checks = False  # every call checked in full
    inputs = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_table", "num_blocks", "table_stride")
    fields = (*inputs, "num_reqs", "num_reqs_padded", "idx_is_64", "pair_lanes")
    for step in range(6):
        n = 1 + step % 4
        i, q = idx_buf[:n], qsl_buf[: n + 1]
        pl.compute(i, q, *(st[k] for k in STATE), 4, stream=9)
        got = fake.launches[-1]
        checked.compute(i, q, *(st[k] for k in STATE), 4, stream=9)
        want = fake.launches[-1]
        assert [got["params"][f] for f in fields] == [want["params"][f] for f in fields]
        assert (got["grid"], got["stream"]) == (want["grid"], want["stream"])
        assert got["params"]["positions"] == pl.outputs.positions.data.ptr  # the planner's outputs
    assert fake.described.count("idx_mapping") == 2 + 6  # two checked calls, then the full planner's six
    bad = FakeArray(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="idx_mapping must be int32 or int64"):
        pl.compute(bad, qsl_buf[:3], *(st[k] for k in STATE), 4, stream=9)
    # a new state object: the full checks again (the binding is of the old state)
    st["num_computed_tokens"] = FakeArray(st["num_computed_tokens"].a.copy())
    n = len(fake.described)
    pl.compute(idx_buf[:2], qsl_buf[:3], *(st[k] for k in STATE), 4, stream=9)
    assert fake.described[n:] == ["idx_mapping", "query_start_loc", "num_computed_tokens"]
    assert fake.launches[-1]["params"]["num_computed_tokens"] == st["num_computed_tokens"].data.ptr
