"""mkdocs.yml builds docs/ as a site: every docs page is in its nav, every nav entry exists, and
docs/index.md links every page. Read without mkdocs (a small parser for the nav's lines)."""

from __future__ import annotations

import re

from tests.support.docs import DOCS, ROOT, doc_pages, page_name

MKDOCS = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def nav_pages() -> list:
    nav = MKDOCS[MKDOCS.index("\nnav:") :]
    return re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", nav, flags=re.M)


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = nav_pages()
    assert len(pages) == len(set(pages)), "a page is in the nav twice"
    on_disk = {page_name(p) for p in doc_pages()}
    assert set(pages) == on_disk, (sorted(on_disk - set(pages)), sorted(set(pages) - on_disk))
    for page in pages:
        assert (DOCS / page).is_file(), page


def test_the_site_is_strict_and_reads_docs():
    assert re.search(r"^docs_dir:\s*docs\s*$", MKDOCS, flags=re.M)
    assert re.search(r"^strict:\s*true\s*$", MKDOCS, flags=re.M)


def test_index_links_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in doc_pages():
        if page_name(page) != "index.md":
            assert f"]({page_name(page)})" in index, page_name(page)


def test_the_docs_extra_brings_mkdocs():
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert re.search(r"^docs =\n\s+mkdocs>=1\.5", setup, flags=re.M)
