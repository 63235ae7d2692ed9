"""docs/api.md and docs/cli.md are generated from the code (scripts/gen_api_docs.py): regenerate
them and fail if a committed page differs, so a public name or an option added, removed or
re-documented shows up there."""

from __future__ import annotations

import importlib.util

from tests.support.docs import ROOT


def _gen():
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_api_page_is_up_to_date():
    gen = _gen()
    committed = gen.API_PATH.read_text(encoding="utf-8")
    assert committed == gen.api_page(), "docs/api.md is stale: run python scripts/gen_api_docs.py"


def test_cli_page_is_up_to_date():
    gen = _gen()
    committed = gen.CLI_PATH.read_text(encoding="utf-8")
    assert committed == gen.cli_page(), "docs/cli.md is stale: run python scripts/gen_api_docs.py"


def test_api_page_lists_every_public_name():
    import kvaddr
    import kvaddr.reference

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for name in kvaddr.__all__:
        assert f"`kvaddr.{name}" in page, name
    for name in ("step_addressing", "ReferenceResult"):
        assert f"`kvaddr.reference.{name}" in page, name
    for name in ("VllmStepPlanner", "BoundVllmStep", "vllm_step_reference", "VllmAddressingError"):
        assert f".{name}" in page, name
    for name in ("StepBuffers", "VllmStepBuffers", "step", "vllm_step", "workspace_size"):
        assert f"`kvaddr.torch.{name}" in page, name


def test_api_page_leaves_out_the_tuning_knobs():
    gen = _gen()
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for knob in gen.NOT_PUBLIC:
        if knob == "kernel":
            assert "kernel=" not in page
            continue
        assert f".{knob}" not in page and f"{knob}=" not in page, knob
