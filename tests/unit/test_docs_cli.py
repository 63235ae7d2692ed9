"""docs/cli.md documents every command of ``kvaddr`` and every option of each (it holds their
``--help`` texts: scripts/gen_api_docs.py writes it)."""

from __future__ import annotations

import re

import click
import pytest

from kvaddr import cli as cli_module
from tests.support.docs import ROOT

PAGE = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def _commands(group, prefix="kvaddr"):
    for name, cmd in sorted(group.commands.items()):
        yield f"{prefix} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")


COMMANDS = list(_commands(cli_module.cli))


def _section(path: str) -> str:
    m = re.search(rf"^## {re.escape(path)}\n(.*?)(?=^## |\Z)", PAGE, flags=re.S | re.M)
    assert m, f"docs/cli.md has no section '## {path}'"
    return m.group(1)


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_command_and_option_is_documented(path, cmd):
    text = _section(path)
    assert f"Usage: {path}" in text
    for param in cmd.params:
        if isinstance(param, click.Option):
            for opt in (*param.opts, *param.secondary_opts):
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), (path, opt)
        elif isinstance(param, click.Argument):
            assert param.human_readable_name.upper() in text.upper(), (path, param.name)


def test_the_command_table_and_exit_codes():
    for path, _cmd in COMMANDS:
        assert f"[`{path}`]" in PAGE, path
    codes = PAGE[PAGE.index("## Exit codes") :]
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 141 |"):
        assert code in codes
