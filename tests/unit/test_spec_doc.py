"""docs/spec.md is the project's contract: its worked examples must be what the code computes,
and nothing in the repository may point outside it for the contract.

The worked examples are the fenced ``json kvaddr-example`` blocks of docs/spec.md; each is run
through the NumPy reference (the oracle) and through the independent per-token loop of
tests/support/step_cases.py, and every output, the error mask and the first bad record must
equal what the page says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvaddr.errors import ERROR_REASONS, NO_ERROR_KEY, decode_error_key
from kvaddr.outputs import OUTPUT_FIELDS, PAD_SLOT_ID
from kvaddr.reference import step_addressing
from tests.support.step_cases import naive_reference

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
EXAMPLE_BLOCK = re.compile(r"^```json kvaddr-example\n(.*?)^```$", re.S | re.M)


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def spec_examples() -> list[dict]:
    return [json.loads(block) for block in EXAMPLE_BLOCK.findall(spec_text())]


def test_spec_has_the_worked_examples():
    examples = spec_examples()
    assert len(examples) >= 3, "docs/spec.md lost its machine-readable worked examples"
    names = [ex["name"] for ex in examples]
    assert len(set(names)) == len(names), names
    # Between them, the examples show a clean step and every error bit.
    assert any(ex["error_mask"] == 0 for ex in examples)
    assert set().union(*({b for b in ERROR_REASONS if ex["error_mask"] & b} for ex in examples)) == set(ERROR_REASONS)


def _inputs(ex: dict) -> tuple:
    inp = ex["inputs"]
    tables = inp["block_tables"]
    if tables and tables[0] and isinstance(tables[0][0], list):  # one table per cache (widths may differ)
        tables = [np.asarray(t, dtype=np.int32) for t in tables]
    else:
        tables = np.asarray(tables, dtype=np.int32)
    return (
        np.asarray(inp["seq_lens_decoder"], dtype=np.int32),
        np.asarray(inp["seq_lens_this_time"], dtype=np.int32),
        tables,
        list(inp["block_sizes"]),
        int(inp["capacity"]),
    )


@pytest.mark.parametrize("ex", spec_examples(), ids=lambda ex: ex["name"])
def test_worked_example_matches_the_reference(ex):
    res = step_addressing(*_inputs(ex))
    got = res.outputs.as_dict()
    assert set(ex["outputs"]) == set(OUTPUT_FIELDS), "an example must state every output"
    for name in OUTPUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ex["outputs"][name]), err_msg=name)
    assert res.error_mask == ex["error_mask"]
    if ex["first_bad"] is None:
        assert res.error_key == NO_ERROR_KEY
    else:
        assert list(decode_error_key(res.error_key)) == ex["first_bad"]


@pytest.mark.parametrize("ex", spec_examples(), ids=lambda ex: ex["name"])
def test_worked_example_matches_the_per_token_loop(ex):
    dec, q, tables, sizes, capacity = _inputs(ex)
    want = naive_reference(dec, q, tables, sizes, capacity)
    for name in OUTPUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(want[name]), np.asarray(ex["outputs"][name]), err_msg=name)
    assert want["error_mask"] == ex["error_mask"]
    want_first = None if want["error_key"] == NO_ERROR_KEY else list(decode_error_key(want["error_key"]))
    assert want_first == ex["first_bad"]


def test_error_bit_table_matches_the_code():
    text = spec_text()
    section = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    bits = {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)}
    assert bits == set(ERROR_REASONS)
    assert f"`PAD_SLOT_ID = {PAD_SLOT_ID}`" in text


def _repository_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True).stdout
        return [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        pass
    # Not a git checkout (an unpacked sdist): every file but hidden and build folders.
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build", "dist", "__pycache__")]
        files += [Path(dirpath) / f for f in filenames]
    return files


def test_nothing_points_outside_the_repository_for_the_contract():
    # Spelled in pieces so that this file does not match itself.
    forbidden = [("../" + "shared").encode(), ("shared/" + "SPEC").encode(), ("shared/" + "ENGINES").encode()]
    offenders = []
    for path in _repository_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(".ci/") or not path.is_file():
            continue
        data = path.read_bytes()
        offenders += [f"{rel}: {s.decode()}" for s in forbidden if s in data]
    assert not offenders, "the contract is docs/spec.md; these point elsewhere:\n" + "\n".join(offenders)
