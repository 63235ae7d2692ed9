"""A fake CuPy for testing the GPU flows (profile, replay) on the CPU.

``fake_gpu`` (a pytest fixture, offered to the unit tests by ``tests/unit/conftest.py``)
installs it: the CuPy API the profiler and replayer use, kernels.cu's loader answering with
an empty launch, and GPU strategies that run the NumPy strategies.
"""

import sys
import time
import types

import numpy as np
import pytest

import kvaddr
from kvaddr import kernel_loader
from kvaddr.kernel_names import LIBRARY_KERNELS
from kvaddr.measure import environment, timing
from kvaddr.outputs import ATTENTION_FIELDS, OUTPUT_FIELDS, AttentionOutputs, StepOutputs
from kvaddr.strategies import cpu as cpu_strategies


class FakeGraph:
    def __init__(self, work):
        self.work = work

    def launch(self, stream=None):
        for fn in self.work:
            fn()


class FakeStream:
    current = None

    def __init__(self, non_blocking=False):
        self.ptr = id(self)
        self.capturing = None

    def __enter__(self):
        self._prev, FakeStream.current = FakeStream.current, self
        return self

    def __exit__(self, *exc):
        FakeStream.current = self._prev
        return False

    def synchronize(self):
        if self.capturing is not None:
            raise RuntimeError("synchronize during capture")

    def begin_capture(self, mode=None):
        assert self.capturing is None
        self.capturing = []

    def end_capture(self):
        work, self.capturing = self.capturing, None
        return FakeGraph(work)

    def launch(self, fn):
        """Run ``fn`` now, or record it while capturing."""
        if self.capturing is not None:
            self.capturing.append(fn)
        else:
            fn()


class FakeEvent:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class FakeDevice:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_cupy():
    cp = types.ModuleType("cupy")
    cp.__version__ = "13.0.0-fake"
    cp.asarray = np.asarray
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        driverGetVersion=lambda: 12040,
        runtimeGetVersion=lambda: 12040,
        getDeviceProperties=lambda i: {
            "name": b"Fake H200",
            "major": 9,
            "minor": 0,
            "totalGlobalMem": 2**37,
            "multiProcessorCount": 132,
        },
    )
    cp.cuda = types.SimpleNamespace(
        runtime=runtime,
        Stream=FakeStream,
        Event=FakeEvent,
        Device=FakeDevice,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 4)),
    )
    return cp


class FakeGpuStrategy:
    """A CPU strategy whose outputs live in persistent buffers and whose work goes through the stream."""

    def __init__(self, inner, noop_when_captured=False):
        self.inner, self.name = inner, inner.name
        self.noop = noop_when_captured
        self.out = None

    @property
    def launches_per_step(self):
        return self.inner.launches_per_step

    def step(self, dec, q, tables, *, seq_lens_encoder=None, stream=None):
        assert isinstance(stream, FakeStream), "the profiler must pass its own stream"

        def work():
            o = self.inner.step(dec, q, tables, seq_lens_encoder=seq_lens_encoder)
            if self.out is None:
                self.out = StepOutputs(*(np.array(getattr(o, f)) for f in OUTPUT_FIELDS))
                if o.attention is not None:  # persistent attention buffers too (page_table: input views)
                    a = AttentionOutputs(**{f: getattr(o.attention, f) for f in ATTENTION_FIELDS})
                    for f in ATTENTION_FIELDS:
                        if f != "page_table" and getattr(a, f) is not None:
                            setattr(a, f, np.array(getattr(a, f)))
                    self.out.attention = a
            for f in OUTPUT_FIELDS:
                np.copyto(getattr(self.out, f), getattr(o, f))
            if o.attention is not None:
                self.out.attention.page_table = o.attention.page_table  # views of this call's inputs
                for f in ATTENTION_FIELDS:
                    if f != "page_table" and getattr(o.attention, f) is not None:
                        np.copyto(getattr(self.out.attention, f), getattr(o.attention, f))

        if self.out is None:
            work()
        elif not (self.noop and stream.capturing is not None):
            stream.launch(work)
        return self.out

    def check(self, stream=None):
        self.inner.check()


@pytest.fixture
def fake_gpu(monkeypatch):
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(timing, "_STREAMS", {})  # the process's measuring streams, fake ones kept apart
    monkeypatch.setattr(environment, "probe_cuda", lambda: environment.CudaProbe(True, 1, "1 CUDA device(s)"))
    monkeypatch.setattr(kernel_loader, "get_module", lambda device_id=None: object())

    def empty(grid, block, args, shared_mem=0, stream=None):
        stream.launch(lambda: None)

    monkeypatch.setattr(kernel_loader, "get_function", lambda name, device_id=None: empty)
    monkeypatch.setattr(kernel_loader, "load_kernels", lambda names, device_id=None: dict.fromkeys(names, empty))
    state = {"noop": set()}
    fake_strategies = types.ModuleType("kvaddr.strategies.gpu")
    fake_strategies.STRATEGY_NAMES = cpu_strategies.STRATEGY_NAMES

    def make_strategy(name, *, device=None, **kw):
        return FakeGpuStrategy(cpu_strategies.make_strategy(name, **kw), name in state["noop"])

    fake_strategies.make_strategy = make_strategy
    monkeypatch.setitem(sys.modules, "kvaddr.strategies.gpu", fake_strategies)
    monkeypatch.setattr(kvaddr.strategies, "gpu", fake_strategies, raising=False)
    return state


