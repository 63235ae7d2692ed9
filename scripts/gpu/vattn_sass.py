"""The SASS order of kvaddr_vllm_step_v2a's metadata blocks (vllm_attn_block1, meta_impl 1):
are the row loads (LDG) issued before the block's barrier (BAR.SYNC)?

Compiles kvaddr/kernels.cu with nvcc (-lineinfo, sm_90), disassembles kvaddr_vllm_step_v2a
with nvdisasm --print-line-info, keeps the instructions whose source line lies in
vllm_attn_block1's body (inlined: any "line N" of each instruction's line-info comment and
its "inlined at" chain), and prints, in program order, the global loads (LDG) and barriers (BAR) with their
kernels.cu lines, then a one-line summary:

    vattn_sass: block1 LDG before the first BAR: X (source lines ...), after: Y; BAR: Z

Expected: the pass-1 chunk loads, the own row's and the group row's loads (qsl, idx_mapping,
num_computed_tokens, num_blocks, the VLLM_META_PRE block-table columns) all before the one
BAR.SYNC; after it only the copy loop's row loads (columns past the preloaded ones).
Writes the full listing to OUT/v2a.sass (OUT: argv[1], default /tmp). Exit 0 when it ran.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path("kvaddr/kernels.cu")


def block1_range(text: str) -> tuple[int, int]:
    lines = text.splitlines()
    a = next(i for i, t in enumerate(lines) if t.startswith("__device__ __forceinline__ void vllm_attn_block1("))
    b = next(i for i in range(a + 1, len(lines)) if lines[i] == "}")
    return a + 1, b + 1  # 1-based, inclusive


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = block1_range(SRC.read_text())
    tmp = Path(tempfile.mkdtemp(prefix="vattn_sass_"))
    cubin = tmp / "k.cubin"
    subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", "-lineinfo", "-o", str(cubin), str(SRC)],
        check=True,
        capture_output=True,
    )
    if shutil.which("nvdisasm"):
        cmd = ["nvdisasm", "--print-line-info", "--function", "kvaddr_vllm_step_v2a", str(cubin)]
    else:
        cmd = ["cuobjdump", "-sass", "-fun", "kvaddr_vllm_step_v2a", str(cubin)]
    listing = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    (out / "v2a.sass").write_text(listing)
    line = None
    events = []  # (kind, source line, text)
    for t in listing.splitlines():
        if "//##" in t:
            # the location and its "inlined at" chain: the first line inside vllm_attn_block1
            inside = [int(x) for x in re.findall(r"line (\d+)", t) if lo <= int(x) <= hi]
            line = inside[0] if inside else None
            continue
        ins = re.search(r"\b(LDG\S*|BAR\S*)\b", t)
        if ins and line is not None and lo <= line <= hi:
            events.append((ins.group(1).split(".")[0], line, t.strip()))
    for kind, ln, t in events:
        print(f"  {kind:4s} kernels.cu:{ln}  {t[:110]}")
    bars = [i for i, e in enumerate(events) if e[0] == "BAR"]
    first = bars[0] if bars else len(events)
    before = [e for e in events[:first] if e[0] == "LDG"]
    after = [e for e in events[first:] if e[0] == "LDG"]
    print(
        f"vattn_sass: block1 lines {lo}-{hi}: LDG before the first BAR: {len(before)} "
        f"(source lines {sorted({e[1] for e in before})}), after: {len(after)} "
        f"(source lines {sorted({e[1] for e in after})}); BAR: {len(bars)}"
        + ("" if events else " -- no line info matched (nvdisasm missing? see v2a.sass)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
