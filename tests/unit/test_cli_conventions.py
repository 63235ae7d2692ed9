"""Conventions every ``kvaddr`` command keeps.

* its ``--help`` ends with two or three examples, shows no machine-limit bound
  (``0<=x<=9223372036854775807``) and names option values by kind (``N``, ``X``,
  ``PATH``, ...: :data:`kvaddr.commands.common.METAVARS`);
* output paths (``--json``, ``--save``, ``--plot``, ``-o``) are checked before any
  work: exit 2 naming the option; a write that fails at the end exits 3;
* a closed stdout (``kvaddr profile | head -1``) ends quietly with 141.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.commands import common
from kvaddr.commands.common import EXIT_PIPE, METAVARS, IntList, output_path_problem
from kvaddr.measure import environment
from tests.support import skips

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")
FAST_PROFILE = ["--device", "cpu", "--batch", "1", "--layers", "2", "--budget", "0"]
needs_dev_full = skips.requires_dev_full


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


def walk(command, path=()):
    """(path, command) for the group and every command and subcommand under it."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))


COMMANDS = list(walk(cli_module.cli))
IDS = [" ".join(("kvaddr", *p)) for p, _ in COMMANDS]


def test_the_walk_finds_every_command():
    assert set(IDS) == {
        "kvaddr",
        "kvaddr profile",
        "kvaddr info",
        "kvaddr compare",
        "kvaddr check",
        "kvaddr trace",
        "kvaddr trace generate",
        "kvaddr replay",
        "kvaddr sweep",
        "kvaddr profiles",
    }


# ----------------------------------------------------------------------------- item 6: help texts


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_ends_with_two_or_three_examples(path, command):
    r = run(*path, "--help")
    assert r.exit_code == 0, r.output
    lines = [line.rstrip() for line in r.stdout.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    assert "Examples:" in [line.strip() for line in lines], r.stdout
    start = max(i for i, line in enumerate(lines) if line.strip() == "Examples:")
    examples = lines[start + 1 :]
    assert 2 <= len(examples) <= 3, examples
    for line in examples:
        # one example per line, not rewrapped by click (\b), each a kvaddr command line
        assert line.strip().startswith("kvaddr "), line
        assert line.startswith("  ") and not line.startswith("      "), line
    # the examples name real commands of the group
    for line in examples:
        words = line.split("|")[0].split()[1:]
        sub = cli_module.cli
        while isinstance(sub, click.Group) and words and words[0] in sub.commands:
            sub = sub.commands[words.pop(0)]
        assert sub is not cli_module.cli, line


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_shows_no_machine_limit_and_no_generic_metavar(path, command):
    text = run(*path, "--help").stdout
    assert "9223372036854775807" not in text and "1099511627776" not in text and "17179869184" not in text
    options = text.split("Options:", 1)[-1]
    for generic in ("INTEGER", "FLOAT", "TEXT", "RANGE", "FILENAME", "FILE.png", "REPORT.json", " FILE "):
        assert generic not in options, (generic, options)


def _expected_metavar(opt: click.Option):
    t = opt.type
    long_names = [o for o in opt.opts if o.startswith("--")]
    if any(n in ("--json", "--save", "--plot", "--from", "--baseline", "--output") for n in long_names):
        return {METAVARS["path"]}
    if isinstance(t, click.Choice):
        return {"[" + "|".join(map(str, t.choices)) + "]"}
    if isinstance(t, IntList):
        return {METAVARS["int_list"]}
    if isinstance(t, (click.IntRange, type(click.INT))):
        return {METAVARS["int"]}
    if isinstance(t, (click.FloatRange, type(click.FLOAT))):
        return set(METAVARS["float"])
    if isinstance(t, click.Path):
        return {METAVARS["path"]}
    # value syntaxes of their own, each named by its syntax
    return {
        METAVARS["range"],
        "N:LEN",
        "DIST",
        "NAME|PATH",
        "auto|all|MODE:CLOCK,...",
        "LABEL",
        "decode:N|mixed:N:T",
        "SIZE[:RANK[:INTERLEAVE]]",
        "NAME[,NAME...]",
        "REV",  # a git revision (check --against)
    }


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_metavars_follow_the_convention(path, command):
    ctx = click.Context(command, info_name=" ".join(("kvaddr", *path)))
    checked = 0
    for p in command.params:
        if not isinstance(p, click.Option) or p.is_flag or p.name == "help":
            continue
        assert p.make_metavar(ctx) in _expected_metavar(p), (p.opts, p.make_metavar(ctx))
        checked += 1
    if path and path != ("trace",):
        assert checked or path == ("info",) or path == ("profiles",)


def test_a_machine_limit_bound_is_shown_as_a_lower_bound():
    text = run("profile", "--help").stdout
    assert "x>=0" in text  # --seed: 0 to 2**63 - 1
    assert "1<=x<=4096" in text  # --layers: a real bound is still shown


def test_trace_generate_has_its_own_exit_status_text():
    text = run("trace", "generate", "--help").stdout
    exit_text = text.split("Exit status:", 1)[1].split("Options:", 1)[0]
    assert "strategy" not in exit_text and "--device cuda" not in exit_text and "reference" not in exit_text
    assert "-o PATH" in exit_text and "141" in exit_text
    assert text.count("Exit status:") == 1


@pytest.mark.parametrize(
    "path",
    [(), ("profile",), ("compare",), ("check",), ("trace", "generate"), ("replay",), ("sweep",), ("profiles",)],
)
def test_every_exit_status_text_gives_141(path):
    assert f"{EXIT_PIPE}" in run(*path, "--help").stdout


def test_examples_rejects_a_wrong_count():
    with pytest.raises(ValueError):
        common.examples("kvaddr info")
    with pytest.raises(ValueError):
        common.examples(*["kvaddr info"] * 4)


# ----------------------------------------------------------------------------- item 7: output paths up front


def _no_work_done(r) -> bool:
    """Nothing was profiled, replayed or generated: no status line of a run on stderr."""
    return "checking" not in r.stderr and "replaying" not in r.stderr and "wrote" not in r.stderr


@needs_dev_full
@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["profile", *FAST_PROFILE, "--json", "/dev/full"], "'--json'"),
        (["profile", *FAST_PROFILE, "--save", "/dev/full"], "'--save'"),
        (["sweep", *FAST_PROFILE, "--json", "/dev/full"], "'--json'"),
        (["sweep", *FAST_PROFILE, "--save", "/dev/full"], "'--save'"),
        (["replay", "nothing-here.jsonl", "--json", "/dev/full"], "'--json'"),
        (["compare", "a.json", "b.json", "--json", "/dev/full"], "'--json'"),
        (["check", "--baseline", "a.json", "--json", "/dev/full"], "'--json'"),
        (["check", "--baseline", "a.json", "--save", "/dev/full"], "'--save'"),
        (["trace", "generate", "--steps", "5", "-o", "/dev/full"], "'-o' / '--output'"),
    ],
)
def test_dev_full_is_refused_before_the_work(args, option):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for {option}" in r.stderr, r.stderr
    assert "/dev/full" in r.stderr and _no_work_done(r) and r.stdout == ""


