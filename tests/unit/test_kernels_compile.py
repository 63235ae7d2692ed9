"""kernels.cu compiles with the machine's nvcc for sm_80 and sm_90, every library instantiation
(kvaddr/kernel_names.py's LIBRARY_KERNELS, as explicit instantiations) and, with KV_BASELINES, every
baseline, with no spills and no stack frame (ptxas -v); the library kernels are templates and the
baselines extern "C" kernels that only KV_BASELINES compiles."""

import re
import shutil
import subprocess

import pytest

from kvaddr import kernel_loader
from kvaddr.kernel_names import BASELINE_KERNELS, LIBRARY_KERNELS
from tests.support.kernel_source import expand

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.toolchain  # opt-in: --run-toolchain (tests/conftest.py)


def instantiations() -> str:
    """A translation unit: kernels.cu and an explicit instantiation of every LIBRARY_KERNELS entry."""
    lines = [f'#include "{kernel_loader.SOURCE_PATH}"']
    for expr in LIBRARY_KERNELS:
        structs = {
            "vllm_draft_": "VllmDraftParams",
            "vllm_": "VllmStepParams",
            "dsa_": "KvDsaTopkParams",
            "mtp_": "KvMtpParams",
        }
        params = next((s for prefix, s in structs.items() if expr.startswith(prefix)), "KvStepParams")
        lines.append(f"template __global__ void {expr}(const {params});")
    return "\n".join(lines) + "\n"


def ptxas_report(arch, src, tmp_path, *defines):
    out = tmp_path / f"{src.stem}_{arch}.cubin"
    cmd = [NVCC, f"-arch={arch}", "-cubin", "-std=c++14", "-Xptxas", "-v", "-Werror", "all-warnings"]
    cmd += [f"-D{d}" for d in defines] + ["-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert out.stat().st_size > 0
    functions = re.findall(r"Compiling entry function '(\w+)'", log)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(functions), log
    for frame, stores, loads in frames:
        assert (int(frame), int(stores), int(loads)) == (0, 0, 0), log
    return functions


def demangled(names):
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return [re.sub(r"^void\s+|\(.*\)$", "", line) for line in proc.stdout.splitlines()]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernels.cu compile check skipped")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_library_kernels_compile_without_spills_or_stack(arch, tmp_path):
    src = tmp_path / "library.cu"
    src.write_text(instantiations())
    functions = ptxas_report(arch, src, tmp_path)
    assert all(f.startswith("_Z") for f in functions), functions  # templates only: no extern "C" kernel
    if shutil.which("c++filt"):
        # a core-step kernel without DSA is its DSA = false instantiation (the default argument)
        names = [re.sub(r"(, false)+>$", ">", n) for n in demangled(functions)]  # defaulted arguments
        assert sorted(names) == sorted(LIBRARY_KERNELS)
    else:
        assert len(functions) == len(LIBRARY_KERNELS)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernels.cu compile check skipped")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_baseline_kernels_compile_without_spills_or_stack(arch, tmp_path):
    src = tmp_path / "baselines.cu"
    src.write_text(f'#include "{kernel_loader.SOURCE_PATH}"\n')
    assert sorted(ptxas_report(arch, src, tmp_path, "KV_BASELINES")) == sorted(BASELINE_KERNELS)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernels.cu compile check skipped")
def test_library_module_compiles_no_kernel_by_itself(tmp_path):
    """Without KV_BASELINES and without name expressions, kernels.cu defines no kernel."""
    src = tmp_path / "empty.cu"
    src.write_text(f'#include "{kernel_loader.SOURCE_PATH}"\n')
    assert ptxas_report("sm_90", src, tmp_path) == []


def test_kernels_cu_only_includes_family_headers():
    """kernels.cu: a header comment and `#include "kernels/NAME.cuh"` lines (the loader expands
    exactly that form), the baselines under #ifdef KV_BASELINES."""
    code = [line for line in kernel_loader.SOURCE_PATH.read_text().splitlines() if line and not line.startswith("//")]
    assert code == [
        '#include "kernels/common.cuh"',
        '#include "kernels/attention.cuh"',
        '#include "kernels/dsa_step.cuh"',
        '#include "kernels/step.cuh"',
        '#include "kernels/mtp.cuh"',
        '#include "kernels/vllm.cuh"',
        '#include "kernels/vllm_dsa.cuh"',
        '#include "kernels/dsa.cuh"',
        '#include "kernels/spec.cuh"',
        "#ifdef KV_BASELINES",
        '#include "kernels/baselines.cuh"',
        "#endif",
    ]


def test_constants_and_kernel_names_are_in_the_source():
    src = expand()
    c = {k: int(v) for k, v in re.findall(r"^#define (KV_[A-Z_0-9]+) (\d+)\s*(?://.*)?$", src, flags=re.M)}
    assert c["KV_THREADS"] % 32 == 0 and c["KV_TOKENS"] % c["KV_THREADS"] == 0
    assert c["KV_MAX_CACHES"] == 4 and c["KV_TILE"] >= c["KV_THREADS"]
    for name in BASELINE_KERNELS:
        assert re.search(rf'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+{name}\(', src), name
    for template in sorted({e.split("<")[0] for e in LIBRARY_KERNELS}):
        assert re.search(rf"^__global__ void __launch_bounds__\(.*\) {template}\(", src, flags=re.M), template
    assert src.count('extern "C" __global__') == len(BASELINE_KERNELS)
    for gone in ("KV_TRACE", "KV_ABL", "KV_FIX_", "KV_V9_DEFAULT", "KV_M1_", "meta_impl", "step1old", "kv_meta_block3"):
        assert gone not in src, gone


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
