"""kvaddr profile / kvaddr info on the CPU path, through click's CliRunner."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment
from kvaddr.measure.report import Comparison, compare_to_reference, format_us, headline, verdict
from kvaddr.measure.timing import Budget, Measurement, block_size_for, summarize
from kvaddr.strategies import cpu as cpu_strategies

STRATEGIES = ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused")
FAST = ["--layers", "2", "--budget", "0", "--batch", "4"]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Every test runs as on a machine without a CUDA device."""
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


def assert_clean(result):
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# ----------------------------------------------------------------------------- profile, table


def test_profile_prints_a_table_with_every_strategy():
    r = run("profile", *FAST)
    assert_clean(r)
    assert r.exit_code == 0, r.output
    for name in STRATEGIES:
        assert name in r.stdout
    for column in ("launches", "median", "IQR", "saved"):
        assert column in r.stdout
    assert "batch 4" in r.stdout
    assert "CPU (NumPy), host wall time of NumPy code, not the GPU kernels:" in r.stdout  # the headline
    assert "no CUDA device found" in r.stderr
    assert "no CUDA device found" not in r.stdout
    assert "━" not in r.stderr  # no progress bar when stderr is not a terminal


def test_profile_several_shapes_and_step_share():
    r = run(
        "profile",
        "--layers",
        "2",
        "--budget",
        "0",
        "--batch",
        "1,3",
        "--step-ms",
        "12",
        "--spec-tokens",
        "1",
        "--prefill",
        "1:32",
        "--model",
        "glm-5",
    )
    assert r.exit_code == 0, r.output
    assert "batch 1:" in r.stdout and "batch 3:" in r.stdout
    assert "of step" in r.stdout
    assert "glm-5" in r.stdout


def test_the_cpu_path_says_it_times_numpy_not_the_gpu_kernels():
    r = run("profile", *FAST, "--device", "cpu")
    assert r.exit_code == 0, r.output
    title, header = r.stdout.splitlines()[:2]
    assert "NumPy strategies on the CPU, not the GPU kernels" in title
    # no floor: on the CPU it would be an empty Python call, no launch
    assert "x floor" not in header and "floor" not in r.stdout
    headline = [line for line in r.stdout.splitlines() if line.startswith("CPU (NumPy)")]
    assert len(headline) == 1 and "not the GPU kernels" in headline[0]
    assert "saves" not in headline[0] and "fusing" not in headline[0] and "hoisting" not in headline[0]
    doc = json.loads(run("profile", *FAST, "--device", "cpu", "--json", "-").stdout)
    assert any(res["strategy"] == "floor" for res in doc["shapes"][0]["results"])  # still in the JSON report


def test_graph_mode_without_a_gpu_exits_3():
    r = run("profile", *FAST, "--mode", "graph")
    assert r.exit_code == 3, r.output
    assert "--mode graph: CUDA graphs need a GPU" in r.stderr and r.stdout == ""
    r = run("profile", *FAST, "--mode", "graph", "--device", "cpu")
    assert r.exit_code == 2 and "CUDA graphs need a GPU" in r.stderr, r.output
    r = run("profile", *FAST, "--mode", "both")  # eager measured, said on stderr
    assert r.exit_code == 0 and "graph mode needs a CUDA device" in r.stderr, r.output


def test_sweep_graph_mode_without_a_gpu_exits_3():
    r = run("sweep", *FAST, "--mode", "graph")
    assert r.exit_code == 3 and "--mode graph: CUDA graphs need a GPU" in r.stderr, r.output