@pytest.mark.parametrize("name", ["s.txt", "s", "s.png.bak", "s.PDFX"])
def test_sweep_plot_extension_is_checked_before_profiling(tmp_path, name):
    r = run("sweep", *FAST_PROFILE, "--plot", str(tmp_path / name))
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--plot'" in r.stderr and ".png, .pdf, .svg" in r.stderr
    assert _no_work_done(r) and r.stdout == ""


def test_sweep_plot_extension_ignores_case(tmp_path):
    assert common.check_output_path(str(tmp_path / "s.PNG"), "--plot", extensions=common.PLOT_FORMATS) is None


def test_a_missing_folder_and_a_folder_are_refused(tmp_path):
    r = run("profile", *FAST_PROFILE, "--json", str(tmp_path / "no" / "r.json"))
    assert r.exit_code == 2 and "'--json'" in r.stderr and "does not exist" in r.stderr
    assert output_path_problem(str(tmp_path)) == f"{str(tmp_path)!r} is a folder"


def test_dev_null_passes(tmp_path):
    r = run("profile", *FAST_PROFILE, "--json", "/dev/null")
    assert r.exit_code == 0, r.output


def test_the_check_leaves_an_existing_file_as_it_was(tmp_path):
    keep = tmp_path / "keep.json"
    keep.write_text("precious\n")
    before = keep.stat()
    os.utime(keep, ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))
    before = keep.stat()
    assert output_path_problem(str(keep)) is None
    after = keep.stat()
    assert keep.read_text() == "precious\n" and after.st_mtime_ns == before.st_mtime_ns
    # a run refused later (an invalid --plot name) leaves --json's existing file untouched
    r = run("sweep", *FAST_PROFILE, "--json", str(keep), "--plot", str(tmp_path / "s.txt"))
    assert r.exit_code == 2 and keep.read_text() == "precious\n"


def test_a_new_file_is_not_created_by_the_check(tmp_path):
    assert output_path_problem(str(tmp_path / "new.json")) is None
    assert not (tmp_path / "new.json").exists()


@needs_dev_full
def test_a_write_that_fails_at_the_end_exits_3():
    with pytest.raises(common.Abort) as info:
        common.write_json({"a": 1}, "/dev/full", "profile")
    assert info.value.code == common.EXIT_ENV == 3 and "--json" in str(info.value)


# ----------------------------------------------------------------------------- item 7: sweep --from a baseline


