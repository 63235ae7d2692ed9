"""The GPU path of kvaddr profile, run against a fake CuPy on the CPU.

Real timing needs a GPU; this checks the flow around it without one: the
device selection, the eager check, graph capture and the replay check, the
event-based sample loops, and the report's sections. The fake stream records
what the strategies launch while it captures, and a fake graph replays it.
"""

import json
import sys
import time
import types

import numpy as np
import pytest
from click.testing import CliRunner

import kvaddr
from kvaddr import _kernels, cpu_strategies, environment, timing
from kvaddr import cli as cli_module
from kvaddr.outputs import OUTPUT_FIELDS, StepOutputs


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
        getDeviceCount=lambda: 1, getDevice=lambda: 0, driverGetVersion=lambda: 12040,
        runtimeGetVersion=lambda: 12040,
        getDeviceProperties=lambda i: {"name": b"Fake H200", "major": 9, "minor": 0, "totalGlobalMem": 2**37,
                                       "multiProcessorCount": 132})
    cp.cuda = types.SimpleNamespace(
        runtime=runtime, Stream=FakeStream, Event=FakeEvent, Device=FakeDevice,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 4)))
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
            for f in OUTPUT_FIELDS:
                np.copyto(getattr(self.out, f), getattr(o, f))

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
    monkeypatch.setattr(_kernels, "get_module", lambda device_id=None: object())

    def empty(grid, block, args, shared_mem=0, stream=None):
        stream.launch(lambda: None)

    monkeypatch.setattr(_kernels, "get_function", lambda name, device_id=None: empty)
    state = {"noop": set()}
    fake_strategies = types.ModuleType("kvaddr.strategies")
    fake_strategies.STRATEGY_NAMES = cpu_strategies.STRATEGY_NAMES

    def make_strategy(name, *, device=None, **kw):
        return FakeGpuStrategy(cpu_strategies.make_strategy(name, **kw), name in state["noop"])

    fake_strategies.make_strategy = make_strategy
    monkeypatch.setitem(sys.modules, "kvaddr.strategies", fake_strategies)
    monkeypatch.setattr(kvaddr, "strategies", fake_strategies, raising=False)
    return state


ARGS = ["profile", "--layers", "2", "--budget", "0", "--batch", "4"]


def test_gpu_flow_both_modes(fake_gpu):
    r = CliRunner().invoke(cli_module.cli, ARGS + ["--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["environment"]["device"] == "cuda"
    assert doc["environment"]["gpu"]["name"] == "Fake H200"
    assert doc["environment"]["cuda_driver"] == "12.4" and doc["environment"]["nvrtc"] == "12.4"
    assert doc["settings"]["modes"] == ["eager", "graph"]
    shape = doc["shapes"][0]
    assert shape["correctness"]["graph_replays"] is True
    seen = {(x["mode"], x["clock"], x["strategy"]) for x in shape["results"]}
    for mode, clock in (("graph", "gpu"), ("eager", "host"), ("eager", "gpu")):
        for name in ("per-layer", "per-layer-kernel", "hoisted", "fused", "floor"):
            assert (mode, clock, name) in seen
    for x in shape["results"]:
        assert x["summary"]["n"] == len(x["samples_us"]) >= 10
        assert x["steps_per_sample"] >= 1
    assert len(shape["headlines"]) == 3


def test_profiles_in_one_process_share_one_measuring_stream(fake_gpu, monkeypatch):
    """Destroying a stream that ran work slows every later graph node in the CUDA context
    (measured on an H200), so every run in a process times on one stream that is never dropped."""
    made = []

    class CountingStream(FakeStream):
        def __init__(self, non_blocking=False):
            super().__init__(non_blocking)
            made.append(self)

    monkeypatch.setattr(sys.modules["cupy"].cuda, "Stream", CountingStream)
    for _ in range(2):
        r = CliRunner().invoke(cli_module.cli, ARGS)
        assert r.exit_code == 0, r.output
    assert len(made) == 1 and timing.measurement_stream(0) is made[0]
    from kvaddr.profiler import CudaBackend

    assert CudaBackend(0).stream is made[0]


def test_gpu_flow_table(fake_gpu):
    r = CliRunner().invoke(cli_module.cli, ARGS + ["--mode", "graph"])
    assert r.exit_code == 0, r.output
    assert "graph: GPU" in r.stdout and "eager: host" not in r.stdout
    assert "no CUDA device" not in r.stderr


def test_a_graph_that_skips_work_is_caught(fake_gpu):
    fake_gpu["noop"].add("hoisted")
    r = CliRunner().invoke(cli_module.cli, ARGS)
    assert r.exit_code == 1, r.output
    assert "'hoisted'" in r.stderr and "graph replay" in r.stderr
    assert r.stdout == ""


def test_kernel_compile_failure_exits_3(fake_gpu, monkeypatch):
    from kvaddr.errors import KernelCompileError

    def fail(device_id=None):
        raise KernelCompileError("kvaddr/kernels.cu failed to compile for CUDA device 0:\nerror: boom")

    monkeypatch.setattr(_kernels, "get_module", fail)
    r = CliRunner().invoke(cli_module.cli, ARGS)
    assert r.exit_code == 3
    assert "failed to compile" in r.stderr and "boom" in r.stderr
    info = CliRunner().invoke(cli_module.cli, ["info"])
    assert info.exit_code == 3
    assert "NO" in info.stdout and "boom" in info.stderr


def test_info_with_a_gpu(fake_gpu):
    r = CliRunner().invoke(cli_module.cli, ["info"])
    assert r.exit_code == 0, r.output
    assert "Fake H200" in r.stdout and "compute capability 9.0" in r.stdout and "yes" in r.stdout