def test_device_cpu_does_not_probe(monkeypatch):
    def boom():
        raise AssertionError("probed")

    monkeypatch.setattr(environment, "probe_cuda", boom)
    r = run("profile", *FAST, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "no CUDA device found" not in r.stderr


# ----------------------------------------------------------------------------- profile, JSON


def test_json_to_stdout_is_one_document_with_every_field():
    r = run("profile", *FAST, "--json", "-", "--step-ms", "10")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # stdout holds exactly one JSON document
    assert doc["schema_version"] == 1 and doc["kind"] == "kvaddr.profile"
    env = doc["environment"]
    for key in (
        "device",
        "gpu",
        "cupy",
        "cuda_driver",
        "cuda_runtime",
        "nvrtc",
        "numpy",
        "python",
        "kvaddr",
        "git_commit",
        "git_dirty",
    ):
        assert key in env
    assert env["device"] == "cpu" and env["gpu"] is None
    assert doc["settings"]["modes"] == ["eager"] and doc["settings"]["noise_rule"]
    w = doc["workload"]
    assert (w["model"], w["num_layers"], w["num_caches"], w["block_sizes"]) == ("deepseek-v3.2", 2, 2, [64, 64])
    assert w["context"] == {"lo": 1024, "hi": 32768, "distribution": "log-uniform"}
    (shape,) = doc["shapes"]
    assert shape["batch"] == 4 and shape["capacity"] == 4 and len(shape["input_sets"]) == 4
    assert shape["correctness"]["status"] == "passed"
    names = [x["strategy"] for x in shape["results"]]
    assert names == list(STRATEGIES) + ["floor"]
    for x in shape["results"]:
        assert (x["mode"], x["clock"], x["unit"]) == ("eager", "host", "us_per_step")
        s = x["summary"]
        for key in ("median", "q25", "q75", "iqr", "mean", "min", "max", "n"):
            assert key in s
        assert s["n"] == len(x["samples_us"]) >= 10
        assert s["q25"] <= s["median"] <= s["q75"]
        assert x["launches_per_step"] >= 1
        assert x["vs_floor"] > 0
        if x["strategy"] == "floor":
            assert x["vs_per_layer"] is None
        else:
            v = x["vs_per_layer"]
            assert v["verdict"] in ("baseline", "saving", "slower", "within noise")
            assert v["share_of_step_pct"] is not None
    assert shape["headlines"]
    assert "no CUDA device found" in r.stderr


def test_json_to_a_file_and_table_to_stdout(tmp_path):
    path = tmp_path / "report.json"
    r = run("profile", *FAST, "--json", str(path))
    assert r.exit_code == 0, r.output
    doc = json.loads(path.read_text())
    assert [x["strategy"] for x in doc["shapes"][0]["results"]][-1] == "floor"
    assert "per-layer" in r.stdout and str(path) in r.stderr


# ----------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    "args, option",
    [
        (["--batch", "0"], "--batch"),
        (["--batch", "4,x"], "--batch"),
        (["--batch", ""], "--batch"),
        (["--context", "9:2"], "--context"),
        (["--context", "a:b"], "--context"),
        (["--context", "-5"], "--context"),
        (["--spec-tokens", "-1"], "--spec-tokens"),
        (["--prefill", "3"], "--prefill"),
        (["--prefill", "2:0"], "--prefill"),
        (["--batch", "2", "--prefill", "3:16"], "--prefill"),
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "16,32", "--caches", "3"], "--block-size"),
        (["--layers", "0"], "--layers"),
        (["--caches", "9"], "--caches"),
        (["--model", "llama"], "--model"),
        (["--mode", "fast"], "--mode"),
        (["--step-ms", "0"], "--step-ms"),
        (["--step-ms", "x"], "--step-ms"),
        (["--step-ms", "nan"], "--step-ms"),
        (["--budget", "nan"], "--budget"),
        (["--device", "tpu"], "--device"),
        (["--budget", "-1"], "--budget"),
        (["--seed", "-3"], "--seed"),
        (["--json", "/nonexistent-dir/x.json"], "--json"),
        (["--context", "0:1000000000", "--block-size", "1"], "--context"),
    ],
)
def test_bad_option_exits_2_naming_the_option(args, option):
    r = run("profile", *args)
    assert_clean(r)
    assert r.exit_code == 2, r.output
    assert option in r.stderr
    assert r.stdout == ""


def test_device_cuda_without_a_gpu_exits_3():
    r = run("profile", *FAST, "--device", "cuda")
    assert_clean(r)
    assert r.exit_code == 3
    assert "--device cuda" in r.stderr and "no CUDA device" in r.stderr
    assert r.stdout == ""


# ----------------------------------------------------------------------------- failed checks


def _corrupting(monkeypatch, victim, mutate):
    real = cpu_strategies.make_strategy

    class Wrapped:
        def __init__(self, inner):
            self.inner = inner
            self.name = inner.name

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, *args, **kwargs):
            return mutate(self.inner.step(*args, **kwargs))

    def make(name, **kw):
        s = real(name, **kw)
        return Wrapped(s) if name == victim else s

    monkeypatch.setattr(cpu_strategies, "make_strategy", make)


def test_a_wrong_output_exits_1_and_prints_no_timing(monkeypatch):
    def mutate(out):
        out.slot_mapping = out.slot_mapping.copy()
        out.slot_mapping[1, 2] += 5
        return out

    _corrupting(monkeypatch, "hoisted", mutate)
    r = run("profile", *FAST)
    assert_clean(r)
    assert r.exit_code == 1
    assert "'hoisted'" in r.stderr and "slot_mapping" in r.stderr and "token 2 of cache 1" in r.stderr
    assert "got" in r.stderr and "expected" in r.stderr
    assert r.stdout == ""  # no timing


def test_a_wrong_output_exits_1_with_json_too(monkeypatch):
    def mutate(out):
        out.position_ids = out.position_ids.copy()
        out.position_ids[0] = -9
        return out

    _corrupting(monkeypatch, "fused", mutate)
    r = run("profile", *FAST, "--json", "-")
    assert r.exit_code == 1
    assert "position_ids" in r.stderr and "token 0" in r.stderr and "got -9" in r.stderr
    assert r.stdout == ""


