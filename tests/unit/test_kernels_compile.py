"""kernels.cu compiles with the machine's nvcc for sm_80 and sm_90, with no spills and
no stack frame (ptxas -v); and the constants the Python side reads match the source."""

import re
import shutil
import subprocess

import pytest

from kvaddr import kernel_loader

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.toolchain  # opt-in: --run-toolchain (tests/conftest.py)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernels.cu compile check skipped")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_without_spills_or_stack(arch, tmp_path):
    out = tmp_path / f"kernels_{arch}.cubin"
    proc = subprocess.run(
        [
            NVCC,
            f"-arch={arch}",
            "-cubin",
            "-std=c++14",
            "-Xptxas",
            "-v",
            "-Werror",
            "all-warnings",
            "-o",
            str(out),
            str(kernel_loader.SOURCE_PATH),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    functions = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sorted(functions) == sorted(kernel_loader.KERNEL_NAMES), log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(kernel_loader.KERNEL_NAMES), log
    for frame, stores, loads in frames:
        assert (int(frame), int(stores), int(loads)) == (0, 0, 0), log
    assert out.stat().st_size > 0


def test_constants_are_read_from_the_source():
    c = kernel_loader.constants()
    assert c["KV_THREADS"] % 32 == 0 and c["KV_TOKENS"] % c["KV_THREADS"] == 0
    assert c["KV_MAX_CACHES"] == 4 and c["KV_TILE"] >= c["KV_THREADS"]
    for name in kernel_loader.KERNEL_NAMES:
        assert re.search(
            rf'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+{name}\(', kernel_loader.source()
        ), name


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: floor-kernel compile check skipped")
def test_floor_benchmark_kernels_compile(tmp_path):
    """benchmarks/floor_step.py's minimal kernels (a measuring instrument, CUDA source inline)."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "floor_step.py")
    with open(path) as fh:
        source = re.search(r'SOURCE = r"""(.*?)"""', fh.read(), re.S).group(1)
    cu = tmp_path / "floor.cu"
    cu.write_text(source)
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(tmp_path / "floor.cubin"), str(cu)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert sorted(re.findall(r"Compiling entry function '(\w+)'", log)) == [
        "floor_decode_min_1",
        "floor_decode_min_2",
        "floor_decode_out_1",
        "floor_decode_out_2",
        "floor_mixed_min_1",
        "floor_mixed_min_2",
        "floor_roundtrip",
    ]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: KV_TRACE compile check skipped")
def test_traced_kernels_compile(tmp_path):
    """kernels.cu with ``KV_TRACE`` (benchmarks/trace_step1m.py's module) compiles for sm_90, and
    every stamp slot is inside kv_trace's rows."""
    src = kernel_loader.source()
    slots = [int(s) for s in re.findall(r"KV_STAMP(?:_TIME|_VALUE)?\((\d+)", src)]
    assert slots and max(slots) < kernel_loader.constants()["KV_TRACE_SLOTS"]
    out = tmp_path / "kernels_trace.cubin"
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "-cubin", "-std=c++14", "-DKV_TRACE", "-o", str(out), str(kernel_loader.SOURCE_PATH)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
