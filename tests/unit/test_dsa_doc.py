"""docs/dsa.md's GPU snippet run as written on the CPU: the fake CuPy of tests/support/dsa_fake_gpu.py
and the emulated kernel; each ``print(...)  # expected`` line prints its comment.
tests/gpu/test_dsa_doc_gpu.py runs it on the GPU."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.support import dsa_emulator
from tests.support.docs import DOCS, expected_prints, snippet


def run_snippet() -> tuple[list, list]:
    code = snippet((DOCS / "dsa.md").read_text(), "dsa-gpu")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/dsa.md", "exec"), {"__name__": "__doc_snippet__"})
    return buf.getvalue().splitlines(), expected_prints(code, explanations=False)


@pytest.mark.skipif(dsa_emulator.CXX is None, reason="no C++ compiler for the kernel emulator")
def test_gpu_snippet_prints_what_it_says(monkeypatch):
    from tests.support import dsa_fake_gpu

    dsa_fake_gpu.install(monkeypatch)
    got, want = run_snippet()
    assert got == want and len(want) == 3
