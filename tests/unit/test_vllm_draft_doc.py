"""docs/spec-decode.md's draft snippet runs as written: here behind the fake CuPy with the kernel
emulated on the CPU; tests/gpu/test_vllm_draft_doc_gpu.py runs it on the GPU."""

from __future__ import annotations

import pytest

from tests.support import vllm_draft_emulator
from tests.support.draft_doc import draft_snippet

pytestmark = pytest.mark.skipif(vllm_draft_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


def test_snippet_runs(monkeypatch):
    vllm_draft_emulator.install(monkeypatch)
    exec(compile(draft_snippet(), "docs/spec-decode.md", "exec"), {})
