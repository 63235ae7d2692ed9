"""The repository speaks of the product only: scripts/check_words.py finds no working notes
(numbered work periods, tracker references, numbered runs, branch names, borrowed machines,
thresholds from a plan) in any file of it: docs, code, comments, tests, benchmarks, scripts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.docs import ROOT

#: Every part of the repository a reader meets.
DOC_FILES = [
    "README.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "docs",
    "benchmarks",
    "scripts",
    "kvaddr",
    "tests",
    "profiles",
    "mkdocs.yml",
    "setup.cfg",
    "pyproject.toml",
    ".ci",
]
CHECKER = ROOT / "scripts" / "check_words.py"


def test_the_docs_hold_no_working_notes():
    result = subprocess.run(
        [sys.executable, str(CHECKER), *DOC_FILES], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "line",
    [
        # (built from fragments: a search of the repository for these words finds none)
        "measured in " + "ses" + "sion 14 (" + "run 7)",
        "the sixth " + "ses" + "sion's kernel",
        "see " + "is" + "sue 16",
        "fixes #" + "14 in prose",
        "on the " + "le" + "nt H200",
        "merged from s" + "14-b",
        "one / core (tar" + "get <= 1.3)",
        "the bound was " + "met in 4 of 6 rows",
        "within the " + "device " + "budget",
    ],
)
def test_the_checker_finds_each_kind(tmp_path, line):
    f = tmp_path / "notes.md"
    f.write_text(f"A line.\n{line}\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(CHECKER), str(f)], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert ":2: " in result.stdout


@pytest.mark.parametrize(
    "line",
    [
        "hoisted to once per step, FastDeploy PR #7367",
        "a label that repeats gets `#2`, `#3`",
        "each decode request runs 1 + N tokens",
        "stderr says `added run 2 (glm-5)`",
        "timed its second run 4-22% slower",
        "an HTTP " + "ses" + "sion and a CUDA stream",
    ],
)
def test_the_checker_allows_legitimate_uses(tmp_path, line):
    f = tmp_path / "ok.md"
    f.write_text(line + "\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(CHECKER), str(f)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
