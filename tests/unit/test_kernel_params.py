"""The kernels' arguments by name: kernels.cu's KvStepParams and its ctypes mirror
(kernel_loader.StepParams) agree on field names, order, sizes, offsets and sizeof
(nvcc compiles a host program that #includes kernels.cu; host code needs no GPU); the
baseline kernels' argument structures match their C signatures; the error bits are
named #defines equal to kvaddr/errors.py's ERR_*. The source is kernels.cu with its family
headers expanded."""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvaddr import errors, kernel_loader
from kvaddr.kernel_names import BASELINE_KERNELS, LIBRARY_KERNELS
from tests.support.kernel_source import KERNELS_CU, expand

NVCC = shutil.which("nvcc")
ROOT = Path(__file__).resolve().parents[2]


def _struct_body(name: str) -> str:
    m = re.search(rf"^struct {name} \{{\n(.*?)^\}};", expand(), flags=re.M | re.S)
    assert m, f"struct {name} not found in kernels.cu"
    return m.group(1)


def _c_fields(name: str) -> list[tuple[str, str, int | None]]:
    """(C type, field name, array length or None) of each member, in order."""
    out = []
    for line in _struct_body(name).splitlines():
        code = line.split("//", 1)[0].strip()
        if not code:
            continue
        m = re.fullmatch(r"(.+?)\s*\b(\w+)(?:\[(\w+)\])?;", code)
        assert m, f"unparsed member line of {name}: {line!r}"
        ctype, field, length = m.groups()
        if length is not None:
            length = kernel_loader.constants()[length] if not length.isdigit() else int(length)
        out.append((ctype.strip(), field, length))
    return out


def _ctypes_kind(ctype) -> tuple[str, int | None]:
    if issubclass(ctype, ctypes.Array):
        return _ctypes_kind(ctype._type_)[0], ctype._length_
    return {ctypes.c_uint64: "u64", ctypes.c_int64: "i64", ctypes.c_int32: "i32"}[ctype], None


def _c_kind(ctype: str) -> str:
    if ctype.endswith("*"):
        return "u64"  # a device pointer: passed as a 64-bit address
    return {"i64": "i64", "long long": "i64", "int": "i32"}[ctype]


def test_step_params_fields_match_the_c_struct_by_name_order_and_type():
    c_fields = _c_fields("KvStepParams")
    py_fields = kernel_loader.StepParams._fields_
    assert [f for _, f, _ in c_fields] == [name for name, _ in py_fields]
    for (ctype, field, length), (_, pytype) in zip(c_fields, py_fields):
        assert (_c_kind(ctype), length) == _ctypes_kind(pytype), field
    # Every field commented with its shape / dtype in the C struct.
    for line in _struct_body("KvStepParams").splitlines():
        if line.split("//", 1)[0].strip():
            assert "//" in line and re.search(r"int32|int64|uint32|uint64", line), line


def test_step_params_has_no_padding_and_max_caches_matches():
    assert kernel_loader.constants()["KV_MAX_CACHES"] == kernel_loader.MAX_CACHES
    S = kernel_loader.StepParams
    end = 0
    for name, ctype in S._fields_:
        assert getattr(S, name).offset == end, name  # no padding before any field
        end += ctypes.sizeof(ctype)
    assert ctypes.sizeof(S) == end == 336 and ctypes.alignment(S) == 8


STRUCTS = [
    ("KvStepParams", kernel_loader.StepParams),
    ("KvOneBlockParams", kernel_loader.OneBlockParams),
    ("KvMtpParams", kernel_loader.MtpParams),
]


def test_one_block_params_fields_match_the_c_struct_and_have_no_padding():
    c_fields = _c_fields("KvOneBlockParams")
    S = kernel_loader.OneBlockParams
    assert [f for _, f, _ in c_fields] == [name for name, _ in S._fields_]
    for (ctype, field, length), (_, pytype) in zip(c_fields, S._fields_):
        assert (_c_kind(ctype), length) == _ctypes_kind(pytype), field
    for line in _struct_body("KvOneBlockParams").splitlines():
        if line.split("//", 1)[0].strip():
            assert "//" in line and re.search(r"int32|int64|uint32|uint64", line), line
    end = 0
    for name, ctype in S._fields_:
        assert getattr(S, name).offset == end, name
        end += ctypes.sizeof(ctype)
    assert ctypes.sizeof(S) == end == 184 and ctypes.alignment(S) == 8
    assert kernel_loader.constants()["KV_ONE_BLOCK_MAX_REQUESTS"] == 1024


