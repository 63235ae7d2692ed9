"""Where one warp's time goes in the small-batch step with attention outputs (kvaddr_step1m_c{G}_*).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/trace_step1m.py [--json FILE]

A measuring instrument, not a timing benchmark: kernels.cu compiled with ``KV_TRACE`` (its own
module; the library's kernels are compiled without it and are unchanged) has thread 0 of every
block store ``clock64`` at fixed points of the launch (kernels.cu's ``KV_STAMP`` slots, listed
in the v9m section comment) and ``%globaltimer`` at its start and end. For each of
benchmarks/bench_attention.py's small-batch shapes (decode 1, decode 64, the 256-request mixed
batch; B = 64, context 1k-32k), with 1 and 2 caches, the traced kernel is launched with the
planner's own parameter block and geometry, eagerly and as the last copy of a CUDA graph, and
the stamps of the last launch are read back; the table gives medians over --samples launches:

* per block kind (metadata / token block): the block's start and end (ns after the launch's
  first block started, %globaltimer: coarse) and its cycles from start to end;
* per metadata-block segment, in cycles: *issue* (start to the row loads issued; the length
  loads go out first), *lenRT* (then waiting for the lengths), *scans* (pages, the three warp
  scans, the shared stores), *bar*, *rowst* (the first row's columns stored), *outs* (the
  per-request outputs), *total* (entry bsz, the maxima), *copy* (the rest of the rows), *pad*,
  *rec* (the error record).

The stamps cost a few instructions each and move ptxas's schedule: read the segments as a
breakdown of one build, compare builds by bench_attention.py's times. docs/perf-notes.md,
"Twelfth session", has the method and the tables it gave.
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
    (5, 6, "rowst"),
    (6, 7, "outs"),
    (7, 8, "total"),
    (8, 9, "copy"),
    (9, 10, "pad"),
    (10, 11, "rec"),
]
KINDS = {1: "metadata", 2: "token"}
SHAPES = [("decode 1", 1, 1, False), ("decode 64", 64, 1, False), ("256 req, mixed (~16k)", 256, 64, True)]


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
            if int(r[15]) == 1:
                for a, b, name in SEGMENTS:
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
        for label, bsz, per, mixed in SHAPES:
            r = np.random.default_rng(1) if bsz == 1 else rng  # bench_attention.py's batches
            dec, q, table, total, pages = make_batch(r, bsz, per, 64, mixed=mixed)
            for G in (1, 2):
                planner = StepPlanner(bsz, total, [64] * G, attention=ALL, kv_indices_capacity=pages)
                name, grid, threads = planner.kernel_for(bsz)
                assert name.startswith("kvaddr_step1m_"), name
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
                    for kind in ("token", "metadata"):
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
