"""Where does the fused step's time go? Times variants of kernels.cu's small-batch step
(kv_step_small) that stop after a stage or leave one out (patched copies of the source, never the shipped kernel), in
graph mode like bench_step.py. Run on a GPU: PYTHONPATH=. python benchmarks/ablate_step.py
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

from kvaddr import StepPlanner, kernel_loader

sys.path.insert(0, "benchmarks")
from bench_step import graph_time_per_copy, make_batch

KEEP = "if (threadIdx.x == 0 && blockIdx.x == 0x7fffffff) rec[0] = {};"
VARIANTS = {
    "full": [],
    "launch only (smem)": [
        (
            "    const int q0 = bsz > 0 ? q[0] : 0;\n",
            "    if (bsz >= 0) { " + KEEP.format("s.bcast[1]") + " return; }\n    const int q0 = bsz > 0 ? q[0] : 0;\n",
        )
    ],
    "lengths loaded + kept": [
        (
            "    const bool mine = kv_keep_lengths(s, L, bsz, q0);\n",
            "    const bool mine = kv_keep_lengths(s, L, bsz, q0);\n    if (bsz >= 0) { "
            + KEEP.format("mine + dt + nt")
            + " return; }\n",
        )
    ],
    "+ guess loads + barrier": [
        (
            "    if (uniform) {\n",
            "    if (bsz >= 0) { " + KEEP.format("uniform + blk[0]") + " return; }\n    if (uniform) {\n",
        )
    ],
    "full - error record": [("        kv_store_errors(err, rec, chunk);\n        return;", "        return;")],
    "scan path (no uniform test)": [("    if (uniform) {\n", "    if (uniform && bsz < 0) {\n")],
}


def main():
    src = kernel_loader.source()
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [
        ("decode 64", 64, 1, 1),
        ("decode 1024", 1024, 1, 1),
        ("decode 4096", 4096, 1, 2),
        ("256 x 64 tok", 256, 64, 1),
    ]
    rows = []
    with stream:
        empty = kernel_loader.get_function("kvaddr_empty")
        t_empty, _ = graph_time_per_copy(
            lambda: empty((1,), (1,), (), 0, kernel_loader.raw_stream(stream.ptr)), stream, 200, 20
        )
        batches = {label: make_batch(rng, bsz, per) for label, bsz, per, _ in shapes}
        for vname, patches in VARIANTS.items():
            code = src
            for anchor, repl in patches:
                assert code.count(anchor) == 1, (vname, anchor)
                code = code.replace(anchor, repl)
            fn = cupy.RawModule(code=code, options=kernel_loader.COMPILE_OPTIONS).get_function("kvaddr_step_i64").kernel
            row = [vname]
            for label, bsz, per, G in shapes:
                dec, q, table, total = batches[label]
                p = StepPlanner(bsz, total, [64] * G)
                p._prepare(dec, q, table, None)
                # The variant kernel takes the same KvStepParams struct: a copy of the planner's.
                L = kernel_loader.Launcher(fn, type(p._params).from_buffer_copy(p._params), by_value=True)
                t, _ = graph_time_per_copy(lambda: L(p.grid(bsz), 256, stream.ptr), stream, 200, 20)
                row.append(t)
            rows.append(row)
    print(f"empty kernel {t_empty:.3f} us per copy; fused-step variants, us per copy:")
    print(f"{'variant':<26}" + "".join(f"{s[0]:>16}" for s in shapes))
    for r in rows:
        print(f"{r[0]:<26}" + "".join(f"{x:>16.3f}" for x in r[1:]))


if __name__ == "__main__":
    main()
