"""tests/conftest.py: the toolchain checks are opt-in, and skips are summed up by cause."""

import os
import subprocess
import sys
from pathlib import Path

from tests.support import skips

ROOT = Path(__file__).resolve().parents[2]


def pytest_in_a_child(*args):
    env = {k: v for k, v in os.environ.items() if k != skips.TOOLCHAIN_ENV}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_each_cause_has_one_wording():
    assert skips.cause("could not import 'torch': No module named 'torch'") == skips.NO_TORCH
    assert skips.cause("nvcc not found on PATH: struct layout check skipped") == skips.NO_NVCC
    assert skips.cause("no g++: the v9 emulator needs a C++20 compiler") == skips.NO_CXX
    assert skips.cause("no C++ compiler: kernel emulation skipped") == skips.NO_CXX
    assert skips.cause("could not import 'matplotlib': No module named 'matplotlib'") == skips.NO_PLOT
    assert skips.cause("needs two GPUs") == "needs two GPUs"  # a reason of its own stays as it is
    for wording in (skips.NO_CUPY, skips.NO_TORCH, skips.NO_PLOT, skips.TOOLCHAIN_OPT_IN):
        assert "CI" not in wording and skips.cause(wording) == wording


def test_the_tests_that_call_nvcc_are_toolchain_checks():
    files = ("tests/unit/test_kernel_params.py", "tests/unit/test_vllm_struct.py")
    r = pytest_in_a_child("-q", "--collect-only", "-m", "toolchain", *files)
    assert r.returncode == 0, r.stdout + r.stderr
    chosen = {line.split("::")[1].split("[")[0] for line in r.stdout.splitlines() if "::" in line}
    assert chosen == {"test_params_layout_matches_nvcc", "test_struct_layout_matches_the_c_struct"}


def test_toolchain_checks_skip_by_default_and_skips_are_grouped():
    r = pytest_in_a_child("-q", "-rs", "tests/unit/test_kernel_params.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{skips.TOOLCHAIN_OPT_IN} (1)" in r.stdout
    assert "SKIPPED [" not in r.stdout  # -rs's per-test lines give way to the grouped summary
    listed = pytest_in_a_child("-q", "--list-skips", "tests/unit/test_kernel_params.py")
    assert "SKIPPED [1]" in listed.stdout and skips.TOOLCHAIN_OPT_IN in listed.stdout
