"""docs/spec.md is the project's contract: its worked examples must be what the code computes,
and nothing in the repository may point outside it for the contract.

The worked examples are the fenced ``json kvaddr-example`` blocks of docs/spec.md
(tests/support/spec_doc.py parses them); each is run through the NumPy reference (the oracle)
and through the independent per-token loop of tests/support/step_cases.py, and every output,
the error mask and the first bad record must equal what the page says. tests/gpu runs them
through the GPU strategies.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvaddr.errors import ERR_KV_INDICES_CAPACITY, ERROR_REASONS, NO_ERROR_KEY, decode_error_key, error_key
from kvaddr.outputs import OUTPUT_FIELDS, PAD_SLOT_ID
from kvaddr.reference import step_addressing
from tests.support.spec_doc import example_case, spec_examples, spec_text
from tests.support.step_cases import naive_reference

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = spec_examples()


def test_spec_has_the_worked_examples():
    assert len(EXAMPLES) >= 3, "docs/spec.md lost its machine-readable worked examples"
    names = [ex["name"] for ex in EXAMPLES]
    assert len(set(names)) == len(names), names
    # Between them, the examples show a clean step and every error bit of the addressing
    # (bit 16 concerns the attention outputs: docs/attention.md's examples show it).
    assert any(ex["error_mask"] == 0 for ex in EXAMPLES)
    shown = set().union(*({b for b in ERROR_REASONS if ex["error_mask"] & b} for ex in EXAMPLES))
    assert shown == set(ERROR_REASONS) - {ERR_KV_INDICES_CAPACITY}
    for ex in EXAMPLES:
        assert set(ex["outputs"]) == set(OUTPUT_FIELDS), f"{ex['name']} must state every output"


def _first_bad(key: int):
    return None if key == NO_ERROR_KEY else list(decode_error_key(key))


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex["name"])
def test_worked_example_matches_the_reference(ex):
    case = example_case(ex)
    res = step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    got = res.outputs.as_dict()
    for name in OUTPUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ex["outputs"][name]), err_msg=name)
    assert res.error_mask == ex["error_mask"]
    assert _first_bad(res.error_key) == ex["first_bad"]


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex["name"])
def test_worked_example_matches_the_per_token_loop(ex):
    case = example_case(ex)
    want = naive_reference(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    for name in OUTPUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(want[name]), np.asarray(ex["outputs"][name]), err_msg=name)
    assert want["error_mask"] == ex["error_mask"]
    assert _first_bad(want["error_key"]) == ex["first_bad"]


def test_error_bit_table_matches_the_code():
    text = spec_text()
    section = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    bits = {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)}
    assert bits == set(ERROR_REASONS)
    assert f"`PAD_SLOT_ID = {PAD_SLOT_ID}`" in text


def test_error_key_layout_in_the_spec_is_the_code_s():
    section = spec_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    layout = re.search(r"`token << (\d+) \| request << (\d+) \| cache << (\d+) \|\s*log2\(bit\)`", section)
    assert layout, "docs/spec.md must state the key layout"
    t, r, c = (int(x) for x in layout.groups())
    for rec in [(3, 2, 1, 16), (0, 5, 3, 1), (7, 0, 0, 8)]:
        token, request, cache, bit = rec
        assert error_key(*rec) == (token << t) | (request << r) | (cache << c) | (bit.bit_length() - 1)
        assert decode_error_key(error_key(*rec)) == rec


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