def test_a_strategy_that_raises_exits_1(monkeypatch):
    def mutate(out):
        raise ValueError("broken strategy")

    _corrupting(monkeypatch, "per-layer-kernel", mutate)
    r = run("profile", *FAST)
    assert_clean(r)
    assert r.exit_code == 1
    assert "per-layer-kernel" in r.stderr and "broken strategy" in r.stderr


def test_an_internal_error_has_no_traceback(monkeypatch):
    from kvaddr.measure import profile_run as profiler

    def boom(*a, **k):
        raise RuntimeError("surprise")

    monkeypatch.setattr(profiler, "run_profile", boom)
    r = run("profile", *FAST)
    assert_clean(r)
    assert r.exit_code == 1
    assert "internal error" in r.stderr and "surprise" in r.stderr


# ----------------------------------------------------------------------------- info, help, version


def test_info_without_a_gpu_exits_0():
    r = run("info")
    assert_clean(r)
    assert r.exit_code == 0, r.output
    for word in ("kvaddr", "NumPy", "CuPy", "CUDA driver", "CUDA runtime", "NVRTC", "kernels.cu", "kernel cache"):
        assert word in r.stdout


def test_info_without_cupy_says_so_instead_of_not_found(monkeypatch):
    none = {"cupy": None, "cuda_driver": None, "cuda_runtime": None, "nvrtc": None}
    monkeypatch.setattr(environment, "cuda_versions", lambda: dict(none))
    monkeypatch.setattr(environment, "probe_cuda", lambda: environment.CudaProbe(False, 0, "CuPy is not installed"))
    r = run("info")
    assert r.exit_code == 0, r.output
    rows = {line.split("  ")[0]: line for line in r.stdout.splitlines()}
    assert "not installed" in rows["CuPy"]
    for row in ("CUDA driver", "CUDA runtime", "NVRTC"):
        assert "not checked: CuPy is not installed" in rows[row] and "not found" not in rows[row]


def test_info_json():
    r = run("info", "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["cuda_available"] is False and doc["kernels_compile"] is None
    assert doc["kernel_cache_dir"]


def test_help_documents_exit_codes_and_defaults():
    r = run("profile", "--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "1024:32768" in text and "log-uniformly" in text
    for line in ("0 ok", "1 a check failed", "2 usage error", "3 environment problem"):
        assert line in text
    top = run("--help")
    assert "3 environment problem" in " ".join(top.stdout.split())
    assert run("--version").stdout.startswith("kvaddr ")


# ----------------------------------------------------------------------------- report and timing helpers


def _summary(*values):
    return summarize(values)


def test_noise_rule():
    base = _summary(100, 101, 102, 103, 104)
    assert verdict(base, _summary(50, 51, 52, 53, 54)) == "saving"
    assert verdict(base, _summary(150, 151, 152, 153, 154)) == "slower"
    assert verdict(base, _summary(99, 100, 101, 102, 103)) == "within noise"
    c = compare_to_reference(base, _summary(50, 51, 52, 53, 54), step_ms=1.0)
    assert c == Comparison(50.0, 50.0 * 100 / 102, "saving", 5.0)


def test_headline_sentence():
    def m(name, values):
        return Measurement(name, "graph", "gpu", 1, 1, list(values))

    section = {
        "per-layer": m("per-layer", [1400 + i for i in range(5)]),
        "hoisted": m("hoisted", [10 + i for i in range(5)]),
        "fused": m("fused", [1399 + i for i in range(5)]),
    }
    line = headline(section, "graph", "gpu", "cuda", 64, "decode step", 12.0)
    assert "hoisting saves 1.4 ms per decode step at batch 64 (12% of a 12 ms step)" in line
    assert "fusing is within noise of per-layer" in line
    cpu = {k: Measurement(v.strategy, "eager", "host", 1, 1, v.samples_us) for k, v in section.items()}
    line = headline(cpu, "eager", "host", "cpu", 64, "decode step", None)
    # NumPy's timings on the CPU: no claim of what hoisting or fusing saves on a GPU
    assert line.startswith("CPU (NumPy), host wall time of NumPy code, not the GPU kernels: hoisted takes 1.4 ms less")
    assert "saves" not in line and "fusing" not in line and "fused is within noise of per-layer" in line
    assert format_us(0.5) == "0.50 us" and format_us(415) == "415 us" and format_us(1392) == "1.4 ms"


def test_budget_and_block_sizes():
    assert block_size_for(1e-2, 4) == 1
    assert block_size_for(1e-6, 4) == 256
    assert block_size_for(1e-5, 4) % 4 == 0
    b = Budget(seconds=0.0, min_samples=3, max_samples=5)
    assert not b.done(2, 0.0) and b.done(3, 0.0) and b.done(5, 1e18)
    s = summarize(np.arange(1, 101, dtype=float))
    assert s.n == 100 and s.median == 50.5 and s.iqr == pytest.approx(49.5)
