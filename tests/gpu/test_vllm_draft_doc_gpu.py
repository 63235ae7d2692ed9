"""docs/spec-decode.md's draft snippet runs as written on the GPU."""

from __future__ import annotations

from tests.support.draft_doc import draft_snippet
from tests.support.gpu import requires_gpu

pytestmark = requires_gpu


def test_snippet_runs_on_the_gpu():
    exec(compile(draft_snippet(), "docs/spec-decode.md", "exec"), {})
