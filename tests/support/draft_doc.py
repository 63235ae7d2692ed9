"""The runnable snippet of docs/spec-decode.md (the ``python kvaddr-draft-snippet`` block)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "spec-decode.md"


def draft_snippet() -> str:
    m = re.search(r"^```python kvaddr-draft-snippet\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert m, "docs/spec-decode.md has no kvaddr-draft-snippet block"
    return m.group(1)
