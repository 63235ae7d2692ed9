"""Every file path, module and ``kvaddr.*`` name that README.md and the docs pages mention
resolves: paths exist, names import (names in modules that need torch or CuPy are found in
their source), links between pages land on a page. And the docs name no removed kernel, tuning
knob or history page."""

from __future__ import annotations

import re

import pytest

from tests.support.docs import README, ROOT, doc_pages, resolve

FILES = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *doc_pages()]
IDS = [str(p.relative_to(ROOT)) for p in FILES]

#: Paths that the work landing with this release adds (the kernel split, its dispatch table,
#: the new benchmarks), and example paths a user creates.
NOT_YET_OR_EXAMPLES = {
    "profiles/baselines/ci.json",
    "kvaddr/profiles/",  # inside an installed package (the wheel's data files)
}
#: Dotted names that are not Python names (a JSON schema's id).
NOT_PYTHON = {
    "kvaddr.profile.vllm",
    "kvaddr.profile",
    "kvaddr.replay",
    "kvaddr.sweep",
    "kvaddr.check",
    "kvaddr.baseline",
    "kvaddr.comparison",
}

PATH_RE = re.compile(r"(?<![\w./-])((?:kvaddr|docs|tests|benchmarks|scripts|profiles|\.ci)/[\w./-]*[\w/])")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NAME_RE = re.compile(r"(?<![\w./-])(kvaddr(?:\.[A-Za-z_]\w*)+)")


def _text(path):
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_path_exists(path):
    missing = []
    for m in PATH_RE.finditer(_text(path)):
        p = m.group(1).rstrip(".")
        if _text(path)[m.end() : m.end() + 1] == "*":
            continue  # a glob
        if any(c in p for c in "{}*<>") or p in NOT_YET_OR_EXAMPLES or p.endswith((".png.", "...")):
            continue
        if p.startswith("profiles/") and p.endswith(".json") and "h200" not in p:
            continue  # an example baseline the reader records
        if not (ROOT / p).exists():
            missing.append(p)
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_relative_link_lands(path):
    missing = []
    for m in LINK_RE.finditer(_text(path)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            missing.append(target)
    assert not missing, f"{path.name} links to missing files: {missing}"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_kvaddr_name_resolves(path):
    bad = []
    for m in NAME_RE.finditer(_text(path)):
        name = m.group(1).rstrip(".")
        if name in NOT_PYTHON or name.endswith((".py", ".cu", ".md", ".json", ".toml")):
            continue
        if not resolve(name):
            bad.append(name)
    assert not bad, f"{path.name} names what does not exist: {sorted(set(bad))}"


#: Removed from the public API in 0.2.0, or names of kernels and pages that no longer exist.
GONE = [
    r"\buse_kernel\b",
    r"\bstep_kernel\b",
    r"\bone_block_(?:max_capacity|min_threads|max_requests|attention)\b",
    r"\bwide_(?:max_requests|threads|per_thread|attention|meta_threads)\b",
    r"\bWIDE_(?:PER_THREAD|META_MAX_PAD)\b",
    r"\bone_meta_\w+",
    r"\bONE_META_MAX_BLOCKS\b",
    r"\bM1_(?:EMPTY|ROWS_BY_PAGES)\b",
    r"\b_set_(?:one_meta|meta_impl)\b",
    r"\bpair_lanes\b",
    r"\bmeta_(?:lanes|rows|impl)\b",
    r"\bkernel=",
    r"\bkvaddr_step(?!_line)\w*",
    r"\bkvaddr_vllm_step\w*",
    r"\bstep1\w*",
    r"\bkv_meta_block\d*",
    r"(?<![\w.@])v(?:1|2|2a|3|4|8|9)(?:-\w+)?\b(?!\.\d)",
    r"\bablate_\w+",
    r"\btrace_step\w*",
    r"perf-notes",
]


@pytest.mark.parametrize(
    "path",
    [README, ROOT / "CONTRIBUTING.md", *[p for p in doc_pages() if p.name != "api.md"]],
    ids=lambda p: p.name,
)
def test_no_removed_names(path):
    text = _text(path)
    found = [m.group(0) for pattern in GONE for m in re.finditer(pattern, text)]
    assert not found, f"{path.name} still names {sorted(set(found))}"
