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
        for name in ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused", "floor"):
            assert (mode, clock, name) in seen
    for x in shape["results"]:
        assert x["summary"]["n"] == len(x["samples_us"]) >= 10
        assert x["steps_per_sample"] >= 1
    assert len(shape["headlines"]) == 3


def test_gpu_flow_leaves_one_block_out_beyond_1024_requests(fake_gpu):
    args = ["profile", "--layers", "1", "--budget", "0", "--batch", "1025", "--input-sets", "1", "--json", "-"]
    r = CliRunner().invoke(cli_module.cli, args)
    assert r.exit_code == 0, r.output
    (shape,) = json.loads(r.stdout)["shapes"]
    assert shape["skipped"] == {"one-block": "not run: one-block runs at most 1024 requests"}
    assert "one-block" not in {x["strategy"] for x in shape["results"]}
    assert "one-block" not in shape["correctness"]["strategies"]
    assert {x["strategy"] for x in shape["results"]} == {"per-layer", "per-layer-kernel", "hoisted", "fused", "floor"}


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


class _FakeBound:
    def __init__(self, strategy, args, stream):
        self.strategy, self.args, self.stream = strategy, args, stream
        self.launches = 0

    def launch(self):
        self.launches += 1
        dec, q, tables, enc = self.args
        return self.strategy.step(dec, q, tables, seq_lens_encoder=enc, stream=self.stream)


class _FakePlanner:
    """What the profiler needs of StepPlanner for the bound row: bind() and check()."""

    def __init__(self, strategy):
        self.strategy, self.bound = strategy, []

    def bind(self, dec, q, tables, *, seq_lens_encoder=None, stream=None):
        b = _FakeBound(self.strategy, (dec, q, tables, seq_lens_encoder), stream)
        self.bound.append(b)
        return b

    def check(self, stream=None):
        pass


def _with_fake_planner(monkeypatch, corrupt=False):
    gpu = sys.modules["kvaddr.strategies.gpu"]
    made = {}
    inner = gpu.make_strategy

    def make_strategy(name, **kw):
        s = inner(name, **kw)
        if name == "fused":
            s.planner = made["planner"] = _FakePlanner(s)
            if corrupt:  # the bound path writes a wrong slot: the check must catch it
                orig = _FakeBound.launch

                def bad(self):
                    out = orig(self)
                    out.slot_mapping[...] = 12345
                    return out

                monkeypatch.setattr(_FakeBound, "launch", bad)
        return s

    monkeypatch.setattr(gpu, "make_strategy", make_strategy)
    return made


def test_eager_sections_get_a_row_for_the_bound_launch(fake_gpu, monkeypatch):
    made = _with_fake_planner(monkeypatch)
    r = CliRunner().invoke(cli_module.cli, ARGS + ["--json", "-"])
    assert r.exit_code == 0, r.output
    shape = json.loads(r.stdout)["shapes"][0]
    seen = [(x["mode"], x["clock"], x["strategy"]) for x in shape["results"]]
    for clock in ("host", "gpu"):
        assert ("eager", clock, "fused (bound)") in seen
        names = [n for m, c, n in seen if (m, c) == ("eager", clock)]
        assert names.index("fused") < names.index("fused (bound)") < names.index("floor")
    assert ("graph", "gpu", "fused (bound)") not in seen  # eager only
    bound = made["planner"].bound
    assert bound and all(b.launches >= 2 for b in bound)  # one bind per input set, checked then timed
    r = CliRunner().invoke(cli_module.cli, ARGS + ["--mode", "eager"])
    assert r.exit_code == 0 and "fused (bound)" in r.output


def test_a_wrong_bound_launch_fails_the_check(fake_gpu, monkeypatch):
    _with_fake_planner(monkeypatch, corrupt=True)
    r = CliRunner().invoke(cli_module.cli, ARGS)
    assert r.exit_code != 0
    assert "fused (bound)" in r.output and "eager bound launch" in r.output


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
