"""``kvaddr profile --engine vllm``: the option rules of each engine, the CPU's exit 3, and the
whole command on the fake GPU with the vLLM kernels emulated (tests/support/vllm_emulated_gpu.py),
so the one-launch step and the three launches are checked and timed through the real CLI."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.commands import profile as profile_command
from kvaddr.errors import EnvironmentProblem, ProfileConfigError
from kvaddr.measure import environment
from kvaddr.measure.profile_run import ENGINE_ONLY, VLLM_DEFAULT_CONTEXT, ProfileConfig, run
from kvaddr.measure.vllm_profile import CPU_REASON, ONE, THREE, VLLM_KIND, VllmProfileUnavailable
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES
from kvaddr.measure.workload import DEFAULT_CONTEXT
from tests.support import vllm_emulator

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
needs_cxx = pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")
#: A small vLLM run on the emulated GPU: two shapes, two groups, dummies.
SMALL = [
    "profile",
    "--engine",
    "vllm",
    "--batch",
    "16",
    "--shape",
    "mixed:8:64",
    "--groups",
    "16,64",
    "--dummy-fraction",
    "0.25",
    "--context",
    "10:200",
    "--input-sets",
    "2",
    "--budget",
    "0",
]


def invoke(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


@pytest.fixture
def captured(no_gpu, monkeypatch):
    """The ProfileConfig ``kvaddr profile`` builds, captured instead of run."""
    seen = []

    def fake(config, *, stdout_json, tables=True):
        seen.append(config)
        return {}

    monkeypatch.setattr(profile_command, "profile_and_report", fake)
    return seen


# ----------------------------------------------------------------------------- options of each engine


@pytest.mark.parametrize(
    "option",
    [["--groups", "16"], ["--dcp", "2"], ["--dummy-fraction", "0.5"], ["--sliding-window", "64"], ["--shape", "8"]],
    ids=lambda o: o[0],
)
def test_a_vllm_option_with_the_core_engine_is_a_usage_error(no_gpu, option):
    r = invoke("profile", "--device", "cpu", "--budget", "0", *option)
    assert r.exit_code == 2, r.output
    assert f"'{option[0]}'" in r.stderr and "applies to --engine vllm only, not --engine core" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "option",
    [
        ["--prefill", "1:16"],
        ["--block-size", "16"],
        ["--layers", "2"],
        ["--caches", "1"],
        ["--model", "glm-5"],
        ["--model", "deepseek-v3.2"],  # the default value, given: refused all the same
        ["--step-ms", "5"],
        ["--profile", "deepseek-v3.2-mtp"],
    ],
    ids=lambda o: f"{o[0]} {o[1]}",
)
def test_a_core_option_with_the_vllm_engine_is_a_usage_error(no_gpu, option):
    r = invoke("profile", "--engine", "vllm", "--device", "cpu", *option)
    assert r.exit_code == 2, r.output
    assert f"'{option[0]}'" in r.stderr and "applies to --engine core only, not --engine vllm" in r.stderr


def test_every_offending_option_is_named_and_hints_are_given(no_gpu):
    r = invoke("profile", "--engine", "vllm", "--layers", "2", "--block-size", "16", "--prefill", "1:8")
    assert r.exit_code == 2
    text = " ".join(r.stderr.split())
    assert "'--prefill' / '--block-size' / '--layers'" in text
    assert "--groups gives each vLLM KV-cache group's block size" in text
    assert "--shape mixed:N:T mixes prefill chunks into a batch" in text


def test_save_is_refused_with_the_vllm_engine_before_any_work(no_gpu, tmp_path):
    target = tmp_path / "base.json"
    r = invoke("profile", "--engine", "vllm", "--save", str(target))
    assert r.exit_code == 2
    text = " ".join(r.stderr.split())
    assert "'--save'" in text and "no baseline for kvaddr compare / check" in text and "--json PATH" in text
    assert not target.exists()


@pytest.mark.parametrize(
    "args, option, words",
    [
        (["--shape", "bogus"], "--shape", "shape must be decode:N, mixed:N:T or N"),
        (["--shape", "mixed:1:5"], "--shape", "N >= 2 and T >= N"),
        (["--shape", "decode:8,mixed:4"], "--shape", "got 'mixed:4'"),
        (["--dcp", "2:2"], "--dcp", "RANK must be in [0, 1], got 2"),
        (["--dcp", "0"], "--dcp", "SIZE must be in [1, 1024], got 0"),
        (["--dcp", "2:0:1:1"], "--dcp", "expected SIZE[:RANK[:INTERLEAVE]]"),
        (["--dcp", "4:1:3"], "--dcp", "INTERLEAVE must divide the block size of the first group"),
        (["--groups", "16,16,16,16,16"], "--groups", "1 to 4 KV-cache groups"),
        (["--groups", "0"], "--groups", "block size must be in"),
        (["--sliding-window", "64"], "--sliding-window", "two or more groups"),
        (["--dummy-fraction", "9"], "--dummy-fraction", "0<=x<=8"),
        (["--dummy-fraction", "nan"], "--dummy-fraction", "finite"),
        (["--batch", "1048576", "--context", "1000000"], "--batch' / '--shape", "exceeds 67108864 entries"),
    ],
)
def test_bad_vllm_values_are_usage_errors_naming_the_option(no_gpu, args, option, words):
    r = invoke("profile", "--engine", "vllm", "--device", "cpu", *args)
    assert r.exit_code == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"'{option}'" in text and words in text, text


def test_batch_becomes_decode_shapes_before_the_given_shapes(captured):
    r = invoke("profile", "--engine", "vllm", "--batch", "64,1024", "--shape", "mixed:256:16384", "--shape", "64")
    assert r.exit_code == 0, r.output
    (config,) = captured
    assert config.engine == "vllm"
    assert config.shapes == ("decode:64", "decode:1024", "mixed:256:16384")  # 64 = decode:64, given twice
    assert config.batches == ProfileConfig().batches  # --batch became shapes; the core setting keeps its default
    assert config.context == VLLM_DEFAULT_CONTEXT and config.groups == (16,) and config.dcp == (1, 0, 1)
    assert list(config.recorded_options())[:2] == ["engine", "shapes"]


def test_vllm_defaults_and_every_vllm_option(captured):
    r = invoke("profile", "--engine", "vllm")
    assert r.exit_code == 0, r.output
    assert captured[0].shapes == DEFAULT_SHAPES and captured[0].context == VLLM_DEFAULT_CONTEXT
    args = ["--shape", "decode:8,mixed:4:32", "--groups", "16,64", "--dcp", "4:3:8", "--dummy-fraction", "0.5"]
    args += ["--sliding-window", "256", "--context", "1:99", "--mode", "graph", "--seed", "7", "--input-sets", "3"]
    r = invoke("profile", "--engine", "vllm", *args)
    assert r.exit_code == 0, r.output
    c = captured[1]
    assert (c.shapes, c.groups, c.dcp, c.dummy_fraction, c.sliding_window) == (
        ("decode:8", "mixed:4:32"),
        (16, 64),
        (4, 3, 8),
        0.5,
        256,
    )
    o = c.vllm_options()
    assert (o.block_sizes, o.cp_size, o.cp_rank, o.cp_interleave) == ((16, 64), 4, 3, 8)
    assert (o.dummy_fraction, o.context, o.sliding_window_reach, o.seed, o.input_sets) == (0.5, (1, 99), 256, 7, 3)
    assert c.mode == "graph"
    assert c.num_blocks_mem == o.num_blocks_mem == "device"  # the default


def test_num_blocks_mem(captured, no_gpu):
    r = invoke("profile", "--engine", "vllm", "--num-blocks-mem", "uva")
    assert r.exit_code == 0, r.output
    c = captured[0]
    assert c.num_blocks_mem == "uva" and c.vllm_options().num_blocks_mem == "uva"
    assert c.vllm_options().as_dict()["num_blocks_mem"] == "uva"
    r = invoke("profile", "--engine", "vllm", "--num-blocks-mem", "host")
    assert r.exit_code == 2 and "'host' is not one of 'device', 'uva'" in r.output
    r = invoke("profile", "--device", "cpu", "--budget", "0", "--num-blocks-mem", "uva")  # the core engine: no
    assert r.exit_code == 2, r.output


def test_the_core_engine_is_unchanged(captured):
    r = invoke("profile", "--batch", "8")
    assert r.exit_code == 0, r.output
    (c,) = captured
    assert c.engine == "core" and c.batches == (8,) and c.shapes == () and c.context == DEFAULT_CONTEXT
    assert "engine" in c.recorded_options() and not set(ENGINE_ONLY["vllm"]) & set(c.recorded_options())


def test_sweep_has_no_engine_options(no_gpu):
    for option in ("--engine", "--shape", "--groups", "--dcp", "--dummy-fraction", "--sliding-window"):
        r = invoke("sweep", option, "1")
        assert r.exit_code == 2 and "No such option" in r.stderr, (option, r.output)


def test_the_help_example_of_the_vllm_engine_is_accepted(no_gpu):
    """The help's ``--engine vllm`` example passes every option check: on the CPU it gets to exit 3."""
    text = invoke("profile", "--help").stdout
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("kvaddr profile --engine vllm")]
    r = invoke(*shlex.split(line)[1:], "--device", "cpu")
    assert r.exit_code == 3, r.output
    assert "--engine vllm" in text and "mixed:N:T" in text and "exits 2" in " ".join(text.split())


