"""README.md says what the commands do (issue 12, item 9): its option list of ``kvaddr profile``,
its exit codes and its sweep sentence are checked against the commands themselves."""

from __future__ import annotations

import re
from pathlib import Path

import click

from kvaddr import cli as cli_module
from kvaddr.commands.common import EXIT_PIPE, PLOT_FORMATS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text of README's ``## title`` section."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def long_options(command: click.Command) -> set:
    return {
        o
        for p in command.params
        if isinstance(p, click.Option)
        for o in (*p.opts, *p.secondary_opts)
        if o.startswith("--")
    } - {"--help"}


def test_profile_options_list_names_every_option_and_no_other():
    text = section("`kvaddr profile`")
    listed = text[text.index("Options: ") : text.index("(`kvaddr profile --help` explains each")]
    named = set(re.findall(r"`(--[a-z][a-z-]*)", listed))
    assert named == long_options(cli_module.cli.commands["profile"])


def test_profile_option_metavars_in_the_readme_match_the_help():
    text = section("`kvaddr profile`")
    listed = text[text.index("Options: ") : text.index("(`kvaddr profile --help` explains each")]
    ctx = click.Context(cli_module.cli.commands["profile"], info_name="kvaddr profile")
    for p in cli_module.cli.commands["profile"].params:
        if not isinstance(p, click.Option) or p.is_flag or p.name == "help":
            continue
        metavar = p.make_metavar(ctx)
        if metavar.startswith("["):  # a choice: README spells the choices without brackets
            metavar = metavar[1:-1]
        assert f"`{p.opts[0]} {metavar}" in listed.replace("\n", " "), (p.opts[0], metavar)


def test_exit_codes_name_output_paths_and_the_closed_pipe():
    text = section("`kvaddr profile`")
    codes = " ".join(text[text.index("Exit codes:") :].split("\n\n")[0].split())
    assert "**2**" in codes and "output path" in codes
    assert "**3**" in codes and "--json" in codes and "fails at the end" in codes
    assert f"**{EXIT_PIPE}**" in codes
    gate = " ".join(section("Regression timing in CI").split())
    assert f"**{EXIT_PIPE}**" in gate and "cannot be written" in gate


def test_the_sweep_sentence_says_plot_exits_3_without_matplotlib():
    text = section("Traces, workload profiles and sweeps")
    assert "without it\n  a terminal chart is printed" not in text
    assert "without matplotlib, `--plot` exits 3 before profiling" in text.replace("\n  ", " ")
    for ext in PLOT_FORMATS:
        assert f"`.{ext}`" in text
    assert "`--from PATH`" in text and "`--run LABEL`" in text
    assert long_options(cli_module.cli.commands["sweep"]) >= {"--plot", "--from", "--run", "--no-chart"}
