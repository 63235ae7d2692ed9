"""Where a block's time goes in v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/trace_step1wm.py [--json FILE]

A measuring instrument, not a timing benchmark, as benchmarks/trace_step1m.py: kernels.cu compiled
with ``KV_TRACE`` (its own module; the library's kernels are unchanged) has thread 0 of every block
store ``clock64`` at the ``KV_STAMP`` slots of kv_meta_wide (listed in the v9wm section comment) and
``%globaltimer`` at its start and end. For decode batches of 512, 1024 and 4096 requests (B = 64,
context 1k-32k, one cache: at most KV_TRACE_BLOCKS = 256 blocks are traced), the traced kernel is
launched with the planner's own parameter block and geometry, eagerly and as the last copy of a
CUDA graph; the table gives medians over --samples launches per block kind (request, pad, token
block): start and end (ns after the launch's first block started), cycles, and per segment, in
cycles: *issue* (start to the row loads issued), *lenRT* (waiting for the lengths), *scans* (the
thread sums and three warp scans), *bar*, *wscan* (the warp totals scanned), *outs* (the owned
requests' outputs), *bar2*, *rowst* (the loaded columns stored), *copy* (the rest of the row; a pad
block: *wscan* to *copy* is its pad), *rec* (the error record).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import ALL, make_batch

from kvaddr import StepPlanner, kernel_loader

SEGMENTS = [
    (1, 2, "issue"),
    (2, 3, "lenRT"),
    (3, 4, "scans"),
    (4, 5, "bar"),
    (5, 6, "wscan"),
    (6, 7, "outs"),
    (7, 8, "bar2"),
    (8, 9, "rowst"),
    (9, 10, "copy"),
    (10, 11, "rec"),
]
KINDS = {1: "request", 2: "token", 3: "pad"}
SHAPES = [("decode 512", 512), ("decode 1024", 1024), ("decode 4096", 4096)]


def traced_module():
    """kernels.cu with ``KV_TRACE`` defined (one compile per machine, cached by CuPy)."""
    return cupy.RawModule(code="#define KV_TRACE 1\n" + kernel_loader.source(), options=kernel_loader.COMPILE_OPTIONS)


def summarize(launches: list) -> dict:
    """Medians per block kind (over blocks and launches) of the start, end, cycles and segments."""
    acc: dict = {}
    for rows in launches:
        live = rows[rows[:, 15] != 0]
        if not len(live):
            continue
        t0 = int(live[:, 0].min())
        for r in live:
            d = acc.setdefault(KINDS.get(int(r[15]), "?"), {"start_ns": [], "end_ns": [], "cycles": []})
            d["start_ns"].append(int(r[0]) - t0)
            d["end_ns"].append(int(r[12]) - t0)
            d["cycles"].append(int(r[11]) - int(r[1]))
            for a, b, name in SEGMENTS:
                if int(r[15]) != 2 and r[a] and r[b]:
                    d.setdefault(name, []).append(int(r[b]) - int(r[a]))
    return {kind: {k: statistics.median(v) for k, v in d.items()} for kind, d in acc.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=15, help="launches read back per shape and mode")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    mod = traced_module()
    trace = cupy.ndarray((256, 16), dtype=cupy.uint64, memptr=mod.get_global("kv_trace"))
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; clock64 cycles of one SM", flush=True)
    header = "shape                   caches mode   kind      start ns  end ns  cycles  " + " ".join(
        f"{n:>6}" for _, _, n in SEGMENTS
    )
    print(header)
    results = []
    with stream:
        for label, bsz in SHAPES:
            dec, q, table, total, pages = make_batch(rng, bsz, 1, 64)
            for G in (1,):
                planner = StepPlanner(bsz, total, [64] * G, attention=ALL, kv_indices_capacity=pages)
                name, grid, threads = planner.kernel_for(bsz)
                assert name.startswith("kvaddr_step1wm") and grid <= 256, (name, grid)
                planner.compute(dec, q, table, stream=stream)  # the parameter block for these inputs
                launch = kernel_loader.Launcher(mod.get_function(name).kernel, planner._params, by_value=True)
                for mode in ("eager", "graph"):
                    graph = None
                    if mode == "graph":
                        stream.synchronize()
                        stream.begin_capture()
                        for _ in range(20):
                            launch(grid, threads, stream.ptr)
                        graph = stream.end_capture()
                        graph.launch(stream)
                    launches = []
                    for _ in range(a.samples):
                        trace.fill(0)
                        stream.synchronize()
                        if graph is not None:
                            graph.launch(stream)
                        else:
                            launch(grid, threads, stream.ptr)
                        stream.synchronize()
                        launches.append(trace.get())
                    summary = summarize(launches)
                    results.append(
                        dict(shape=label, caches=G, mode=mode, kernel=name, grid=grid, threads=threads, **summary)
                    )
                    for kind in ("token", "request", "pad"):
                        s = summary.get(kind)
                        if s is None:
                            continue
                        segs = " ".join(f"{s[n]:6.0f}" if n in s else f"{'-':>6}" for _, _, n in SEGMENTS)
                        print(
                            f"{label:23s} {G:6d} {mode:6s} {kind:8s} {s['start_ns']:8.0f} {s['end_ns']:7.0f} "
                            f"{s['cycles']:7.0f}  {segs}",
                            flush=True,
                        )
                planner.check(stream)  # the library's kernel left no error record behind
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
