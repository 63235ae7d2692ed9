"""Compare the SASS of two builds of kvaddr's kernels, kernel by kernel.

Each side is one or more CUDA sources (.cu, compiled here with nvcc -cubin) or cubins, given as a
comma-separated list. Kernels are paired by name: a name maps through ``--map OLD=NEW`` pairs and
the built-in table from the extern "C" names the library had before its kernels became templates
(``kvaddr_step1_c1_i64`` -> ``step_small<1, long long>``, ...) to the template instantiations
(demangled with c++filt); baselines keep their names. For every pair it prints one line:
``identical``, or ``differs`` with the number of instructions that differ (a line diff of the
normalised instruction streams) and the two lengths. Normalised: the address comments, the
encodings and the names of relocation symbols (``32@lo(name)``, ``(*"name"*)``) are dropped, so
two kernels that differ only in their own names compare identical. ``--ignore-param-offsets``
also replaces every constant-bank offset ``c[0x0][0x..]`` by ``c[0x0][off]``: a kernel that then
compares identical differs only in where its parameters lie (fields removed from a struct).

  python3 benchmarks/sass_compare.py OLD NEW [--arch sm_90] [-I DIR] [-D NAME] [--ignore-param-offsets]
      [--map OLD=NEW ...] [--only-common] [--show NAME]

Examples:
  python3 benchmarks/sass_compare.py old/kernels.cu new/inst.cu,new/base.cu -I kvaddr --new-define KV_BASELINES
  python3 benchmarks/sass_compare.py old.cubin lib.cubin,base.cubin

Needs nvcc (for .cu inputs), cuobjdump (PATH, or the nvidia-cuda-cuobjdump wheel) and c++filt.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

POS = {"i64": "long long", "i32": "int"}


def legacy_names() -> dict:
    """The extern "C" names of the library kernels before they became templates -> the template
    instantiations (demangled, as c++filt prints them without the parameter list)."""
    m = {"kvaddr_step_i64": "step_multiblock<long long>", "kvaddr_step_i32": "step_multiblock<int>"}
    for suf, pos in POS.items():
        for g in range(5):
            m[f"kvaddr_step1_c{g}_{suf}"] = f"step_small<{g}, {pos}>"
            m[f"kvaddr_step1m_c{g}_{suf}"] = f"step_small_attention<{g}, {pos}>"
            m[f"kvaddr_step1wm4_c{g}_{suf}"] = f"step_wide_attention<{g}, {pos}>"
            for r in (4, 8, 16):
                m[f"kvaddr_step1w{r}_c{g}_{suf}"] = f"step_wide<{g}, {pos}, {r}>"
    m["kvaddr_vllm_step_v2"] = "vllm_step<false>"
    m["kvaddr_vllm_step_v2a"] = "vllm_step<true>"
    return m


def find_cuobjdump() -> str:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel

        for base in nvidia.__path__:
            hits = glob.glob(os.path.join(base, "**", "bin", "cuobjdump"), recursive=True)
            if hits:
                return hits[0]
    except ImportError:
        pass
    sys.exit("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def compile_cubin(src: str, arch: str, includes: list, defines: list, workdir: str) -> str:
    out = os.path.join(workdir, os.path.basename(src) + f".{len(os.listdir(workdir))}.cubin")
    cmd = ["nvcc", "-cubin", f"-arch={arch}", "-std=c++14", "-o", out, src]
    cmd += [f"-I{d}" for d in includes] + [f"-D{d}" for d in defines]
    subprocess.run(cmd, check=True)
    return out


def demangle(names: list) -> dict:
    if not names:
        return {}
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    out = {}
    for raw, pretty in zip(names, proc.stdout.splitlines()):
        # "void step_small<1, long long>(KvStepParams)" -> "step_small<1, long long>"
        pretty = re.sub(r"^void\s+", "", pretty)
        pretty = re.sub(r"\(.*\)$", "", pretty)
        out[raw] = pretty
    return out


INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")


def normalise(text: str, ignore_offsets: bool) -> str:
    text = re.sub(r"\(\*\"[^\"]*\"\*\)", '(*"sym"*)', text)
    text = re.sub(r"(\d+@(?:lo|hi))\([^)]*\)", r"\1(sym)", text)
    text = re.sub(r"`\([^)]*\)", "`(sym)", text)
    if ignore_offsets:
        text = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][off]", text)
    return text


def sass_functions(cubin: str, cuobjdump: str, ignore_offsets: bool) -> dict:
    out = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = INSTR.match(line)
        if m:
            cur.append(normalise(m.group(2), ignore_offsets))
    return funcs


def load_side(spec: str, args, defines: list, workdir: str, cuobjdump: str) -> dict:
    funcs = {}
    for item in spec.split(","):
        cubin = item if item.endswith(".cubin") else compile_cubin(item, args.arch, args.include, defines, workdir)
        funcs.update(sass_functions(cubin, cuobjdump, args.ignore_param_offsets))
    pretty = demangle([n for n in funcs if n.startswith("_Z")])
    return {pretty.get(n, n): body for n, body in funcs.items()}


def count_diff(a: list, b: list) -> int:
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-I", "--include", action="append", default=[])
    ap.add_argument("-D", "--define", action="append", default=[], help="for both sides")
    ap.add_argument("--old-define", action="append", default=[])
    ap.add_argument("--new-define", action="append", default=[])
    ap.add_argument("--map", action="append", default=[], help="OLD=NEW kernel name pairs (demangled names)")
    ap.add_argument("--ignore-param-offsets", action="store_true")
    ap.add_argument("--only-common", action="store_true", help="skip kernels present on one side only")
    ap.add_argument("--show", help="print the line diff of this (old) kernel")
    args = ap.parse_args(argv)
    cuobjdump = find_cuobjdump()
    with tempfile.TemporaryDirectory() as work:
        old = load_side(args.old, args, args.define + args.old_define, work, cuobjdump)
        new = load_side(args.new, args, args.define + args.new_define, work, cuobjdump)
    mapping = legacy_names()
    mapping.update(dict(kv.split("=", 1) for kv in args.map))
    seen, same, differ = set(), 0, 0
    for name in sorted(old):
        target = mapping.get(name, name)
        if target not in new:
            if not args.only_common:
                print(f"{name:32s} -> (no counterpart)")
            continue
        seen.add(target)
        a, b = old[name], new[target]
        if a == b:
            same += 1
            print(f"{name:32s} -> {target:36s} identical ({len(a)} instructions)")
        else:
            differ += 1
            print(f"{name:32s} -> {target:36s} differs: {count_diff(a, b)} instructions ({len(a)} -> {len(b)})")
        if args.show == name:
            sys.stdout.writelines(difflib.unified_diff([x + "\n" for x in a], [x + "\n" for x in b], name, target))
    if not args.only_common:
        for target in sorted(set(new) - seen):
            print(f"{'(none)':32s} -> {target:36s} new")
    print(f"# {same} identical, {differ} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