# ----------------------------------------------------------------------------- the CPU: exit 3


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_cpu_exits_3_with_one_line(no_gpu, device):
    r = invoke("profile", "--engine", "vllm", "--device", device, "--json", "-")
    assert r.exit_code == 3, r.output
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"kvaddr profile: {CPU_REASON}" + (
        " (no CUDA device found: CuPy is not importable (test))" if device == "auto" else ""
    )


def test_cuda_without_a_gpu_exits_3(no_gpu):
    r = invoke("profile", "--engine", "vllm", "--device", "cuda")
    assert r.exit_code == 3 and "--device cuda: no CUDA device found" in r.stderr


def test_run_raises_an_environment_problem_on_the_cpu(no_gpu):
    with pytest.raises(VllmProfileUnavailable, match="has no CPU path") as info:
        run(ProfileConfig(engine="vllm", device="cpu"))
    assert isinstance(info.value, EnvironmentProblem)


# ----------------------------------------------------------------------------- ProfileConfig


def test_config_defaults_depend_on_the_engine():
    core, vllm = ProfileConfig(), ProfileConfig(engine="vllm")
    assert core.context == DEFAULT_CONTEXT and core.shapes == ()
    assert vllm.context == VLLM_DEFAULT_CONTEXT and vllm.shapes == DEFAULT_SHAPES
    assert ProfileConfig(engine="vllm", context=(5, 6)).context == (5, 6)
    core.validate()
    vllm.validate()