# -- a fake CuPy for StepPlanner's host path (compute()'s checks, memo and launch) ------------


class _FakeMem:
    __slots__ = ("device_id", "ptr")

    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


class FakeDeviceArray:
    """A NumPy array dressed as a CuPy one: ``data.ptr`` is the host address, ``data.device_id`` is
    ``dev``. Its metadata can be changed in place, as CuPy's ``shape`` setter (or a torch
    ``resize_``/``set_``/``as_strided_``) does: assign another NumPy array to ``a`` (new
    pointer, shape, strides or dtype) or another ordinal to ``dev``."""

    def __init__(self, a, dev=0):
        self.a, self.dev = a, dev

    @property
    def data(self):
        return _FakeMem(self.a.ctypes.data, self.dev)

    shape = property(lambda self: self.a.shape)
    strides = property(lambda self: self.a.strides)
    itemsize = property(lambda self: self.a.itemsize)
    dtype = property(lambda self: self.a.dtype)
    size = property(lambda self: self.a.size)
    device = property(lambda self: FakeDevice(self.dev))

    def __getitem__(self, k):
        return FakeDeviceArray(self.a[k], self.dev)

    def get(self, stream=None, out=None):
        if out is not None:
            out[...] = self.a.reshape(out.shape)
            return out
        return self.a.copy()

    def set(self, host, stream=None):
        self.a[...] = np.asarray(host).reshape(self.a.shape)


FakeDeviceArray.__module__ = "cupy._core.core"


class _PlannerStream:
    def __init__(self, ptr):
        self.ptr = ptr

    def synchronize(self):
        pass


def install_planner_fake(monkeypatch):
    """Install a CuPy in which ``StepPlanner`` builds on FakeDeviceArrays and launches are recorded.

    Returns a namespace: ``launches`` (one dict per launchKernel call: the function pointer, grid,
    block, stream and a copy of the StepParams struct it received), ``current`` (set
    ``current.ptr`` to change CuPy's current stream), ``array(values, dtype=int32, dev=0)`` and
    ``kernel(fptr)``, the name of the library kernel a launch's function pointer belongs to (each
    kernel loads as its own pointer, :func:`function_ptr`).
    """
    import ctypes

    from kvaddr import device

    launches = []

    def launch(fptr, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        arg0 = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        rec = dict(
            fptr=fptr,
            grid=gx,
            grid_y=gy,
            block=bx,
            stream=stream,
            params=kernel_loader.StepParams.from_buffer_copy(kernel_loader.StepParams.from_address(arg0)),
        )
        i = fptr - _FPTR_BASE
        if 0 <= i < len(LIBRARY_KERNELS) and LIBRARY_KERNELS[i].startswith("mtp_"):  # the MTP launch's own struct
            rec["mtp"] = kernel_loader.MtpParams.from_buffer_copy(kernel_loader.MtpParams.from_address(arg0))
        launches.append(rec)

    current = _PlannerStream(0x51)
    cp = fake_cupy()
    cp.cuda.driver = types.SimpleNamespace(launchKernel=launch)
    cp.cuda.get_current_stream = lambda: current
    cp.cuda.ExternalStream = _PlannerStream  # validation.cupy_stream (no Stream.from_external here)
    cp.zeros = lambda shape, dtype: FakeDeviceArray(np.zeros(shape, dtype))
    cp.full = lambda shape, v, dtype: FakeDeviceArray(np.full(shape, v, dtype))
    cp.asarray = lambda a: FakeDeviceArray(np.array(a))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.function", types.SimpleNamespace(CPointer=lambda addr: addr))
    monkeypatch.setattr(device, "_checked", [cp, 2])  # require_cuda: two devices
    monkeypatch.setattr(kernel_loader, "get_function", lambda name, device_id=None: types.SimpleNamespace(ptr=0xF00))
    monkeypatch.setattr(
        kernel_loader,
        "load_kernels",
        lambda names, device_id=None: {n: types.SimpleNamespace(ptr=function_ptr(n)) for n in names},
    )
    return types.SimpleNamespace(
        launches=launches,
        current=current,
        array=lambda values, dtype=np.int32, dev=0: FakeDeviceArray(np.array(values, dtype), dev),
        kernel=lambda fptr: LIBRARY_KERNELS[fptr - _FPTR_BASE],
    )


_FPTR_BASE = 0x10000


def function_ptr(name: str) -> int:
    """The fake function pointer of library kernel ``name`` (one per kernel, so a launch names its kernel)."""
    return _FPTR_BASE + LIBRARY_KERNELS.index(name)
