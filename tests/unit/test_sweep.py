"""`kvaddr sweep`: profile over batch sizes, the terminal chart, --json, --from and the --plot image."""

import copy
import json

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment, plot
from kvaddr.measure.sweep import panels, title

NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
FAST = ["--layers", "1", "--budget", "0", "--batch", "1,2"]


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "r.json"
    r = CliRunner().invoke(cli_module.cli, ["sweep", *FAST, "--batch", "1,2,4", "--json", str(path), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    return str(path)


def test_sweep_prints_each_batch_and_the_chart(tmp_path):
    r = run("sweep", *FAST)
    assert r.exit_code == 0, r.output
    assert "batch 1:" in r.stdout and "batch 2:" in r.stdout  # the profile tables
    assert "saved per step against batch size" in r.stdout
    assert "CPU (NumPy), host wall time" in r.stdout
    for name in ("per-layer-kernel", "hoisted", "fused"):
        assert name in r.stdout
    assert "Traceback" not in r.output


def test_sweep_json_is_a_profile_report_plus_the_series(report):
    doc = json.loads(open(report).read())
    assert doc["kind"] == "kvaddr.profile" and [s["batch"] for s in doc["shapes"]] == [1, 2, 4]
    sw = doc["sweep"]
    (p,) = sw["panels"]  # the CPU path: eager only
    assert (p["mode"], p["clock"], p["batches"]) == ("eager", "host", [1, 2, 4])
    assert set(p["series"]) == {"per-layer-kernel", "hoisted", "one-block", "fused"}
    assert all(len(v) == 3 for v in p["series"].values()) and len(p["baseline_us"]) == 3
    assert "CPU (NumPy)" in sw["title"] and "deepseek-v3.2" in sw["title"]


def test_sweep_json_to_stdout_holds_nothing_else():
    r = run("sweep", *FAST, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["sweep"]["panels"]


def test_sweep_from_a_report_profiles_nothing(report):
    r = run("sweep", "--from", report)
    assert r.exit_code == 0, r.output
    assert "saved per step against batch size" in r.stdout
    assert "checking" not in r.stderr


def test_sweep_from_something_else(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "kvaddr.replay"}')
    r = run("sweep", "--from", str(bad))
    assert r.exit_code == 2 and "not a kvaddr profile JSON report" in r.stderr


def test_sweep_takes_profile_options_and_profiles():
    r = run("sweep", "--profile", "deepseek-v3.2-mtp", *FAST, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["workload"]["spec_tokens"] == 1 and [s["batch"] for s in doc["shapes"]] == [1, 2]
    r = run("sweep", "--batch", "0")
    assert r.exit_code == 2 and "--batch" in r.stderr


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(plot, "matplotlib_version", lambda: None)
    r = run("sweep", *FAST, "--plot", str(tmp_path / "s.png"))
    assert r.exit_code == 3
    assert "pip install 'kvaddr[plot]'" in r.stderr and r.stdout == ""
    assert not (tmp_path / "s.png").exists()


def test_plot_to_a_missing_folder_is_a_usage_error():
    r = run("sweep", *FAST, "--plot", "/nonexistent-dir/s.png")
    assert r.exit_code == 2 and "--plot" in r.stderr


def test_the_plot_is_written_and_not_empty(report, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the optional [plot] extra)")
    out = tmp_path / "s.png"
    r = run("sweep", "--from", report, "--plot", str(out), "--no-chart")
    assert r.exit_code == 0, r.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert r.stdout == ""


def test_two_panels_and_the_gpu_in_the_title(report, tmp_path):
    doc = json.loads(open(report).read())
    doc["environment"] = dict(doc["environment"], device="cuda", gpu={"name": "NVIDIA H200"})
    for s in doc["shapes"]:
        s["results"] += [dict(copy.deepcopy(x), mode="graph", clock="gpu") for x in s["results"]]
    ps = panels(doc)
    assert [(p["mode"], p["clock"]) for p in ps] == [("eager", "host"), ("graph", "gpu")]
    assert title(doc).startswith("NVIDIA H200: deepseek-v3.2, 1 layers x 2 caches")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the optional [plot] extra)")
    plot.plot_sweep(doc, str(tmp_path / "two.png"))
    assert (tmp_path / "two.png").stat().st_size > 10_000
