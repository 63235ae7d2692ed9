"""kernels.cu's v9 ablation section (``#ifdef KV_ABLATION``: benchmarks/ablate_v9.py and
tests/gpu/test_ablate_v9_gpu.py), in the module those build (tests/support/ablation.py: the
head of kernels.cu and its v9 section), compiles with no spills and no stack frame, and its
mask-0 kernels are v9-old's machine code (``kv_step_one``'s ABL parameter defaults to 0) and
the KV_V9_DEFAULT ones the library's default ``kvaddr_step1_c*``."""

import re
import shutil
import struct
import subprocess

import pytest

from kvaddr import kernel_loader
from tests.support.ablation import ablation_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.toolchain  # opt-in: --run-toolchain (tests/conftest.py)
MASKS = (0, 1, 2, 4, 8, 16, 32, 64, 79, 95, 127, 128, 256, 384, 416, 512, 591)
MASKS += (417,)  # round 2: the error-record merge (the clearing and store variants went with sticky records)
#: KV_V9_DEFAULT: the fixes the library's kvaddr_step1_c* instantiate
DEFAULT = 32 | 128 | 256


def _text_sections(path) -> dict:
    """``{kernel name: machine code}`` of a cubin (ELF64: the ``.text.<name>`` sections)."""
    d = path.read_bytes()
    (shoff,) = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    names_at = hdrs[shstrndx][4]

    def name(off):
        end = d.index(b"\0", names_at + off)
        return d[names_at + off : end].decode()

    out = {}
    for h in hdrs:
        n = name(h[0])
        if n.startswith(".text."):
            out[n[len(".text.") :]] = d[h[4] : h[4] + h[5]]
    return out


def test_every_mask_has_its_kernels_in_the_source():
    src = kernel_loader.source()
    section = src[src.index("#ifdef KV_ABLATION") : src.index("#endif  // KV_ABLATION")]
    assert sorted(int(m) for m in re.findall(r"KV_ABL_ENTRY\(G, (\d+)\)", section)) == sorted(MASKS)
    bits = {k: int(v) for k, v in re.findall(r"#define (KV_(?:ABL|FIX)_\w+) (\d+)", src)}
    assert sorted(bits.values()) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    # the record bits of the fifth session are gone with the clearing loop and the unconditional store
    for gone in ("KV_ABL_NO_CLEAR", "KV_ABL_NO_RECORD", "KV_FIX_LATE_CLEAR", "KV_FIX_REC16", "kv1_clear_records"):
        assert gone not in src, gone
    # "- all" skips every phase, "- all but outputs" every phase but the per-request outputs
    skips = bits["KV_ABL_NO_ERR_STORE"] | bits["KV_ABL_NO_REQ_CHECKS"] | bits["KV_ABL_NO_SCAN"]
    skips |= bits["KV_ABL_NO_PAD"] | bits["KV_ABL_NO_TOKEN_CHECKS"]
    assert skips == 79 and skips | bits["KV_ABL_NO_REQ_OUT"] == 95 and 95 | bits["KV_ABL_PARAM_REGS"] == 127
    assert bits["KV_FIX_DECODE_FIRST"] | bits["KV_FIX_LEAN"] == 384 and 384 | bits["KV_ABL_PARAM_REGS"] == 416
    assert bits["KV_ABL_UNGUARDED_LOADS"] == 512 and 79 | 512 == 591
    assert 416 | bits["KV_ABL_NO_ERR_STORE"] == 417
    fixes = bits["KV_ABL_PARAM_REGS"] | bits["KV_FIX_DECODE_FIRST"] | bits["KV_FIX_LEAN"]
    assert fixes == DEFAULT == 416
    m = re.search(r"#define KV_V9_DEFAULT \(([^)]*)\)", src)
    assert m and sum(bits[b.strip()] for b in m.group(1).split("|")) == DEFAULT


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: ablation compile check skipped")
def test_ablation_kernels_compile_and_mask_0_is_v9(tmp_path):
    out = tmp_path / "kernels_abl.cubin"
    cu = tmp_path / "kernels_abl.cu"
    cu.write_text(ablation_source())
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "-cubin", "-std=c++14", "-Xptxas", "-v", "-Werror", "all-warnings"]
        + ["-o", str(out), str(cu)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    functions = set(re.findall(r"Compiling entry function '(\w+)'", log))
    extra = {f"kvaddr_step1_abl_c{g}_m{m}" for g in (1, 2) for m in MASKS}
    extra |= {"kvaddr_abl_floor_out_c1", "kvaddr_abl_floor_out_c2"}
    v9 = {n for n in kernel_loader.KERNEL_NAMES if n.startswith(("kvaddr_step1_", "kvaddr_step1old_"))}
    assert len(v9) == 20 and functions == v9 | extra, log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(functions), log
    assert all(tuple(map(int, f)) == (0, 0, 0) for f in frames), log
    code = _text_sections(out)
    for g in (1, 2):
        # mask 0 is v9 as first shipped (use_kernel("v9-old")), DEFAULT the library's default
        assert code[f"kvaddr_step1_abl_c{g}_m0"] == code[f"kvaddr_step1old_c{g}_i64"], g
        assert code[f"kvaddr_step1_abl_c{g}_m{DEFAULT}"] == code[f"kvaddr_step1_c{g}_i64"], g
        # every ablation or fix is different code, except "- all, params in regs" (127) against "- all"
        # (95): since session 9 KV_ABL_PARAM_REGS pins the scalars only (the pointers are copied), and with
        # every phase skipped the one-cache step keeps no scalar whose pin changes the code
        distinct = [m for m in MASKS if m != 127]
        assert len({code[f"kvaddr_step1_abl_c{g}_m{m}"] for m in distinct}) == len(distinct), g
