"""The worked examples of docs/spec.md, parsed from its ``json kvaddr-example`` blocks.

Each block holds ``name``, ``inputs`` (``seq_lens_decoder``, ``seq_lens_this_time``,
``block_tables``: one table or a list of one per cache, ``block_sizes``, ``capacity``),
``outputs`` (every output of the spec), ``error_mask`` and ``first_bad``
(``[token, request, cache, bit]`` or ``null``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

SPEC = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
EXAMPLE_BLOCK = re.compile(r"^```json kvaddr-example\n(.*?)^```$", re.S | re.M)


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def spec_examples() -> list[dict]:
    """Every worked example of docs/spec.md, in page order."""
    return [json.loads(block) for block in EXAMPLE_BLOCK.findall(spec_text())]


def example_case(ex: dict) -> dict:
    """An example's inputs as a step case (the dict form of tests/support/step_cases.py)."""
    inp = ex["inputs"]
    tables = inp["block_tables"]
    if tables and tables[0] and isinstance(tables[0][0], list):  # one table per cache (widths may differ)
        tables = [np.asarray(t, dtype=np.int32) for t in tables]
    else:
        tables = np.asarray(tables, dtype=np.int32)
    return dict(
        seq_lens_decoder=np.asarray(inp["seq_lens_decoder"], dtype=np.int32),
        seq_lens_this_time=np.asarray(inp["seq_lens_this_time"], dtype=np.int32),
        block_tables=tables,
        block_sizes=list(inp["block_sizes"]),
        capacity=int(inp["capacity"]),
    )
