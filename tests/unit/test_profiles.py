"""Workload profiles: the bundled ones, loading, errors (file, key, line) and `--profile`."""

import json
import os

import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment
from kvaddr.measure.profiles import (
    PROFILE_KEYS,
    SECTIONS,
    TRACE_KEYS,
    ProfileError,
    available,
    key_lines,
    load_profile,
    parse_profile,
)

BUNDLED = (
    "deepseek-v3.2-decode",
    "deepseek-v3.2-mtp",
    "glm-5",
    "mixed-chunked-prefill",
    "long-context-128k",
    "large-batch-4096",
)
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args, **kw):
    return CliRunner().invoke(cli_module.cli, list(args), **kw)


def write(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------------------------- the bundled profiles


def test_every_bundled_profile_loads_and_says_where_its_numbers_come_from():
    found = available()
    for name in BUNDLED:
        assert name in found, f"{name} is not shipped"
        prof = load_profile(name)
        assert prof.description and len(prof.source) > 80
        assert prof.tables["profile"] and prof.tables["trace"]
    assert load_profile("deepseek-v3.2-mtp").tables["profile"]["spec_tokens"] == 1
    assert load_profile("glm-5").tables["profile"]["model"] == "glm-5"
    assert load_profile("long-context-128k").tables["profile"]["context"] == 131072
    assert max(load_profile("large-batch-4096").tables["profile"]["batch"]) == 4096
    prefill = load_profile("mixed-chunked-prefill").tables["profile"]["prefill"]
    assert prefill[0] >= 1 and prefill[1] >= 1


def test_every_key_names_an_option_of_its_command():
    commands = {
        "profile": cli_module.cli.commands["profile"],
        "trace": cli_module.cli.commands["trace"].commands["generate"],
    }
    for section, keys in SECTIONS.items():
        flags = {o for p in commands[section].params for o in getattr(p, "opts", ())}
        for key in keys:
            assert "--" + key.replace("_", "-") in flags, f"[{section}] {key} is not an option"
    assert set(PROFILE_KEYS) and set(TRACE_KEYS)


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_profile_passes_its_commands_checks(name):
    # --help after --profile: the eager callback checks every value against its option, then help exits 0.
    for cmd in (["profile"], ["trace", "generate"], ["sweep"], ["replay"]):
        r = run(*cmd, "--profile", name, "--help")
        assert r.exit_code == 0, (cmd, r.output)


def test_profiles_command_lists_names_and_descriptions_and_shows_one_with_its_source():
    r = run("profiles")
    assert r.exit_code == 0, r.output
    for name in BUNDLED:
        assert name in r.stdout
    assert "kvaddr profiles NAME" in r.stderr
    assert "docs/spec.md" in run("profiles", "deepseek-v3.2-decode").stdout
    doc = json.loads(run("profiles", "--json").stdout)
    assert {p["name"] for p in doc["profiles"]} >= set(BUNDLED) and doc["errors"] == []
    one = run("profiles", "glm-5")
    assert one.exit_code == 0 and "[profile]" in one.stdout and "assumption" in one.stdout.lower()


# ----------------------------------------------------------------------------- applying a profile


def test_profile_fills_options_and_the_command_line_wins(tmp_path):
    path = write(
        tmp_path,
        'description = "t"\nsource = "test"\n[profile]\nbatch = [2, 3]\nlayers = 3\n'
        'spec_tokens = 1\ncontext = [100, 200]\nmodel = "glm-5"\n',
    )
    r = run("profile", "--profile", path, "--budget", "0", "--layers", "2", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [s["batch"] for s in doc["shapes"]] == [2, 3]
    w = doc["workload"]
    assert (w["model"], w["num_layers"], w["spec_tokens"]) == ("glm-5", 2, 1)  # --layers 2 beat the profile's 3
    assert w["context"]["lo"] == 100 and w["context"]["hi"] == 200
    assert doc["options"]["workload_profile"] == path


def test_a_profile_by_name_from_the_search_path(tmp_path, monkeypatch):
    write(tmp_path, 'source = "mine"\n[profile]\nbatch = 5\nlayers = 1\n', "mine.toml")
    monkeypatch.setenv("KVADDR_PROFILE_PATH", str(tmp_path))
    assert "mine" in available()
    r = run("profile", "--profile", "mine", "--budget", "0", "--json", "-")
    assert r.exit_code == 0, r.output
    assert [s["batch"] for s in json.loads(r.stdout)["shapes"]] == [5]


def test_trace_generate_takes_the_trace_table():
    r = run("trace", "generate", "--profile", "deepseek-v3.2-mtp", "--steps", "5", "--warmup-steps", "0")
    assert r.exit_code == 0, r.output
    header = json.loads(r.stdout.splitlines()[0])
    assert header["generator"]["spec_tokens"] == 1 and header["generator"]["acceptance"] == 0.85
    assert header["generator"]["steps"] == 5


# ----------------------------------------------------------------------------- errors name the file, key and line


def test_unknown_key_names_file_key_and_line(tmp_path):
    path = write(tmp_path, 'description = "x"\n\n[profile]\nbatch = [1, 2]\nbacth = 3\n')
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert (e.value.path, e.value.line, e.value.key) == (path, 5, "profile.bacth")
    r = run("profile", "--profile", path)
    assert r.exit_code == 2
    text = " ".join(r.stderr.split())
    assert path in text and "line 5" in text and "'bacth'" in text
    assert "Traceback" not in r.output


def test_unknown_table_and_top_level_key(tmp_path):
    with pytest.raises(ProfileError, match=r"line 3: unknown key 'colour'"):
        parse_profile('source = "s"\n\ncolour = "red"\n', "f.toml")
    with pytest.raises(ProfileError, match=r"line 2: unknown key 'sweep'"):
        parse_profile('source = "s"\n[sweep]\nbatch = 1\n', "f.toml")
    with pytest.raises(ProfileError, match=r"'source' must be a string"):
        parse_profile("source = 3\n", "f.toml")


def test_malformed_toml_gives_its_line(tmp_path):
    path = write(tmp_path, 'description = "x"\n[profile]\nbatch = [1, 2\nlayers = 3\n')
    r = run("profile", "--profile", path)
    assert r.exit_code == 2
    assert path in r.stderr and "not valid TOML" in r.stderr
    with pytest.raises(ProfileError, match=r"line 2"):
        parse_profile('source = "x"\nmodel = = 3\n', "f.toml")


@pytest.mark.parametrize(
    "body, line, words",
    [
        ("[profile]\n# c\nbatch = [1, 0]\n", 3, "batch size must be in"),
        ("[profile]\nlayers = 1.5\n", 2, "layers"),
        ("[profile]\nmodel = 'llama'\n", 2, "llama"),
        ("[profile]\nstep_ms = true\n", 2, "true"),
        ("[profile]\nlayers = [1, 2]\n", 2, "takes one value"),
        ("[profile]\ncontext = [9, 2]\n", 2, "LO must be <= HI"),
        ("[trace]\n\nprompt_len = 'zipf:3'\n", 3, "unknown distribution"),
    ],
)
def test_a_value_the_option_rejects_names_the_line(tmp_path, body, line, words):
    path = write(tmp_path, 'source = "s"\n' + body)
    cmd = ["trace", "generate"] if "[trace]" in body else ["profile"]
    r = run(*cmd, "--profile", path)
    assert r.exit_code == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"line {line + 1}:" in text and words in text and path in text


def test_missing_profile(tmp_path):
    r = run("profile", "--profile", "no-such-profile")
    assert r.exit_code == 2 and "no profile named 'no-such-profile'" in r.stderr
    assert "deepseek-v3.2-decode" in r.stderr  # the known names are listed
    r = run("profile", "--profile", str(tmp_path / "nope.toml"))
    assert r.exit_code == 2 and "no such profile file" in r.stderr


def test_profiles_listing_reports_a_broken_profile(tmp_path, monkeypatch):
    write(tmp_path, "[profile]\nbogus = 1\n", "broken.toml")
    monkeypatch.setenv("KVADDR_PROFILE_PATH", str(tmp_path))
    r = run("profiles")
    assert r.exit_code == 1
    assert "broken.toml, line 2" in r.stderr and "deepseek-v3.2-decode" in r.stdout


def test_key_lines_follow_tables_dotted_keys_and_skip_multiline_strings():
    text = (
        'source = """\nbatch = 99\n"""\n[profile]\n  batch = 1  # c\n"spec_tokens" = 2\n'
        "[trace]\nseed = 3\nprofile.layers = 4\n"
    )
    lines = key_lines(text)
    assert lines["source"] == 1 and "batch" not in lines
    assert lines["profile.batch"] == 5 and lines["profile.spec_tokens"] == 6
    assert lines["trace.seed"] == 8 and lines["trace.profile.layers"] == 9


def test_the_shipped_profiles_are_found_from_a_checkout_or_an_install():
    """From a checkout: profiles/ beside the package; from a wheel: share/kvaddr/profiles."""
    from pathlib import Path

    from kvaddr.measure.profiles import bundled_dirs

    shipped = {
        "deepseek-v3.2-decode",
        "deepseek-v3.2-mtp",
        "glm-5",
        "mixed-chunked-prefill",
        "long-context-128k",
        "large-batch-4096",
    }
    found = {p.stem for d in bundled_dirs() for p in Path(d).glob("*.toml")}
    assert shipped <= found, (bundled_dirs(), found)
    root = os.path.dirname(os.path.dirname(os.path.abspath(cli_module.__file__)))
    if os.path.isfile(os.path.join(root, "setup.cfg")):  # running from a checkout
        assert os.path.join(root, "profiles") in [str(d) for d in bundled_dirs()]


def test_profile_sets_attention_outputs(tmp_path):
    # A list-valued option with a converting callback (--attention) goes through click as on the command line.
    path = write(
        tmp_path,
        'description = "t"\nsource = "test"\n[profile]\nbatch = [2]\nattention = ["flashinfer", "varlen"]\n'
        "kv_indices_capacity = 4096\n",
    )
    r = run("profile", "--profile", path, "--device", "cpu", "--budget", "0", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["options"]["attention"] == ["flashinfer", "varlen"]
    assert doc["options"]["kv_indices_capacity"] == 4096
    bad = write(tmp_path, 'description = "t"\nsource = "test"\n[profile]\nattention = ["flashattn"]\n', name="bad.toml")
    r = run("profile", "--profile", bad, "--device", "cpu", "--budget", "0")
    assert r.exit_code == 2 and "attention" in r.output, r.output


def test_the_profile_list_reads_at_80_columns(monkeypatch):
    import io

    from rich.console import Console

    from kvaddr.commands import traces

    buf = io.StringIO()
    monkeypatch.setattr(traces, "out_console", lambda: Console(file=buf, width=80, markup=False, highlight=False))
    r = run("profiles")
    assert r.exit_code == 0, r.output
    lines = buf.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert len(lines) <= 1 + 3 * len(BUNDLED), lines  # the header, at most three lines a profile
