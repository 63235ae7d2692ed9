"""BoundStep on the CPU: binding checks, the launch's arguments, bsz checks, misuse detection.

Device arrays are stand-ins offering ``__cuda_array_interface__``; CuPy's pointer query is
faked (every nonzero pointer is on device 0 unless a test says otherwise) and the launch is
a recorder, so nothing here needs a GPU. tests/gpu/test_bound_step_gpu.py runs the real one.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import types
import weakref

import numpy as np
import pytest

from kvaddr import dispatch, kernel_loader
from kvaddr.bound_step import BoundStep

TILE = kernel_loader.constants()["KV_TILE"]
#: C of the bindings below: three token blocks of the multi-block kernel.
CAPACITY = 3 * dispatch.TOKENS


class DevArray:
    """A device array stand-in: ``__cuda_array_interface__`` over a fake pointer."""

    _next = 0x7000_0000

    def __init__(self, shape, dtype=np.int32, strides=None, ptr=None, device=0):
        if ptr is None:
            ptr = DevArray._next
            DevArray._next += 0x10_0000
        self.device = device
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": np.dtype(dtype).str,
            "data": (ptr, False),
            "strides": None if strides is None else tuple(s * np.dtype(dtype).itemsize for s in strides),
            "version": 3,
        }

    @property
    def ptr(self):
        return self.__cuda_array_interface__["data"][0]


@pytest.fixture
def fake_runtime(monkeypatch):
    """A ``cupy`` module with just ``runtime.pointerGetAttributes`` (pointers map to devices)."""
    devices = {}

    def attrs(ptr):
        return types.SimpleNamespace(type=2, device=devices.get(ptr, 0))

    runtime = types.SimpleNamespace(pointerGetAttributes=attrs, memoryTypeDevice=2, memoryTypeManaged=3)
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    return devices


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


_DEFAULT = object()


class DispatchPlan:
    """The planner's ``_bound_plan`` without a planner: the dispatch table's launch for bsz, a fake
    function pointer per kernel; records every bsz it is asked for."""

    def __init__(self, max_requests, num_caches=1, capacity=CAPACITY):
        self.config = dispatch.StepConfig(num_caches, True, capacity, max_requests)
        self.fptrs = {name: 0xF00 + i for i, name in enumerate(dispatch.step_kernels(self.config))}
        self.asked = []

    def launch(self, bsz):
        return dispatch.step_launch(self.config, bsz)

    def __call__(self, bsz):
        self.asked.append(bsz)
        launch = self.launch(bsz)
        return self.fptrs[launch.kernel], launch.blocks, launch.threads


def bind(rows=5, *, max_requests=64, num_caches=1, tables=_DEFAULT, stream=7, launch=None, plan=None, **kw):
    dec = kw.pop("dec", DevArray((rows,)))
    q = kw.pop("q", DevArray((rows,)))
    if tables is _DEFAULT:
        tables = DevArray((rows, 8)) if num_caches else None
    params = kernel_loader.StepParams()
    return BoundStep(
        params=params,
        plan=plan if plan is not None else DispatchPlan(max_requests, num_caches),
        device=0,
        max_requests=max_requests,
        num_caches=num_caches,
        seq_lens_decoder=dec,
        seq_lens_this_time=q,
        block_tables=tables,
        stream=stream,
        launch_kernel=launch if launch is not None else Recorder(),
        **kw,
    )


def test_bind_writes_the_pointers_strides_and_widths(fake_runtime):
    dec, q = DevArray((6,)), DevArray((6,))
    t0, t1 = DevArray((10, 8), strides=(16, 1)), DevArray((6, 3))
    b = bind(6, dec=dec, q=q, num_caches=3, tables=[t0, t1, t0])
    P = b.params
    assert (P.seq_lens_decoder, P.seq_lens_this_time, P.bsz) == (dec.ptr, q.ptr, 6)
    assert list(P.block_tables)[:3] == [t0.ptr, t1.ptr, t0.ptr]
    assert list(P.table_stride)[:3] == [16, 3, 16]
    assert list(P.max_blocks)[:3] == [8, 3, 8]
    assert b.max_bsz == 6
    assert set(b.bound) == {
        "seq_lens_decoder",
        "seq_lens_this_time",
        "block_tables[0]",
        "block_tables[1]",
        "block_tables[2]",
    }


@pytest.mark.parametrize("bsz", [None, 0, 1, 5])
def test_launch_calls_the_driver_with_the_prebuilt_parameter_array(fake_runtime, bsz):
    rec, plan = Recorder(), DispatchPlan(64)
    b = bind(5, launch=rec, plan=plan)
    assert b.launch(bsz) is None  # no outputs callable given
    ((fptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra),) = rec.calls
    want = plan(5 if bsz is None else bsz)
    assert (fptr, gx, gy, gz, bx, by, bz, smem, stream, extra) == (want[0], want[1], 1, 1, want[2], 1, 1, 0, 7, 0)
    # kernelParams: one pointer, to this binding's struct, whose bsz is this launch's
    assert ctypes.c_void_p.from_address(params).value == ctypes.addressof(b.params)
    assert b.params.bsz == (5 if bsz is None else bsz)


@pytest.mark.parametrize("bsz", [None, 0, 3, 5])
def test_launch_args_are_what_launch_hands_the_driver(fake_runtime, bsz):
    rec = Recorder()
    b = bind(5, launch=rec)
    fn, fptr, blocks, grid_y, threads, params = b.launch_args(bsz)
    assert b.params.bsz == (5 if bsz is None else bsz)
    fn(fptr, blocks, grid_y, 1, threads, 1, 1, 0, 7, params, 0)
    b.launch(bsz)
    assert fn is rec and rec.calls[0] == rec.calls[1]
    with pytest.raises(ValueError, match=r"bsz must be an int in \[0, 5\]"):
        b.launch_args(6)


def test_bsz_may_change_per_call_and_the_launch_follows_the_plan(fake_runtime):
    """Every bsz launches the plan's (kernel, blocks, threads): the dispatch table's choice,
    whichever kernel that is (small, across blocks, multi-block)."""
    rows = 3 * TILE + 1
    rec, plan = Recorder(), DispatchPlan(rows)
    b = bind(rows, max_requests=rows, launch=rec, plan=plan)
    kernels = set()
    for bsz in (
        1,
        dispatch.SMALL_MAX_REQUESTS,
        dispatch.SMALL_MAX_REQUESTS + 1,
        1024,
        TILE,
        TILE + 1,
        2 * TILE,
        rows,
        0,
    ):
        b.launch(bsz)
        fptr, gx, _, _, bx, *_ = rec.calls[-1]
        assert b.params.bsz == bsz
        assert (fptr, gx, bx) == plan(bsz) and gx == b.grid(bsz), bsz
        kernels.add(plan.launch(bsz).kernel)
    assert kernels == set(dispatch.step_kernels(plan.config))  # every kernel of the table ran


@pytest.mark.parametrize(
    "bsz,exc,message",
    [(6, ValueError, r"bsz must be an int in \[0, 5\] \(the bound rows\), got 6"), (-1, ValueError, r"got -1")],
)
def test_bsz_out_of_range_is_refused_before_launching(fake_runtime, bsz, exc, message):
    rec = Recorder()
    b = bind(5, launch=rec)
    with pytest.raises(exc, match=message):
        b.launch(bsz)
    assert rec.calls == [] and b.params.bsz == 5


def test_a_remembered_launch_plan_never_admits_a_bad_bsz(fake_runtime):
    # launch() remembers each bsz's (kernel, blocks, threads); a refused bsz is never remembered,
    # and the same bsz again launches the same geometry.
    rows = 2 * TILE
    rec = Recorder()
    b = bind(rows, max_requests=rows, launch=rec)
    for _ in range(2):
        for bsz in (rows + 1, -1):
            with pytest.raises(ValueError, match="bsz must be an int"):
                b.launch(bsz)
        b.launch(TILE + 1)
        assert rec.calls[-1][1] == b.grid(TILE + 1) and b.params.bsz == TILE + 1
        b.launch(1)
        assert rec.calls[-1][1] == b.grid(1) and b.params.bsz == 1
    assert len(rec.calls) == 4


def test_a_non_int_bsz_is_refused(fake_runtime):
    b = bind(5)
    with pytest.raises(TypeError):
        b.launch(2.5)
    b.launch(np.int64(4))  # an integer type is fine
    assert b.params.bsz == 4


def test_stream_by_launch_overrides_the_bound_one(fake_runtime):
    rec = Recorder()
    b = bind(5, launch=rec)
    b.launch(2, stream=99)
    b.launch(2, stream=types.SimpleNamespace(cuda_stream=123))
    assert [c[8] for c in rec.calls] == [99, 123]


def test_outputs_callable_gets_the_launch_bsz(fake_runtime):
    b = bind(5, outputs=lambda bsz: ("views", bsz))
    assert b.launch(3) == ("views", 3)


@pytest.mark.parametrize(
    "kwargs,exc,message",
    [
        (dict(dec=DevArray((5,), np.int64)), TypeError, r"seq_lens_decoder must be int32 .*got dtype int64"),
        (dict(q=DevArray((4,))), ValueError, r"seq_lens_this_time must have shape \(bsz,\) = \(5,\)"),
        (dict(q=DevArray((5,), strides=(2,))), ValueError, r"seq_lens_this_time must be contiguous"),
        (
            dict(seq_lens_encoder=DevArray((6,))),
            ValueError,
            r"seq_lens_encoder must have shape \(bsz,\) = \(5,\)",
        ),
        (dict(max_requests=4), ValueError, r"seq_lens_decoder must have at most max_requests = 4 entries, got 5"),
        (dict(tables=DevArray((4, 8))), ValueError, r"block_tables must be .*got 4 rows for bsz = 5"),
        (
            dict(tables=DevArray((5, 8), strides=(1, 5))),
            ValueError,
            r"block_tables must be .*transposed or strided view",
        ),
        (dict(tables=DevArray((5, 8), np.int64)), TypeError, r"block_tables must be int32 .*got dtype int64"),
        (
            dict(tables=np.zeros((5, 8), np.int32)),
            TypeError,
            r"block_tables must be a CUDA array .*got numpy.ndarray \(host memory\)",
        ),
        (dict(tables=None, num_caches=1), TypeError, r"block_tables must be an int32 array .*got None"),
        (
            dict(num_caches=2, tables=[DevArray((5, 8))]),
            ValueError,
            r"block_tables must be one array or a sequence of 2",
        ),
        (dict(stream=True), TypeError, r"stream must be"),
    ],
)
def test_bind_refuses_bad_arguments(fake_runtime, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        bind(5, **kwargs)


def test_bind_refuses_an_array_on_another_device(fake_runtime):
    t = DevArray((5, 8))
    fake_runtime[t.ptr] = 1
    with pytest.raises(ValueError, match=r"block_tables must be on CUDA device 0, got an array in device 1"):
        bind(5, tables=t)


def test_positions_only_binding_needs_no_table(fake_runtime):
    b = bind(5, num_caches=0, tables=None)
    assert list(b.params.block_tables) == [0, 0, 0, 0]
    b.launch(5)


def test_bound_arrays_are_kept_alive(fake_runtime):
    t = DevArray((5, 8))
    ref = weakref.ref(t)
    b = bind(5, tables=t)
    del t
    gc.collect()
    assert ref() is not None  # the binding holds it: it cannot be freed while bound
    del b
    gc.collect()
    assert ref() is None


def test_check_bound_detects_a_changed_buffer(fake_runtime):
    t = DevArray((5, 8))
    b = bind(5, tables=t)
    b.check_bound()  # unchanged: fine
    t.__cuda_array_interface__["shape"] = (2, 8)  # an in-place resize
    with pytest.raises(
        ValueError, match=r"block_tables changed since bind .*shape \(5, 8\).*shape \(2, 8\).*bind again"
    ):
        b.check_bound()


def test_debug_mode_checks_before_every_launch(fake_runtime):
    dec, rec = DevArray((5,)), Recorder()
    b = bind(5, dec=dec, debug=True, launch=rec)
    b.launch(5)
    dec.__cuda_array_interface__["data"] = (dec.ptr + 64, False)  # reallocated in place
    with pytest.raises(ValueError, match=r"seq_lens_decoder changed since bind"):
        b.launch(5)
    assert len(rec.calls) == 1


def test_a_binding_that_does_not_hold_its_arrays(fake_runtime):
    t = DevArray((5, 8))
    ref = weakref.ref(t)
    b = bind(5, tables=t, hold=False)
    del t
    gc.collect()
    assert ref() is None  # the caller owns the lifetime (the torch op's cache watches with weak references)
    with pytest.raises(ValueError, match=r"check_bound needs a BoundStep that holds its arrays"):
        b.check_bound()
    assert set(b.bound) == {"seq_lens_decoder", "seq_lens_this_time", "block_tables"}


def test_the_plan_is_asked_once_per_bsz(fake_runtime):
    """launch() remembers each bsz's plan: the plan callable runs on a bsz's first launch only
    (and grid() asks it without remembering)."""
    rows = TILE + 5
    rec, plan = Recorder(), DispatchPlan(rows)
    b = bind(rows, max_requests=rows, launch=rec, plan=plan)
    for bsz in (0, 300, TILE + 1, 0, 300, TILE + 1):
        b.launch(bsz)
    assert plan.asked == [0, 300, TILE + 1] and len(rec.calls) == 6
    assert [(c[0], c[1], c[4]) for c in rec.calls[:3]] == [(c[0], c[1], c[4]) for c in rec.calls[3:]]
