"""`kvaddr sweep`: profile over batch sizes, the terminal chart, --json, --from and the --plot image."""

import copy
import json

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment, plot
from kvaddr.measure.sweep import panels, title
from tests.support import skips

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
    status = [line for line in r.stderr.splitlines() if line.startswith("kvaddr ")]
    assert status and all(line.startswith("kvaddr sweep: ") for line in status), status


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
    assert r.exit_code == 2 and "--from" in r.stderr and "nor a kvaddr profile report" in r.stderr


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
    pytest.importorskip("matplotlib", reason=skips.NO_PLOT)
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
    assert title(doc).startswith("NVIDIA H200: deepseek-v3.2, 1 layer x 2 caches")
    pytest.importorskip("matplotlib", reason=skips.NO_PLOT)
    plot.plot_sweep(doc, str(tmp_path / "two.png"))
    assert (tmp_path / "two.png").stat().st_size > 10_000


def _with_a_negative_saving(report):
    doc = json.loads(open(report).read())
    for s in doc["shapes"]:
        for r in s["results"]:
            if r["strategy"] == "fused" and r.get("vs_per_layer"):
                r["vs_per_layer"] = dict(r["vs_per_layer"], saved_us=-3.0)
    return doc


def test_the_plot_says_microseconds_and_draws_zero_when_a_saving_is_negative(report, tmp_path):
    pytest.importorskip("matplotlib", reason=skips.NO_PLOT)
    fig = plot.plot_sweep(_with_a_negative_saving(report), str(tmp_path / "neg.png"))
    (ax,) = fig.axes
    assert ax.get_ylabel().endswith("(µs)") and "(us)" not in ax.get_ylabel()
    assert ax.get_yscale() == "linear"
    zero_lines = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [0, 0]]
    assert len(zero_lines) == 1


def test_no_zero_line_on_a_log_axis_when_every_saving_is_positive(report, tmp_path):
    pytest.importorskip("matplotlib", reason=skips.NO_PLOT)
    doc = json.loads(open(report).read())
    for s in doc["shapes"]:
        for r in s["results"]:
            if r.get("vs_per_layer"):
                r["vs_per_layer"] = dict(r["vs_per_layer"], saved_us=5.0)
    fig = plot.plot_sweep(doc, str(tmp_path / "pos.png"))
    (ax,) = fig.axes
    assert ax.get_yscale() == "log" and ax.get_ylabel().endswith("(µs)")
    assert not [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [0, 0]]


def test_counts_are_singular_for_one():
    from kvaddr.measure.report import count

    assert count(1, "cache") == "1 cache" and count(2, "cache") == "2 caches" and count(0, "layer") == "0 layers"
    assert count("?", "layer") == "? layers"
    r = run("profile", "--device", "cpu", "--batch", "1", "--layers", "1", "--caches", "1", "--budget", "0")
    assert r.exit_code == 0, r.output
    assert "1 layer x 1 cache (B = 64), 1 token/step" in r.stdout
    assert "1 caches" not in r.stdout and "1 layers" not in r.stdout and "1 tokens" not in r.stdout
