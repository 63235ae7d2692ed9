"""kvaddr profile --save, kvaddr compare and kvaddr check on the CPU path, through click's CliRunner.

Timing on a shared CPU is noisy, so no test here relies on two runs timing
alike: "nothing slower" is shown by comparing a file with itself or by
checking against a baseline recorded with every strategy slowed down, and
"slower" by slowing one strategy twenty times over.
"""

import contextlib
import importlib.util
import json
import os

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment
from kvaddr.strategies import cpu as cpu_strategies

FAST = ["--device", "cpu", "--layers", "1", "--budget", "0", "--batch", "4"]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
STRATEGIES = ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    result = CliRunner().invoke(cli_module.cli, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@contextlib.contextmanager
def slowed(monkeypatch, names, repeat=20):
    """CPU strategies in ``names`` run their step ``repeat`` times."""
    real = cpu_strategies.make_strategy

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, *args, **kwargs):
            for _ in range(repeat - 1):
                self.inner.step(*args, **kwargs)
            return self.inner.step(*args, **kwargs)

    def make(name, **kw):
        s = real(name, **kw)
        return Slow(s) if name in names else s

    with monkeypatch.context() as m:
        m.setattr(cpu_strategies, "make_strategy", make)
        yield


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.json"
    r = run("profile", *FAST, "--save", path)
    assert r.exit_code == 0, r.output
    return path


@pytest.fixture
def slow_base(tmp_path, monkeypatch):
    """A baseline recorded with every strategy 20 times slower: anything now is faster."""
    path = tmp_path / "slow-base.json"
    with slowed(monkeypatch, STRATEGIES):
        r = run("profile", *FAST, "--save", path)
    assert r.exit_code == 0, r.output
    return path