def test_one_block_kernels_take_one_struct_by_value():
    for name in ("kvaddr_one_block_i64", "kvaddr_one_block_i32"):
        assert _kernel_params(name) == ["const KvOneBlockParams params"]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: C struct layout check skipped")
def test_params_layout_matches_nvcc(tmp_path):
    """sizeof, alignof and every field's offset and size of each by-value parameter struct
    (KvStepParams, KvOneBlockParams), as nvcc's host compiler lays them out, equal ctypes'
    (the same compiler family lays out the device side). One host program for all."""
    lines = ["#include <cstddef>", "#include <cstdio>", "#define KV_BASELINES"]  # KvOneBlockParams is a baseline's
    lines += [f'#include "{kernel_loader.SOURCE_PATH}"', "int main() {"]
    for cname, S in STRUCTS:
        lines.append(f'    std::printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        lines.append(f'    std::printf("{cname} alignof %zu\\n", alignof({cname}));')
        for name, _ in S._fields_:
            lines.append(
                f'    std::printf("{cname} {name} %zu %zu\\n", offsetof({cname}, {name}), '
                f"sizeof((({cname}*)nullptr)->{name}));"
            )
    lines += ["    return 0;", "}"]
    src = tmp_path / "layout.cu"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    proc = subprocess.run(
        [NVCC, "-std=c++14", "-arch=sm_90", "-o", str(exe), str(src)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got: dict = {}
    for line in run.stdout.splitlines():
        cname, key, *vals = line.split()
        got.setdefault(cname, {})[key] = tuple(int(v) for v in vals)
    assert set(got) == {c for c, _ in STRUCTS}
    for cname, S in STRUCTS:
        g = got[cname]
        assert g.pop("sizeof") == (ctypes.sizeof(S),), cname
        assert g.pop("alignof") == (ctypes.alignment(S),), cname
        want = {name: (getattr(S, name).offset, ctypes.sizeof(ctype)) for name, ctype in S._fields_}
        assert g == want, cname


def _kernel_params(name: str) -> list[str]:
    m = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", expand())
    assert m, name
    return [p.strip() for p in m.group(1).split(",")]


@pytest.mark.parametrize(
    "kernel, args",
    [
        ("kvaddr_slots_i64", kernel_loader.SlotsArgs),
        ("kvaddr_slots_i32", kernel_loader.SlotsArgs),
        ("kvaddr_where_pad", kernel_loader.WhereArgs),
        ("kvaddr_mtp_substep_lengths", kernel_loader.MtpLengthsArgs),
    ],
)
def test_baseline_argument_structs_match_the_kernel_signatures(kernel, args):
    params = _kernel_params(kernel)
    assert len(params) == len(args._fields_)
    for param, (name, pytype) in zip(params, args._fields_):
        ctype = re.sub(r"\s*(__restrict__\s*)?\w+$", "", param).replace("const ", "").strip()
        assert (_c_kind(ctype), None) == _ctypes_kind(pytype), (kernel, param, name)


def test_step_kernels_take_one_struct_by_value():
    for name in sorted({e.split("<")[0] for e in LIBRARY_KERNELS}):
        structs = {
            "vllm_draft_": "const VllmDraftParams p",
            "vllm_": "const VllmStepParams p",
            "dsa_": "const KvDsaTopkParams p",
            "mtp_": "const KvMtpParams params",
        }
        want = next((s for prefix, s in structs.items() if name.startswith(prefix)), "const KvStepParams params")
        assert _kernel_params(name) == [want], name


def test_dsa_params_fields_match_the_c_struct_by_name_order_and_type():
    from kvaddr.dsa import DsaTopkParams

    c_fields = _c_fields("KvDsaTopkParams")
    assert [f for _, f, _ in c_fields] == [name for name, _ in DsaTopkParams._fields_]
    for (ctype, field, length), (_, pytype) in zip(c_fields, DsaTopkParams._fields_):
        assert (_c_kind(ctype), length) == _ctypes_kind(pytype), field
    for line in _struct_body("KvDsaTopkParams").splitlines():
        if line.split("//", 1)[0].strip():
            assert "//" in line and re.search(r"int32|int64|uint64", line), line
    assert _kernel_params("kvaddr_dsa_topk_baseline") == ["const KvDsaTopkParams p"]


def test_positional_args_convert_in_field_order():
    a = kernel_loader.SlotsArgs(
        position_ids=1, batch_id_per_token=2, block_table=3, row_stride=-4, max_blocks=5, block_size=6, capacity=7
    )
    a.slot_mapping = 8
    conv = kernel_loader.function_args(a)
    assert [type(x) for x in conv] == [
        np.uint64,
        np.uint64,
        np.uint64,
        np.int64,
        np.int32,
        np.int32,
        np.int32,
        np.uint64,
    ]
    assert [int(x) for x in conv] == [1, 2, 3, -4, 5, 6, 7, 8]


def test_launcher_points_at_each_field_or_the_struct():
    class Fn:
        ptr = 0

    a = kernel_loader.WhereArgs()
    L = kernel_loader.Launcher(Fn(), a)
    base = ctypes.addressof(a)
    assert list(L._params) == [base + getattr(kernel_loader.WhereArgs, n).offset for n, _ in a._fields_]
    P = kernel_loader.StepParams()
    L = kernel_loader.Launcher(Fn(), P, by_value=True)
    assert list(L._params) == [ctypes.addressof(P)]


def test_error_bits_are_named_defines_equal_to_errors_py():
    c = kernel_loader.constants()
    assert c["KV_ERR_BLOCK_INDEX"] == errors.ERR_BLOCK_INDEX == 1
    assert c["KV_ERR_NEGATIVE_BLOCK"] == errors.ERR_NEGATIVE_BLOCK == 2
    assert c["KV_ERR_CAPACITY"] == errors.ERR_CAPACITY == 4
    assert c["KV_ERR_NEGATIVE_LENGTH"] == errors.ERR_NEGATIVE_LENGTH == 8
    assert c["KV_ERR_KV_INDICES_CAPACITY"] == errors.ERR_KV_INDICES_CAPACITY == 16
    assert {v for k, v in c.items() if k.startswith("KV_ERR_")} == set(errors.ERROR_REASONS)
    # the kernel's key is errors.error_key's layout
    assert "(token << 32) | (request << 5) | (cache << 3) | bit_index" in expand()
    src = expand()
    # Errors are recorded by name only: no literal bits passed to err.add / err.flag.
    assert not re.search(r"err\.(add|flag)\(\s*\d", src)
    flagged = set(re.findall(r"err\.flag\((KV_ERR_\w+)", src))
    assert flagged == {
        "KV_ERR_BLOCK_INDEX",
        "KV_ERR_NEGATIVE_BLOCK",
        "KV_ERR_CAPACITY",
        "KV_ERR_NEGATIVE_LENGTH",
        "KV_ERR_KV_INDICES_CAPACITY",
    }


def test_kernels_live_in_their_family_headers():
    """The library kernels are templates in step.cuh, vllm.cuh, spec.cuh, dsa.cuh and mtp.cuh; every extern "C" kernel is a
    baseline, in baselines.cuh (compiled only with KV_BASELINES)."""
    headers = {h.name: h.read_text() for h in (KERNELS_CU.parent / "kernels").glob("*.cuh")}

    def home(pattern):
        return sorted(name for name, text in headers.items() if re.search(pattern, text, flags=re.M))

    for template in sorted({e.split("<")[0] for e in LIBRARY_KERNELS}):
        homes = {"vllm_draft_": "spec.cuh", "vllm_": "vllm.cuh", "dsa_": "dsa.cuh", "mtp_": "mtp.cuh"}
        want = [next((h for prefix, h in homes.items() if template.startswith(prefix)), "step.cuh")]
        assert home(rf"^__global__ void __launch_bounds__\(.*\) {template}\(") == want, template
    for name in BASELINE_KERNELS:
        assert home(rf'^extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+{name}\(') == ["baselines.cuh"]
    assert home(r'^extern "C"') == ["baselines.cuh"]
    assert len(re.findall(r'^extern "C" __global__', headers["baselines.cuh"], flags=re.M)) == len(BASELINE_KERNELS)