@pytest.fixture(scope="module")
def two_run_baseline(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep-from") / "base.json"
    for model in ("deepseek-v3.2", "glm-5"):
        r = CliRunner().invoke(
            cli_module.cli,
            ["profile", "--device", "cpu", "--batch", "1,2", "--layers", "1", "--budget", "0", "--model", model]
            + ["--save", str(path)],
        )
        assert r.exit_code == 0, r.output
    assert len(json.loads(path.read_text())["runs"]) == 2
    return path


def test_sweep_from_a_baseline_of_one_run(tmp_path):
    path = tmp_path / "one.json"
    r = run("profile", "--device", "cpu", "--batch", "1,2", "--layers", "1", "--budget", "0", "--save", str(path))
    assert r.exit_code == 0, r.output
    r = run("sweep", "--from", str(path), "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["sweep"] and [s["batch"] for s in doc["shapes"]] == [1, 2]
    assert "checking" not in r.stderr  # nothing profiled


def test_sweep_from_a_baseline_of_several_runs_needs_run(two_run_baseline):
    r = run("sweep", "--from", str(two_run_baseline))
    assert r.exit_code == 2 and "'--from'" in r.stderr and "holds 2 runs" in r.stderr
    assert "deepseek-v3.2" in r.stderr and "glm-5" in r.stderr


@pytest.mark.parametrize("label", ["deepseek-v3.2", "glm-5"])
def test_sweep_from_run_picks_the_run(two_run_baseline, label):
    r = run("sweep", "--from", str(two_run_baseline), "--run", label, "--json", "-")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["workload"]["model"] == label


def test_sweep_run_unknown_or_without_from(two_run_baseline):
    r = run("sweep", "--from", str(two_run_baseline), "--run", "nope")
    assert r.exit_code == 2 and "'--run'" in r.stderr and "glm-5" in r.stderr
    r = run("sweep", *FAST_PROFILE, "--run", "glm-5")
    assert r.exit_code == 2 and "'--run'" in r.stderr and _no_work_done(r)


# ----------------------------------------------------------------------------- item 8: a closed stdout


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KVADDR_DEBUG", None)
    return env


def _run_with_stdout_closed(args):
    """Run ``python -m kvaddr.cli ARGS`` with its stdout's reader closed before it writes anything."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvaddr.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    proc.stdout.close()  # the reader goes away, as `| head -1` does after its line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return proc.wait(timeout=120), err


def _quiet(stderr: str, command: str) -> bool:
    bad = ("Traceback", "Error", "error", "pipe", "Exception ignored", "internal")
    return all(b not in stderr for b in bad) and all(
        line.startswith(f"kvaddr {command}: ") for line in stderr.splitlines()
    )


@pytest.mark.parametrize(
    "args",
    [
        ["profile", *FAST_PROFILE],
        ["profile", *FAST_PROFILE, "--json", "-"],
        ["trace", "generate", "--steps", "50"],
        ["profiles"],
        ["info", "--json"],
    ],
    ids=["profile", "profile-json", "trace-generate", "profiles", "info"],
)
def test_a_closed_stdout_exits_141_quietly(args):
    code, err = _run_with_stdout_closed(args)
    assert code == EXIT_PIPE == 128 + signal.SIGPIPE, (code, err)
    assert _quiet(err, " ".join(args[:2]) if args[0] == "trace" else args[0]), err
    assert "done in" not in err  # it stopped at the first write


def test_profile_piped_to_head_in_a_shell(tmp_path):
    """The issue's own pipeline. head may read everything before it exits (then no write fails and the
    status is 0), but never 1 and never a word on stderr about the pipe."""
    err_path = tmp_path / "err.txt"
    cmd = (
        f"{sys.executable} -m kvaddr.cli profile {' '.join(FAST_PROFILE)} 2>'{err_path}' | head -1 >/dev/null; "
        'echo "${PIPESTATUS[0]}"'
    )
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=_env(), cwd=ROOT, check=False)
    err = err_path.read_text()
    assert out.stdout.strip() in ("0", "141"), (out.stdout, err)
    assert "Traceback" not in err and "Broken" not in err and "Exception ignored" not in err


def test_is_broken_pipe():
    assert common.is_broken_pipe(BrokenPipeError())
    assert common.is_broken_pipe(OSError(errno.EPIPE, "Broken pipe"))
    assert not common.is_broken_pipe(OSError(errno.ENOSPC, "No space left on device"))
    assert not common.is_broken_pipe(ValueError())


# ----------------------------------------------------------------------------- main(): click's standalone behaviour kept


@pytest.mark.parametrize(
    ("args", "code", "where", "text"),
    [
        (["--version"], 0, "out", "kvaddr "),
        (["--help"], 0, "out", "Examples:"),
        (["profile", "--batch", "x"], 2, "err", "Invalid value for '--batch'"),
        (["no-such-command"], 2, "err", "No such command"),
        (["profiles", "no-such-profile"], 2, "err", "no profile named"),
    ],
)
def test_main_keeps_click_standalone_exit_codes(capsys, args, code, where, text):
    with pytest.raises(SystemExit) as info:
        cli_module.main(args)
    assert info.value.code == code
    captured = capsys.readouterr()
    assert text in (captured.out if where == "out" else captured.err)
