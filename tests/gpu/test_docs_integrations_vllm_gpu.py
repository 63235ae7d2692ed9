"""docs/integrations/vllm.md's snippets run as written on the GPU (kvaddr's real launch): each
``print(...)  # expected`` line's output must equal its comment. The CPU run, the NumPy
reference as the launch, is tests/unit/test_docs_integrations_vllm.py."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.support.docs import DOCS, expected_prints, snippet
from tests.support.gpu import requires_gpu

PAGE = DOCS / "integrations" / "vllm.md"
TEXT = PAGE.read_text(encoding="utf-8")

pytestmark = requires_gpu


@pytest.mark.parametrize("name", ["mrv2", "mrv2-flashinfer"])
def test_snippet_prints_what_it_says(name):
    pytest.importorskip("torch")
    code = snippet(TEXT, name)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, str(PAGE), "exec"), {})
    assert [line.strip() for line in buf.getvalue().splitlines()] == expected_prints(code)