def edit(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


# ----------------------------------------------------------------------------- profile --save


def test_save_writes_a_baseline_with_environment_workload_and_samples(base, tmp_path):
    doc = json.loads(base.read_text())
    assert doc["kind"] == "kvaddr.baseline" and doc["baseline_format"] == 1
    (run_doc,) = doc["runs"]
    assert run_doc["kind"] == "kvaddr.profile" and run_doc["schema_version"] == 1
    env = run_doc["environment"]
    for key in ("device", "gpu", "driver_version", "cuda_driver", "cuda_runtime", "cupy", "kvaddr", "git_commit"):
        assert key in env
    assert run_doc["workload"]["num_layers"] == 1
    assert run_doc["options"]["batches"] == [4] and run_doc["options"]["device"] == "cpu"
    for r in run_doc["shapes"][0]["results"]:
        assert len(r["samples_us"]) == r["summary"]["n"] >= 10


def test_save_adds_other_workloads_and_replaces_the_same_one(base):
    r = run("profile", *FAST, "--model", "glm-5", "--save", base)
    assert r.exit_code == 0 and "added run 2 (glm-5)" in r.stderr
    r = run("profile", *FAST, "--save", base)
    assert r.exit_code == 0 and "replaced run 1 (deepseek-v3.2)" in r.stderr
    assert [x["workload"]["model"] for x in json.loads(base.read_text())["runs"]] == ["deepseek-v3.2", "glm-5"]


def test_save_with_json_to_stdout_keeps_stdout_one_document(tmp_path):
    r = run("profile", *FAST, "--json", "-", "--save", tmp_path / "b.json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["kind"] == "kvaddr.profile"


@pytest.mark.parametrize(
    "target, message",
    [
        ("missing-dir/b.json", "does not exist"),
        ("report.txt", "not a kvaddr baseline"),
    ],
)
def test_save_refuses_bad_targets_before_profiling(tmp_path, target, message):
    (tmp_path / "report.txt").write_text("precious")
    r = run("profile", *FAST, "--save", tmp_path / target)
    assert r.exit_code == 2 and "--save" in r.stderr and message in r.stderr
    assert "checking" not in r.stderr
    assert (tmp_path / "report.txt").read_text() == "precious"


def test_save_into_another_machines_baseline_exits_3(base):
    edit(base, lambda d: d["runs"][0]["environment"].update(cpu="another-cpu"))
    r = run("profile", *FAST, "--save", base)
    assert r.exit_code == 3 and "another-cpu" in r.stderr and "another file" in r.stderr


# ----------------------------------------------------------------------------- compare


def test_compare_a_file_with_itself_exits_0_with_a_table(base):
    r = run("compare", base, base)
    assert r.exit_code == 0, r.output
    verdicts = [line.split()[-2] for line in r.stdout.splitlines() if "x1.000" in line]
    assert verdicts == ["same"] * 6, r.stdout  # the floor row too
    for word in (
        "strategy",
        "measure",
        "new/base",
        "verdict",
        "gated",
        "deepseek-v3.2, batch 4",
        "x1.000",
    ) + STRATEGIES:
        assert word in r.stdout
    assert "0 slower" in r.stderr and "SLOWER" not in r.stderr


def test_compare_json_is_one_document(base):
    r = run("compare", base, base, "--json", "-")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["kind"] == "kvaddr.comparison" and doc["exit_code"] == 0
    assert doc["settings"]["factor"] == 1.1 and doc["settings"]["alpha"] == 0.01
    assert doc["settings"]["gated_measures"] == {"deepseek-v3.2": []}  # --gate auto: nothing on the CPU path
    assert "--gate auto gates nothing of run 'deepseek-v3.2' (the CPU path" in doc["settings"]["gate_notes"][0]
    assert doc["environment_check"]["status"] == "match"
    assert len(doc["results"]) == 6
    for row in doc["results"]:  # identical samples are "same", the floor's included
        assert row["verdict"] == "same" and row["ratio"] == 1.0 and row["p_value"] == 1.0
        assert row["base"]["n"] >= 10 and row["line"].startswith("deepseek-v3.2, batch 4: ")
    assert {row["gated"] for row in doc["results"] if row["strategy"] == "floor"} == {False}


def test_compare_slower_exits_1_naming_shape_strategy_and_mode(base, tmp_path, monkeypatch):
    new = tmp_path / "new.json"
    with slowed(monkeypatch, ("fused",)):
        assert run("profile", *FAST, "--save", new).exit_code == 0
    r = run("compare", base, new, "--json", tmp_path / "cmp.json", "--gate", "eager:host")
    assert r.exit_code == 1, r.output
    assert "SLOWER: deepseek-v3.2, batch 4: fused, eager mode, host clock: slower" in r.stderr
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert doc["exit_code"] == 1 and any("fused" in line for line in doc["slower"])
    assert "fused" in r.stdout  # the table still goes to stdout


def test_an_improvement_is_faster_and_exits_0(slow_base, base):
    r = run("compare", slow_base, base, "--json", "-")
    assert r.exit_code == 0
    verdicts = {row["strategy"]: row["verdict"] for row in json.loads(r.stdout)["results"]}
    assert {verdicts[s] for s in STRATEGIES} == {"faster"}


@pytest.mark.parametrize(
    "args, hint",
    [
        (["--factor", "1"], "--factor"),
        (["--factor", "0.5"], "--factor"),
        (["--factor", "nan"], "--factor"),
        (["--alpha", "0"], "--alpha"),
        (["--alpha", "1.5"], "--alpha"),
        (["--gate", "graph:host"], "--gate"),
        (["--json", "/nonexistent-dir/x.json"], "--json"),
    ],
)
def test_compare_usage_errors_exit_2(base, args, hint):
    r = run("compare", base, base, *args)
    assert r.exit_code == 2 and hint in r.stderr and r.stdout == ""


def test_compare_bad_files_exit_2(base, tmp_path):
    (tmp_path / "x.json").write_text("{}")
    for path, message in ((tmp_path / "missing.json", "no such file"), (tmp_path / "x.json", "neither")):
        r = run("compare", base, path)
        assert r.exit_code == 2 and message in r.stderr and r.stdout == ""
    assert run("compare", base).exit_code == 2


def test_compare_environment_mismatch_exits_3_unless_allowed(base, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(base.read_text())
    edit(other, lambda d: d["runs"][0]["environment"].update(cpu="another-cpu"))
    r = run("compare", base, other)
    assert r.exit_code == 3 and "MISMATCH" in r.stderr and "environment.cpu" in r.stderr and "another-cpu" in r.stderr
    assert r.stdout == ""
    r = run("compare", base, other, "--json", "-")
    assert r.exit_code == 3 and json.loads(r.stdout)["environment_check"]["status"] == "mismatch"
    r = run("compare", base, other, "--allow-env-mismatch")
    assert r.exit_code == 0 and "mismatch (allowed)" in r.stderr and "x1.000" in r.stdout
    r = run("compare", base, other, "--relative")  # the machine may differ in relative mode
    assert r.exit_code == 0 and "fused / floor" in r.stdout and "note" in r.stderr


def test_compare_workload_mismatch_exits_3_even_relative(base, tmp_path):
    other = tmp_path / "other.json"
    assert run("profile", *FAST[:-1], "8", "--save", other).exit_code == 0  # batch 8 instead of 4
    for extra in ([], ["--relative"]):
        r = run("compare", base, other, *extra)
        assert r.exit_code == 3 and "settings.batches" in r.stderr


# ----------------------------------------------------------------------------- check


def test_check_replays_the_baseline_and_exits_0_when_nothing_is_slower(slow_base, tmp_path):
    r = run("check", "--baseline", slow_base, "--save", tmp_path / "new.json")
    assert r.exit_code == 0, r.output
    assert "kvaddr profile --layers 1 --budget 0.0 --batch 4" in r.stderr and "--device cpu" in r.stderr
    assert "faster" in r.stdout and "0 slower" in r.stderr
    new = json.loads((tmp_path / "new.json").read_text())["runs"][0]
    old = json.loads(slow_base.read_text())["runs"][0]
    assert new["workload"] == old["workload"] and new["settings"]["batches"] == [4]


def test_check_slower_exits_1_naming_shape_and_strategy(base, monkeypatch):
    with slowed(monkeypatch, ("fused",)):
        r = run("check", "--baseline", base, "--gate", "eager:host")
    assert r.exit_code == 1, r.output
    assert "SLOWER: deepseek-v3.2, batch 4: fused, eager mode, host clock" in r.stderr


def test_check_relative_and_json(slow_base):
    r = run("check", "--baseline", slow_base, "--relative", "--json", "-", "--budget", "0")
    assert r.exit_code in (0, 1)  # ratios to a 0.1 us floor call are noise on a CPU; the shape of the output:
    doc = json.loads(r.stdout)
    assert doc["command"] == "check" and doc["settings"]["relative"] is True
    assert {row["quantity"] for row in doc["results"]} >= {"fused / floor", "fused / per-layer"}
    assert doc["exit_code"] == r.exit_code


def test_check_environment_mismatch_exits_3_before_profiling(slow_base):
    edit(slow_base, lambda d: d["runs"][0]["environment"].update(cpu="another-cpu"))
    r = run("check", "--baseline", slow_base)
    assert r.exit_code == 3 and "environment.cpu" in r.stderr
    assert "kvaddr profile" not in r.stderr  # nothing was measured
    r = run("check", "--baseline", slow_base, "--allow-env-mismatch")
    assert r.exit_code == 0 and "mismatch (allowed)" in r.stderr


def test_check_a_gpu_baseline_without_a_gpu_exits_3(base):
    edit(base, lambda d: d["runs"][0]["environment"].update(device="cuda"))
    r = run("check", "--baseline", base)
    assert r.exit_code == 3 and "no usable CUDA device" in r.stderr


def test_check_usage_errors_exit_2(base, tmp_path):
    assert run("check").exit_code == 2
    r = run("check", "--baseline", tmp_path / "missing.json")
    assert r.exit_code == 2 and "no such file" in r.stderr
    r = run("check", "--baseline", base, "--factor", "0.9")
    assert r.exit_code == 2 and "--factor" in r.stderr
    edit(base, lambda d: d["runs"][0]["options"].update(layers=0))
    r = run("check", "--baseline", base)
    assert r.exit_code == 2 and "do not replay" in r.stderr and "--layers" in r.stderr


def test_check_a_wrong_result_exits_1(base, monkeypatch):
    real = cpu_strategies.make_strategy

    def make(name, **kw):
        s = real(name, **kw)
        if name == "hoisted":
            step = s.step

            def bad(*a, **k):
                out = step(*a, **k)
                out.slot_mapping = out.slot_mapping.copy()
                out.slot_mapping[0, 0] += 1
                return out

            s.step = bad
        return s

    monkeypatch.setattr(cpu_strategies, "make_strategy", make)
    r = run("check", "--baseline", base)
    assert r.exit_code == 1 and "check failed" in r.stderr and "'hoisted'" in r.stderr
    assert r.stdout == ""


def test_help_documents_the_rule_and_exit_codes():
    text = " ".join(run("check", "--help").stdout.split())
    for phrase in (
        "Mann-Whitney",
        "0 nothing gated is slower",
        "1 something gated is slower",
        "2 usage error",
        "3 the baseline's GPU, driver or workload does not match",
        "--relative",
        "--gate",
    ):
        assert phrase in text
    assert "--save" in run("profile", "--help").stdout


# ----------------------------------------------------------------------------- scripts/gpu/slow_fused_check.py


def test_slow_fused_check_is_caught_on_the_cpu(base, capsys):
    spec = importlib.util.spec_from_file_location(
        "slow_fused_check", os.path.join(HERE, "..", "..", "scripts", "gpu", "slow_fused_check.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = cpu_strategies.Fused.step
    code = mod.main(["--baseline", str(base), "--cpu-repeats", "19", "--gate", "eager:host"])
    assert cpu_strategies.Fused.step is before  # unpatched afterwards
    err = capsys.readouterr().err
    assert code == 1, err
    assert "SLOWER: deepseek-v3.2, batch 4: fused" in err and "was caught" in err


# ----------------------------------------------------------------------------- the GPU flow, on a fake CuPy


GPU_FAST = ["--layers", "1", "--budget", "0", "--batch", "4"]


def test_gpu_check_gates_graph_mode_and_names_a_slower_fused_step(fake_gpu, tmp_path, monkeypatch):
    slow_base, base = tmp_path / "slow.json", tmp_path / "base.json"
    with slowed(monkeypatch, STRATEGIES):
        assert run("profile", *GPU_FAST, "--save", slow_base).exit_code == 0
    assert run("profile", *GPU_FAST, "--save", base).exit_code == 0
    run_doc = json.loads(base.read_text())["runs"][0]
    assert run_doc["environment"]["device"] == "cuda" and run_doc["environment"]["gpu"]["name"] == "Fake H200"
    assert "driver_version" in run_doc["environment"]

    r = run("check", "--baseline", slow_base, "--json", "-")
    assert r.exit_code == 0, r.output
    assert "--device cuda" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["settings"]["gated_measures"] == {"deepseek-v3.2": ["graph:gpu"]}
    assert {(x["mode"], x["clock"]) for x in doc["results"] if x["gated"]} == {("graph", "gpu")}
    assert {(x["mode"], x["clock"]) for x in doc["results"]} == {("graph", "gpu"), ("eager", "host"), ("eager", "gpu")}

    with slowed(monkeypatch, ("fused",)):
        r = run("check", "--baseline", base)
    assert r.exit_code == 1, r.output
    assert "SLOWER: deepseek-v3.2, batch 4: fused, graph mode, GPU clock: slower" in r.stderr


def test_the_shipped_h200_baseline_loads_and_compares_with_itself():
    """profiles/baselines/h200.json (recorded on an H200) is a valid baseline: the default
    DeepSeek-V3.2 decode workload and the mixed chunked-prefill profile, every row the same as itself."""
    path = os.path.join(HERE, "..", "..", "profiles", "baselines", "h200.json")
    r = run("compare", path, path, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 0 and doc["environment_check"]["status"] == "match"
    workloads = {row["line"].split(",")[0] for row in doc["results"]}
    assert workloads == {"deepseek-v3.2", "mixed-chunked-prefill"}
    assert {row["verdict"] for row in doc["results"]} <= {"same", "ambiguous"}
    assert all(row["ratio"] == 1.0 for row in doc["results"])
    base = json.load(open(path))
    gpus = {str(run_["environment"].get("gpu", {}).get("name", run_["environment"])) for run_ in base["runs"]}
    assert all("H200" in g for g in gpus), gpus


# ----------------------------------------------------------------------------- no false alarms on the CPU


def test_save_then_check_on_the_cpu_path_never_exits_1(tmp_path):
    """`profile --save` then `check` at once, repeatedly: host time on a CPU moves by x1.3-2.1 between runs,
    so --gate auto gates nothing there, says so in one line, and still reports every verdict."""
    for i in range(5):
        path = tmp_path / f"b{i}.json"
        r = run("profile", "--device", "cpu", "--layers", "1", "--budget", "0.05", "--batch", "8", "--save", path)
        assert r.exit_code == 0, r.output
        r = run("check", "--baseline", path, "--json", tmp_path / f"c{i}.json")
        assert r.exit_code == 0, r.output
        notes = [line for line in r.stderr.splitlines() if "--gate auto gates nothing" in line]
        assert len(notes) == 1 and "the CPU path" in notes[0] and "--gate eager:host" in notes[0], r.stderr
        doc = json.loads((tmp_path / f"c{i}.json").read_text())
        assert doc["exit_code"] == 0 and doc["counts"]["gated"]["slower"] == 0
        assert len(doc["results"]) == 6 and not any(row["gated"] for row in doc["results"])


def test_an_explicit_gate_still_gates_the_cpu_path(base, monkeypatch):
    with slowed(monkeypatch, ("fused",)):
        r = run("check", "--baseline", base, "--gate", "all")
    assert r.exit_code == 1 and "SLOWER: deepseek-v3.2, batch 4: fused, eager mode, host clock" in r.stderr
    assert "--gate auto gates nothing" not in r.stderr
