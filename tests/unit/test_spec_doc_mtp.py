"""docs/spec-decode.md's MTP snippets: the CPU one runs here (each ``print(...)  # expected`` line's
output equals its comment); the GPU one runs in tests/gpu/test_mtp_gpu.py."""

from __future__ import annotations

import contextlib
import io

from tests.support.docs import DOCS, expected_prints, snippet

TEXT = (DOCS / "spec-decode.md").read_text(encoding="utf-8")


def run_snippet(name: str) -> tuple[list, list]:
    code = snippet(TEXT, name)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "spec-decode.md", "exec"), {})
    return [line.strip() for line in buf.getvalue().splitlines()], expected_prints(code)


def test_cpu_snippet_prints_what_it_says():
    got, want = run_snippet("mtp-cpu")
    assert len(want) == 3 and got == want


def test_gpu_snippet_states_its_outputs():
    assert len(expected_prints(snippet(TEXT, "mtp-cupy"))) == 2
