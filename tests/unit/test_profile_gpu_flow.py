"""The GPU path of kvaddr profile, run against a fake CuPy on the CPU.

Real timing needs a GPU; this checks the flow around it without one: the
device selection, the eager check, graph capture and the replay check, the
event-based sample loops, and the report's sections. The fake stream records
what the strategies launch while it captures, and a fake graph replays it.
"""

import json
import sys

from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr import kernel_loader
from kvaddr.measure import timing
from tests.support.fake_cupy import FakeStream

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
    from kvaddr.measure.profile_run import CudaBackend

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

    monkeypatch.setattr(kernel_loader, "get_module", fail)
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


def test_gpu_flow_with_attention_checks_the_metadata_in_graph_replays(fake_gpu):
    args = ARGS + ["--caches", "2", "--attention", "flashinfer,varlen,page_table"]
    r = CliRunner().invoke(cli_module.cli, args + ["--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["options"]["attention"] == ["flashinfer", "varlen", "page_table"]
    assert doc["shapes"][0]["correctness"]["graph_replays"] is True
    # a graph that skips the work leaves the poisoned metadata: caught before any timing
    fake_gpu["noop"].add("fused")
    r = CliRunner().invoke(cli_module.cli, args)
    assert r.exit_code == 1, r.output
    assert "'fused'" in r.stderr and "graph replay" in r.stderr
