"""The profile-run API: ProfileConfig (settings, validation, recorded options) and run()."""

import dataclasses

import pytest

from kvaddr.errors import ProfileConfigError
from kvaddr.measure import environment
from kvaddr.measure.profile_run import ProfileConfig, Progress, run

NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
FAST = dict(batches=(2, 3), layers=1, budget=0.0, input_sets=2, seed=5)


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


class Recorder(Progress):
    def __init__(self):
        self.events = []

    def note(self, message):
        self.events.append(("note", message))

    def begin(self, total):
        self.events.append(("begin", total))

    def advance(self):
        self.events.append(("advance",))

    def end(self):
        self.events.append(("end",))


def test_run_returns_the_report_and_prints_nothing(capsys):
    config = ProfileConfig(**FAST, device="cpu")
    progress = Recorder()
    doc = run(config, progress)
    assert doc["kind"] == "kvaddr.profile" and [s["batch"] for s in doc["shapes"]] == [2, 3]
    assert doc["options"] == config.recorded_options() and doc["options"]["batches"] == [2, 3]
    assert doc["settings"]["modes"] == ["eager"] and doc["workload"]["num_layers"] == 1
    assert all(s["correctness"]["status"] == "passed" for s in doc["shapes"])
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    kinds = [e[0] for e in progress.events]
    # 2 batch sizes x (5 strategies + the floor) units on the CPU
    assert ("begin", 12) in progress.events and kinds.count("advance") == 12 and kinds[-1] == "end"
    assert any("checking 2 batch size(s)" in e[1] for e in progress.events if e[0] == "note")


def test_one_block_is_not_run_beyond_1024_requests_and_the_report_says_so():
    """Batch 2048 on the CPU path: one-block is left out (and said so), every other strategy checked and timed."""
    from rich.console import Console

    from kvaddr.measure.report import render_report

    progress = Recorder()
    config = ProfileConfig(batches=(1024, 2048), layers=1, budget=0.0, input_sets=1, seed=3, device="cpu")
    doc = run(config, progress)
    small, big = doc["shapes"]
    assert "skipped" not in small and "one-block" in small["correctness"]["strategies"]
    assert "one-block" in {r["strategy"] for r in small["results"]}
    assert big["skipped"] == {"one-block": "not run: one-block runs at most 1024 requests"}
    assert big["correctness"]["strategies"] == ["per-layer", "per-layer-kernel", "hoisted", "fused"]
    assert [r["strategy"] for r in big["results"]] == ["per-layer", "per-layer-kernel", "hoisted", "fused", "floor"]
    # 6 units at batch 1024, 5 at 2048 (one-block not run)
    assert ("begin", 11) in progress.events and [e[0] for e in progress.events].count("advance") == 11
    console = Console(record=True, width=160)
    render_report(console, doc)
    text = console.export_text()
    lines = [ln.split() for ln in text.splitlines()]
    at_2048 = text[text.index("batch 2048") :]
    assert "one-block: not run: one-block runs at most 1024 requests (batch 2048)." in at_2048
    row = next(ln for ln in at_2048.splitlines() if ln.startswith("one-block "))
    assert row.split() == ["one-block", "-", "not", "run", "-"]  # no floor column on the CPU
    names = [ln[0] for ln in lines if ln and ln[0] in ("hoisted", "one-block", "fused")]
    assert names == ["hoisted", "one-block", "fused"] * 2  # in strategy order, at both batches


def test_auto_without_a_gpu_says_so_and_graph_mode_falls_back():
    progress = Recorder()
    doc = run(ProfileConfig(**FAST, mode="graph"), progress)
    notes = [e[1] for e in progress.events if e[0] == "note"]
    assert notes[0].startswith("no CUDA device found: CuPy is not importable (test); profiling")
    assert "graph mode needs a CUDA device" in notes[1]
    assert doc["settings"]["modes"] == ["eager"]


def test_the_recorded_options_replay_to_the_same_config():
    config = ProfileConfig(**FAST, prefill=(1, 16), block_sizes=(16, 32), step_ms=1.5, device="cpu")
    again = ProfileConfig.from_recorded(config.recorded_options())
    assert again == config
    assert ProfileConfig.from_recorded(config.recorded_options(), budget=0.5).budget == 0.5
    # nulls take the defaults; unknown names are listed, not taken
    options = {**config.recorded_options(), "layers": None, "not_an_option_yet": ["mla"]}
    assert ProfileConfig.unknown_options(options) == ["not_an_option_yet"]
    assert ProfileConfig.from_recorded(options).layers is None


def test_recorded_options_keep_the_given_order():
    config = ProfileConfig(**FAST, option_order=("seed", "layers"))
    assert list(config.recorded_options())[:2] == ["seed", "layers"]
    # every setting of the core engine, none of the vLLM engine's
    assert set(config.recorded_options()) == set(ProfileConfig.settings_of("core"))
    assert "engine" in config.recorded_options() and "groups" not in config.recorded_options()


@pytest.mark.parametrize(
    "changes, fields, words",
    [
        (dict(layers=0), ("layers",), "layers must be an integer in [1, 4096], got 0"),
        (dict(layers=True), ("layers",), "layers must be an integer"),
        (dict(layers="2"), ("layers",), "layers must be an integer"),
        (dict(batches=()), ("batches",), "non-empty list"),
        (dict(context=(10, 5)), ("context",), "LO <= HI"),
        (dict(budget=float("nan")), ("budget",), "finite"),
        (dict(step_ms=0.0), ("step_ms",), "step_ms must be in (0"),
        (dict(model="gpt-9"), ("model",), "model must be one of"),
        (dict(caches=5), ("caches",), "[1, 4]"),
        (dict(prefill=(3, 8)), ("prefill",), "N = 3 prefill requests do not fit in batch 2"),
        (dict(block_sizes=(16, 32, 64), caches=2), ("block_sizes",), "got 3 block sizes for 2 caches"),
        (dict(context=(1 << 30, 1 << 30), batches=(100000,)), ("context", "block_sizes"), "exceeds 67108864"),
    ],
)
def test_validate_names_the_setting(changes, fields, words):
    config = dataclasses.replace(ProfileConfig(**FAST), **changes)
    with pytest.raises(ProfileConfigError) as err:
        config.validate()
    assert err.value.fields == fields and words in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(ProfileConfigError):
        run(config)
