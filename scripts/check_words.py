#!/usr/bin/env python3
"""Find words that belong to the project's working notes, not to the product's documentation.

The documentation speaks of the product: what it does, how to use it, and what it measured
(with the date, the machine and the commit or version). It does not speak of how the work was
organised: numbered work periods, tracker references, numbered runs, branch names, borrowed
machines and their time allowance, or thresholds from a plan. ``PATTERNS`` below defines each
kind; tests/unit/test_words.py shows an example of each. (This file and its test spell the
words with character classes and fragments, so that a search of the repository for them finds
none.)

Usage::

    python scripts/check_words.py [PATH ...]

Each PATH is a file or a folder (searched for text files). Without PATH, every text file that
git tracks is checked. Prints ``file:line: match`` for each finding and exits 1 if there is
one, 0 otherwise. ``ALLOW`` below lists the legitimate uses (an upstream pull request cited by
its number, for example); a line matching an allowed pattern is judged without that part.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)

_WORK_PERIOD = "s[e]ssion"
# name -> pattern (case-insensitive)
PATTERNS = {
    "work period number": rf"\b{_WORK_PERIOD}s?\s+\d+|\b(?:{_ORDINALS})\s+{_WORK_PERIOD}\b|"
    rf"\b{_WORK_PERIOD}\s+(?:{_ORDINALS})\b",
    "tracker reference": r"\bi[s]sues?\s+#?\d+|(?<![\w&/])#\d+\b",
    "borrowed machine": r"\bl[e]nt\b",
    "machine time allowance": r"\bd[e]vice\s+b[u]dget\b",
    "numbered run": r"\brun\s+\d+\b(?!\s*(?:\+|-\d|x\b|times|steps|s\b|ms\b|us\b|µs\b|%))|\bruns\s+\d+\s*(?:and|-|to)\s*\d+\b",
    "branch name": r"(?<![\w./-])s\d+-[a-z][\w-]*",
    "target": r"\btargets?\s*(?:<=|>=|≤|≥|\d|x\s*\d)|\(targets?\s+(?:<|>|≤|≥|\d|met|missed)|"
    r"\btargets?\s+(?:met|missed)\b|\b(?:its|issue's|the issue's|the plan's) targets?\b",
    "met in N of M": r"\bmet\s+(?:in|on)\s+\d+\s+of\s+\d+\b",
}
COMPILED = {name: re.compile(p, re.IGNORECASE) for name, p in PATTERNS.items()}

# Legitimate uses, removed from a line before the patterns are applied.
ALLOW = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bPR #\d+",  # an upstream pull request cited by number (FastDeploy PR #7367)
        r"&#\d+;",  # an HTML character reference
        r"`#\d+`",  # a literal suffix shown in code (a repeated baseline label gets `#2`)
        r"\b(?:added|replaced|kept) run \d+",  # a baseline file's numbered runs (kvaddr profile --save)
        r"\brun \d+/\d+",  # kvaddr check's progress over a baseline's runs ("run 1/3")
    )
]

#: Files that name the patterns on purpose: this checker and its test's examples.
SKIP_FILES = {"scripts/check_words.py", "tests/unit/test_words.py"}

TEXT_SUFFIXES = {
    ".md",
    ".txt",
    ".rst",
    ".py",
    ".cfg",
    ".toml",
    ".yml",
    ".yaml",
    ".sh",
    ".cu",
    ".cuh",
    ".h",
    ".json",
    ".ini",
    ".in",
    "",
}


def _is_text(path: Path) -> bool:
    if path.suffix not in TEXT_SUFFIXES:
        return False
    try:
        head = path.read_bytes()[:4096]
    except OSError:
        return False
    return b"\0" not in head


def tracked_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p]


def expand(paths: list) -> list:
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*") if q.is_file() and ".git" not in q.parts))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"check_words: no such file or folder: {p}")
    return files


def findings(path: Path) -> list:
    """``(line_number, match, pattern_name)`` for each banned word in ``path``."""
    if not _is_text(path):
        return []
    found = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), 1):
        for allow in ALLOW:
            line = allow.sub(" ", line)
        for name, pattern in COMPILED.items():
            for m in pattern.finditer(line):
                found.append((n, m.group(0), name))
    return found


def main(argv: list) -> int:
    files = expand(argv) if argv else [p for p in tracked_files() if p.is_file()]
    total = 0
    for path in files:
        try:
            if str(path.resolve().relative_to(ROOT)) in SKIP_FILES:
                continue
        except ValueError:
            pass
        for n, match, name in findings(path):
            try:
                shown = path.resolve().relative_to(ROOT)
            except ValueError:
                shown = path
            print(f"{shown}:{n}: {match!r} ({name})")
            total += 1
    if total:
        print(f"check_words: {total} finding(s)", file=sys.stderr)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
