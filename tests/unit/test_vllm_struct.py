"""The ctypes mirrors of ``struct VllmStepParams`` and ``struct VllmDraftParams`` have the C structs' layouts.

A tiny host program that includes kernels.cu prints the struct's size and every
field's offset (compiled with the machine's nvcc; skipped without it); the
ctypes.Structure must agree field by field, by name.
"""

import shutil
import subprocess

import pytest

from kvaddr import kernel_loader
from kvaddr.engines.vllm import VllmStepParams
from kvaddr.engines.vllm_draft import VllmDraftParams
from tests.support.kernel_source import expand

NVCC = shutil.which("nvcc")
STRUCTS = pytest.mark.parametrize("mirror", [VllmStepParams, VllmDraftParams], ids=lambda m: m.__name__)


@STRUCTS
def test_ctypes_fields_are_the_c_fields_in_order(mirror):
    name = mirror.__name__
    src = expand()
    body = src[src.index(f"struct {name} {{") : src.index("};", src.index(f"struct {name} {{"))]
    import re

    c_names = re.findall(r"\b(\w+)(?:\[4\])?;\s*//", body)
    assert c_names == [field for field, _ in mirror._fields_]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: struct layout check skipped")
@STRUCTS
def test_struct_layout_matches_the_c_struct(tmp_path, mirror):
    name = mirror.__name__
    fields = [field for field, _ in mirror._fields_]
    prog = tmp_path / "layout.cu"
    lines = [
        f'#include "{kernel_loader.SOURCE_PATH}"',
        "#include <cstdio>",
        "#include <cstddef>",
        "int main() {",
        f'    printf("sizeof %zu\\n", sizeof({name}));',
    ]
    lines += [f'    printf("{f} %zu\\n", offsetof({name}, {f}));' for f in fields]
    lines += ["    return 0;", "}"]
    prog.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    proc = subprocess.run(
        [NVCC, "-std=c++14", "-arch=sm_90", "-o", str(exe), str(prog)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    got = dict(line.split() for line in out.strip().splitlines())
    assert int(got["sizeof"]) == __import__("ctypes").sizeof(mirror)
    for f in fields:
        assert int(got[f]) == getattr(mirror, f).offset, f
