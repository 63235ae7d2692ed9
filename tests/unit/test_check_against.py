"""``kvaddr check --against REV`` end to end on the CPU, against a small git repository made here.

The repository holds a copy of this kvaddr: a first commit without any kvaddr, then one whose
NumPy fused step is slowed by a 0.4 ms spin, then an ordinary commit (HEAD); tags mark a tree whose
profile fails once it runs, and one whose profile has no ``--seed`` option. The running kvaddr is
the new side, so the slowed revision's fused step must come out slower than this tree's: a
"faster" verdict, found by real processes interleaved round by round.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.gate import ab

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--batch", "1", "--layers", "2", "--budget", "0.02"]
SPIN = (
    "        import time as _spin_time\n"
    "        _until = _spin_time.perf_counter() + 4e-4\n"
    "        while _spin_time.perf_counter() < _until:\n"
    "            pass\n"
)
GIT_ENV = {
    "GIT_AUTHOR_NAME": "kvaddr tests",
    "GIT_AUTHOR_EMAIL": "tests@example.invalid",
    "GIT_COMMITTER_NAME": "kvaddr tests",
    "GIT_COMMITTER_EMAIL": "tests@example.invalid",
}


def git(repo, *args) -> str:
    env = {**os.environ, **GIT_ENV}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def patch(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("needs git and tar")
    repo = tmp_path_factory.mktemp("repo")
    git(repo, "init", "-q")
    (repo / "README.md").write_text("a project before kvaddr\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "before kvaddr")
    git(repo, "tag", "no-kvaddr")
    shutil.copytree(ROOT / "kvaddr", repo / "kvaddr", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", repo / "setup.cfg")
    fused = repo / "kvaddr" / "strategies" / "cpu.py"
    head = '    name = "fused"\n\n    def step(self, seq_lens_decoder, seq_lens_this_time, block_tables, *, seq_lens_encoder=None, stream=None):\n'
    patch(fused, head, head + SPIN)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "kvaddr, its fused step slowed")
    (repo / "README.md").write_text("a project with kvaddr\n")
    git(repo, "commit", "-q", "-am", "an ordinary change")
    # a tree whose profile fails once it runs, and one whose profile has no --seed
    git(repo, "checkout", "-q", "-b", "side")
    patch(
        repo / "kvaddr" / "measure" / "profile_run.py",
        "    started = time.perf_counter()\n    progress = progress or Progress()\n",
        '    raise RuntimeError("a planted failure")\n    started = time.perf_counter()\n',
    )
    git(repo, "commit", "-q", "-am", "a profile that fails")
    git(repo, "tag", "fails")
    git(repo, "checkout", "-q", "HEAD~1")
    patch(repo / "kvaddr" / "commands" / "profile.py", '"--seed", type=', '"--rng-seed", "seed", type=')
    git(repo, "commit", "-q", "-am", "a profile without --seed")
    git(repo, "tag", "no-seed")
    git(repo, "checkout", "-q", "main" if "main" in git(repo, "branch") else "master")
    return repo


@pytest.fixture
def in_repo(repo, tmp_path, monkeypatch):
    """Run in the repository, with temporary folders made under ``tmp_path/tmp`` (checked empty after)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(repo)
    yield tmp
    assert list(tmp.iterdir()) == [], "the revision's temporary tree was left behind"
    assert git(repo, "status", "--porcelain", "--ignored") == "", "something was written into the repository"


def run(*args):
    return CliRunner().invoke(cli_module.cli, ["check", *map(str, args)])


def no_timing(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a profile was timed")

    monkeypatch.setattr(ab, "profile_once", refuse)


def test_against_the_slowed_parent_finds_this_tree_faster(repo, in_repo, tmp_path):
    verdicts = tmp_path / "verdicts.json"
    # on the CPU nothing is gated by default (host time moves between processes by more than the factor)
    r = run("--against", "HEAD~1", *TINY, "--rounds", "2", "--json", verdicts)
    assert r.exit_code == 0, r.output
    doc = json.loads(verdicts.read_text())
    assert doc["exit_code"] == 0 and doc["command"] == "check"
    against = doc["against"]
    assert against["commit"] == git(repo, "rev-parse", "HEAD~1") and against["rounds"] == 2
    assert against["wall_s"] > 0 and against["budget_s"] == 0.02
    rows = {row["strategy"]: row for row in doc["results"]}
    assert rows["fused"]["verdict"] == "faster" and not rows["fused"]["gated"]
    assert doc["counts"]["gated"]["slower"] == 0 and "gates nothing" in r.stderr
    spread = rows["fused"]["round_spread"]
    assert len(spread["base_round_medians"]) == 2 and len(spread["new_round_medians"]) == 2
    assert spread["base"] >= 1.0 and spread["new"] >= 1.0
    assert rows["fused"]["base"]["median"] > 300  # the 0.4 ms spin is the base's
    # the table on stdout, the A/B's wall time and the rounds on stderr
    assert "base rounds" in r.stdout and "fused" in r.stdout and "faster" in r.stdout
    assert "round 2/2" in r.stderr and "the A/B run took" in r.stderr
    assert f"HEAD~1 ({against['commit'][:12]})" in r.stderr


@pytest.mark.parametrize(
    ("rev", "extra", "message"),
    [
        ("no-such-revision", [], "names no commit"),
        ("no-kvaddr", [], "has no kvaddr package"),
        ("no-seed", ["--seed", "3"], "has no --seed option"),
    ],
    ids=["no-such-revision", "no-kvaddr", "no-asked-option"],
)
def test_a_revision_that_cannot_be_timed_exits_2_before_timing(in_repo, monkeypatch, rev, extra, message):
    no_timing(monkeypatch)
    r = run("--against", rev, *TINY, *extra)
    assert r.exit_code == 2 and message in r.stderr, r.output


def test_outside_a_git_repository_exits_2(tmp_path, monkeypatch):
    no_timing(monkeypatch)
    outside = tmp_path / "plain"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    r = run("--against", "HEAD", *TINY)
    assert r.exit_code == 2 and "not inside a git repository" in r.stderr, r.output


def test_a_failing_revision_names_it_and_leaves_no_tree(in_repo):
    r = run("--against", "fails", *TINY, "--rounds", "3")
    assert r.exit_code == 1, r.output
    assert "fails (" in r.stderr and "a planted failure" in r.stderr
    assert "round 1/3" not in r.stderr  # it stopped at the first process


def test_against_takes_no_save_and_baseline_takes_no_workload_options(in_repo, monkeypatch, tmp_path):
    no_timing(monkeypatch)
    r = run("--against", "HEAD", *TINY, "--save", tmp_path / "new.json")
    assert r.exit_code == 2 and "'--save'" in r.output
    r = run("--baseline", tmp_path / "base.json", "--batch", "8")
    assert r.exit_code == 2 and "'--batch'" in r.output
    r = run("--rounds", "3")
    assert r.exit_code == 2 and "'--rounds'" in r.output
    r = run()
    assert r.exit_code == 2 and "--against REV" in r.output
