"""The attention snippets (FlashInfer-style, FlashAttention-style) of docs/attention.md, section
"Examples" (they were README's), run as written on the GPU.

Each ``print(...)  # expected`` line's output must equal its comment (up to the first two
spaces of the comment, where an explanation may follow).
"""

import contextlib
import io
import re
from pathlib import Path

from tests.support.gpu import requires_gpu

README = Path(__file__).resolve().parents[2] / "docs" / "attention.md"


def _block_after(text: str, marker: str) -> str:
    start = text.index(marker)
    m = re.search(r"```python\n(.*?)```", text[start:], flags=re.S)
    assert m, f"no python block after {marker!r}"
    return m.group(1)


def _expected(code: str) -> list:
    out = []
    for line in code.splitlines():
        m = re.match(r"print\(.*\)\s+# (.*)$", line.strip())
        if m:
            out.append(re.split(r"\s{2,}", m.group(1))[0].strip())
    return out


def test_blocks_are_found_and_state_outputs():
    text = README.read_text()
    for marker in ("FlashInfer-style", "FlashAttention-style"):
        assert len(_expected(_block_after(text, marker))) >= 3, marker


@requires_gpu
def test_readme_attention_snippets_print_what_they_say():
    text = README.read_text()
    code = _block_after(text, "FlashInfer-style") + _block_after(text, "FlashAttention-style")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/attention.md", "exec"), {})
    got = [line.strip() for line in buf.getvalue().splitlines()]
    assert got == _expected(code)
