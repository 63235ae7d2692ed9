"""docs/integrations/vllm.md: its snippets run as written but on the CPU, the NumPy reference
standing in for the launch (tests/support/mrv2_standin.py's ReferenceStep), and each
``print(...)  # expected`` line prints what its comment says; the page is in the site's nav and
keeps its sketch of the change to MRV2. The snippets run on a GPU as written in
tests/gpu/test_docs_integrations_vllm_gpu.py."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.support.docs import DOCS, ROOT, expected_prints, snippet, snippet_names

PAGE = DOCS / "integrations" / "vllm.md"
TEXT = PAGE.read_text(encoding="utf-8")
NAMES = ["mrv2", "mrv2-flashinfer"]


def test_the_page_has_its_snippets_sketch_and_table():
    assert snippet_names(TEXT) == NAMES
    assert "```diff" in TEXT and "+        self.block_tables.prepare_pos_seq_lens(" in TEXT
    assert "## Measured effect per step" in TEXT and "| host us, the adapter's three calls |" in TEXT
    assert "integrations/vllm.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for name in NAMES:
        assert len(expected_prints(snippet(TEXT, name))) >= 4, name


@pytest.mark.parametrize("name", NAMES)
def test_snippet_prints_what_it_says_with_the_reference_as_the_launch(name, monkeypatch):
    pytest.importorskip("torch")
    from kvaddr.engines.vllm_mrv2 import Mrv2Addressing
    from tests.support.mrv2_standin import ReferenceStep

    def reference_bind(self):
        o = self._planner_options
        return ReferenceStep(
            self.tables,
            self._nct,
            self._pos,
            self._seq_lens,
            attention=o["attention"],
            kv_indices_capacity=o["kv_indices_capacity"],
        )

    monkeypatch.setattr(Mrv2Addressing, "_bind", reference_bind)
    code = snippet(TEXT, name)
    assert 'dev = "cuda"\n' in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code.replace('dev = "cuda"\n', 'dev = "cpu"\n'), str(PAGE), "exec"), {})
    assert [line.strip() for line in buf.getvalue().splitlines()] == expected_prints(code)
