"""README's quickstart snippets (CuPy ``StepPlanner``, PyTorch ``kvaddr.torch.step``, vLLM
``VllmStepPlanner`` bind/launch), run as written on the GPU: each ``print(...)  # expected``
line's output must equal its comment. The CPU snippet runs in tests/unit/test_readme.py."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.support.docs import README, expected_prints, snippet
from tests.support.gpu import requires_gpu

TEXT = README.read_text(encoding="utf-8")


def _run(code: str) -> list:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    return [line.strip() for line in buf.getvalue().splitlines()]


@pytest.mark.parametrize("name", ["cupy", "torch", "vllm"])
def test_snippets_state_their_outputs(name):
    assert len(expected_prints(snippet(TEXT, name))) >= 2, name


@requires_gpu
@pytest.mark.parametrize("name", ["cupy", "torch", "vllm"])
def test_readme_snippet_prints_what_it_says(name):
    if name in ("torch", "vllm"):
        pytest.importorskip("torch")
    code = snippet(TEXT, name)
    assert _run(code) == expected_prints(code)
