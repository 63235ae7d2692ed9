"""docs/dsa.md's GPU snippet run as written on the GPU; each ``print(...)  # expected`` line prints
its comment (tests/unit/test_dsa_doc.py runs it on the emulated kernel)."""

from __future__ import annotations

from tests.support.gpu import requires_gpu
from tests.unit.test_dsa_doc import run_snippet

pytestmark = requires_gpu


def test_gpu_snippet_prints_what_it_says():
    got, want = run_snippet()
    assert got == want and len(want) == 3