def test_config_recorded_options_of_the_vllm_engine_replay():
    config = ProfileConfig(engine="vllm", shapes=("decode:8",), groups=(16, 64), dcp=(2, 1, 4), sliding_window=9)
    options = config.recorded_options()
    assert set(options) == set(ProfileConfig.settings_of("vllm"))
    assert not set(ENGINE_ONLY["core"]) & set(options)
    assert options["engine"] == "vllm" and options["dcp"] == [2, 1, 4] and options["shapes"] == ["decode:8"]
    assert ProfileConfig.from_recorded(json.loads(json.dumps(options))) == config


@pytest.mark.parametrize(
    "changes, fields",
    [
        (dict(engine="vllm", layers=2), ("layers",)),
        (dict(engine="vllm", batches=(8,)), ("batches",)),
        (dict(engine="vllm", save_path="b.json"), ("save_path",)),
        (dict(groups=(16, 64)), ("groups",)),
        (dict(shapes=("decode:8",), dcp=(2, 0, 1)), ("shapes", "dcp")),
        (dict(engine="gpt"), ("engine",)),
        (dict(engine="vllm", shapes=("prefill:3",)), ("shapes",)),
        (dict(engine="vllm", dcp=(2, 2, 1)), ("dcp",)),
        (dict(engine="vllm", dcp=(2, 1, 3)), ("dcp",)),
        (dict(engine="vllm", groups=(16,) * 5), ("groups",)),
        (dict(engine="vllm", sliding_window=5), ("sliding_window",)),
        (dict(engine="vllm", dummy_fraction=-0.5), ("dummy_fraction",)),
    ],
)
def test_config_validation_names_the_setting(changes, fields):
    with pytest.raises(ProfileConfigError) as info:
        ProfileConfig(**changes).validate()
    assert info.value.fields == fields


def test_config_lists_compare_as_tuples():
    ProfileConfig(groups=[16], dcp=[1, 0, 1]).validate()  # the defaults, as lists: still the core engine's


# ----------------------------------------------------------------------------- the whole command, emulated GPU


