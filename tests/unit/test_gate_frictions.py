"""Frictions of the gate commands, each fixed and held here.

* ``kvaddr check`` prints the ``kvaddr profile`` command it replays; pasted, it parses
  (an empty ``--attention`` was printed bare and swallowed the next option).
* ``--allow-env-mismatch`` cannot make a CPU-only machine time a GPU baseline; ``check`` says so.
* A trace (JSON Lines, gzip or not) given to ``compare``, ``check`` or ``sweep --from`` is named
  as a trace, not reported as a file that is not UTF-8 or not JSON.
* A workload field that is null reads "none", not "unknown".
"""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.commands import gate
from kvaddr.commands.profile import profile as profile_command
from kvaddr.gate.baseline_file import Difference
from kvaddr.measure import environment

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
HEADER = {"kvaddr_trace": 1, "block_sizes": [64, 64], "model": "deepseek-v3.2"}
STEP = {"step": 0, "seq_lens_decoder": [5], "seq_lens_this_time": [1], "block_tables": [[7]]}


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    return CliRunner().invoke(cli_module.cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def cpu_baseline(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "base.json"
    r = CliRunner().invoke(
        cli_module.cli,
        ["profile", "--device", "cpu", "--batch", "1", "--layers", "2", "--budget", "0", "--save", str(path)],
    )
    assert r.exit_code == 0, r.output
    return path


# ----------------------------------------------------------------------------- the printed command parses


@pytest.mark.parametrize("attention", [[], ["flashinfer", "varlen"]])
def test_the_replayed_command_line_parses_and_repeats_the_run(cpu_baseline, attention):
    run_doc = json.loads(cpu_baseline.read_text())["runs"][0]
    run_doc["options"]["attention"] = attention
    for budget in (None, 0.25):
        config = gate.replay_config(run_doc, budget)
        line = gate.profile_command_line(config, budget is not None)
        ctx = profile_command.make_context("profile", shlex.split(line))  # raises on a line that does not parse
        assert ctx.params["device"] == "cpu" and ctx.params["layers"] == 2
        assert tuple(ctx.params["attention"]) == tuple(attention)
        if budget is not None:
            assert ctx.params["budget"] == budget


def test_check_prints_a_command_that_parses(cpu_baseline):
    r = run("check", "--baseline", cpu_baseline, "--budget", "0")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stderr.splitlines() if "run 1/1" in x).split(": kvaddr profile ", 1)[1]
    assert "--attention" not in line.split()  # the default, none, is not printed
    profile_command.make_context("profile", shlex.split(line))


# ----------------------------------------------------------------------------- --allow-env-mismatch on a CPU


@pytest.mark.parametrize("allow", [False, True])
def test_a_gpu_baseline_on_a_cpu_only_machine_says_why_allow_env_mismatch_cannot_help(allow):
    args = ["check", "--baseline", ROOT / "profiles" / "baselines" / "h200.json"]
    r = run(*args, *(["--allow-env-mismatch"] if allow else []))
    assert r.exit_code == 3, r.output
    text = " ".join(r.stderr.split())
    assert "no usable CUDA device" in text
    assert f"--allow-env-mismatch {'cannot help' if allow else 'does not help'} here" in text
    assert "a CPU-only machine cannot time them" in text and "--device cpu --save" in text


# ----------------------------------------------------------------------------- a trace is named as one


def _trace(path: Path, gz: bool) -> Path:
    text = "\n".join(json.dumps(x) for x in (HEADER, STEP)) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_a_trace_given_as_a_report_is_named_a_trace(cpu_baseline, tmp_path, gz):
    trace = _trace(tmp_path / ("steps.jsonl.gz" if gz else "steps.jsonl"), gz)
    for args in (
        ["compare", cpu_baseline, trace],
        ["compare", trace, cpu_baseline],
        ["check", "--baseline", trace],
        ["sweep", "--from", trace],
    ):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        text = " ".join(r.output.split())
        assert "is a kvaddr trace" in text and "kvaddr replay" in text, (args, text)
        assert "UTF-8" not in text and "utf-8" not in text and "not JSON" not in text


def test_a_file_that_is_neither_still_says_not_json(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x1f\x8bnot really gzip")
    r = run("compare", junk, junk)
    assert r.exit_code == 2 and "is not JSON" in " ".join(r.output.split())


# ----------------------------------------------------------------------------- a null workload field


def test_a_workload_without_prefill_reads_none():
    text = Difference("workload.prefill", None, [2, 512]).describe()
    assert text == "workload.prefill: none (no chunked-prefill requests) (baseline) vs [2, 512] (new)"
    assert "unknown" not in Difference("workload.block_sizes", [64], None).describe()
    # an environment field nobody recorded is still unknown
    assert Difference("environment.git_commit", None, "abc").describe().startswith("environment.git_commit: unknown")