@needs_cxx
def test_json_to_stdout_is_one_vllm_report(emulated_gpu):
    r = invoke(*SMALL, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # exactly one JSON document, nothing else on stdout
    assert doc["kind"] == VLLM_KIND and doc["schema_version"] == 1
    assert list(doc)[:7] == ["schema_version", "kind", "created_utc", "options", "environment", "settings", "workload"]
    assert doc["options"]["engine"] == "vllm" and set(doc["options"]) == set(ProfileConfig.settings_of("vllm"))
    assert doc["options"]["shapes"] == ["decode:16", "mixed:8:64"] and doc["options"]["groups"] == [16, 64]
    assert doc["environment"]["device"] == "cuda"
    s = doc["settings"]
    assert s["modes"] == ["eager", "graph"] and s["shapes"] == ["decode:16", "mixed:8:64"]
    assert s["baseline"] == THREE and s["budget_s"] == 0.0 and s["input_sets"] == 2
    assert doc["workload"]["block_sizes"] == [16, 64] and doc["workload"]["dummy_fraction"] == 0.25
    assert [x["shape"] for x in doc["shapes"]] == ["decode:16", "mixed:8:64"]
    for shape in doc["shapes"]:
        assert shape["correctness"]["status"] == "passed" and shape["correctness"]["graph_replays"] is True
        seen = {(x["mode"], x["clock"], x["strategy"]) for x in shape["results"]}
        for measure in (("graph", "gpu"), ("eager", "host"), ("eager", "gpu")):
            assert {(*measure, n) for n in (THREE, ONE, "floor")} <= seen
        for x in shape["results"]:
            assert x["summary"]["n"] == len(x["samples_us"]) >= 10
            assert (x["vs_three_launch"] is None) == (x["strategy"] == "floor")
        assert [(v["mode"], v["clock"]) for v in shape["savings"]] == [
            ("graph", "gpu"),
            ("eager", "host"),
            ("eager", "gpu"),
        ]
        launches = {x["strategy"]: x["launches_per_step"] for x in shape["results"]}
        assert launches[ONE] == 1 and launches[THREE] == 3
    assert doc["shapes"][0]["input_sets"][0]["dummies"] == 4
    assert isinstance(doc["wall_s"], float)
    assert "both match the reference" in r.stderr and "done in" in r.stderr
    # docs/json-schema.md documents every field of the report
    schema = (ROOT / "docs" / "json-schema.md").read_text(encoding="utf-8")
    schema = schema[schema.index("# The vLLM engine report") :]
    keys = set(doc) | set(doc["options"]) | set(doc["settings"]) | set(doc["workload"]) | set(doc["shapes"][0])
    keys |= set(doc["shapes"][0]["savings"][0]) | set(doc["shapes"][0]["input_sets"][0])
    missing = sorted(k for k in keys - {"schema_version", "created_utc", "environment"} if f"`{k}`" not in schema)
    assert not missing, missing


@needs_cxx
def test_tables_and_a_json_file(emulated_gpu, tmp_path):
    path = tmp_path / "vllm.json"
    r = invoke(*SMALL, "--mode", "graph", "--json", str(path))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "vLLM decode:16: 20 requests (24 padded), 2 group(s) (B = 16, 64)" in out
    assert "vLLM mixed:8:64" in out and "graph: GPU" in out and "eager:" not in out
    for name in (THREE, ONE, "floor"):
        assert name in out
    assert out.count("graph: GPU: one launch ") == 2
    doc = json.loads(path.read_text())
    assert doc["kind"] == VLLM_KIND and doc["settings"]["modes"] == ["graph"]
    assert {x["mode"] for shape in doc["shapes"] for x in shape["results"]} == {"graph"}
    assert f"JSON report written to {path}" in r.stderr


@needs_cxx
def test_a_wrong_result_exits_1_and_reports_no_time(emulated_gpu, monkeypatch):
    from kvaddr.strategies import vllm_three_launch

    real = vllm_three_launch.VllmThreeLaunch.compute

    def broken(self, *args, **kw):
        out = real(self, *args, **kw)
        out.slot_mappings.a[0, 0] += 1
        return out

    monkeypatch.setattr(vllm_three_launch.VllmThreeLaunch, "compute", broken)
    r = invoke(*SMALL, "--json", "-")
    assert r.exit_code == 1, r.output
    assert r.stdout == ""
    assert "check failed: vllm-three-launch (eager, decode:16, input set 0) differs" in r.stderr
    assert "slot_mappings[0, 0]" in r.stderr or "slot_mappings[0" in r.stderr


@needs_cxx
def test_a_vllm_report_is_no_baseline_for_sweep_from(emulated_gpu, tmp_path):
    path = tmp_path / "vllm.json"
    assert invoke(*SMALL, "--mode", "graph", "--json", str(path)).exit_code == 0
    r = invoke("sweep", "--from", str(path))
    assert r.exit_code == 2 and "kvaddr.profile.vllm" in r.stderr
