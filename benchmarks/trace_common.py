"""What benchmarks/trace_step1m.py and benchmarks/trace_step1wm.py share: kernels.cu compiled with
``KV_TRACE``, the traced kernel launched with the planner's own parameter block and geometry
(eagerly and as the last copy of a CUDA graph), the stamps of the last launch read back, and
medians per block kind and segment. A measuring instrument; see either script's docstring.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterable

import cupy
import numpy as np
from bench_attention import ALL  # (benchmarks/ is on sys.path: the scripts put it there)

from kvaddr import StepPlanner, kernel_loader

#: rows of kernels.cu's kv_trace buffer (KV_TRACE_BLOCKS): at most this many blocks are traced
TRACE_BLOCKS = 256


def traced_module():
    """kernels.cu with ``KV_TRACE`` defined (one compile per machine, cached by CuPy)."""
    return cupy.RawModule(code="#define KV_TRACE 1\n" + kernel_loader.source(), options=kernel_loader.COMPILE_OPTIONS)


def summarize(launches: list, segments, kinds: dict, segment_kinds) -> dict:
    """Medians per block kind (over blocks and launches) of the start, end, cycles and, for the
    kinds in ``segment_kinds``, the segments whose two stamps were both written."""
    acc: dict = {}
    for rows in launches:
        live = rows[rows[:, 15] != 0]
        if not len(live):
            continue
        t0 = int(live[:, 0].min())
        for r in live:
            d = acc.setdefault(kinds.get(int(r[15]), "?"), {"start_ns": [], "end_ns": [], "cycles": []})
            d["start_ns"].append(int(r[0]) - t0)
            d["end_ns"].append(int(r[12]) - t0)
            d["cycles"].append(int(r[11]) - int(r[1]))
            if int(r[15]) in segment_kinds:
                for a, b, name in segments:
                    if r[a] and r[b]:
                        d.setdefault(name, []).append(int(r[b]) - int(r[a]))
    return {kind: {k: statistics.median(v) for k, v in d.items()} for kind, d in acc.items()}


def main(
    argv,
    *,
    description: str,
    segments,
    kinds: dict,
    segment_kinds,
    batches: Callable[[np.random.Generator], Iterable],
    kernel_prefix: str,
) -> int:
    """Trace every ``(label, caches, dec, q, table, total, pages)`` of ``batches(rng)``: the
    planner's kernel for it (its name starts with ``kernel_prefix``), eager and graph, and print
    a row per block kind (in ``kinds``' order) with the medians of ``summarize``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--samples", type=int, default=15, help="launches read back per shape and mode")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    mod = traced_module()
    trace = cupy.ndarray((TRACE_BLOCKS, 16), dtype=cupy.uint64, memptr=mod.get_global("kv_trace"))
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {device}; clock64 cycles of one SM", flush=True)
    print(
        "shape                   caches mode   kind      start ns  end ns  cycles  "
        + " ".join(f"{n:>6}" for _, _, n in segments)
    )
    results = []
    with stream:
        for label, G, dec, q, table, total, pages in batches(rng):
            bsz = int(dec.shape[0])
            planner = StepPlanner(bsz, total, [64] * G, attention=ALL, kv_indices_capacity=pages)
            name, grid, threads = planner.kernel_for(bsz)
            assert name.startswith(kernel_prefix) and grid <= TRACE_BLOCKS, (name, grid)
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
                summary = summarize(launches, segments, kinds, segment_kinds)
                results.append(
                    dict(shape=label, caches=G, mode=mode, kernel=name, grid=grid, threads=threads, **summary)
                )
                for kind in kinds.values():
                    s = summary.get(kind)
                    if s is None:
                        continue
                    segs = " ".join(f"{s[n]:6.0f}" if n in s else f"{'-':>6}" for _, _, n in segments)
                    print(
                        f"{label:23s} {G:6d} {mode:6s} {kind:8s} {s['start_ns']:8.0f} {s['end_ns']:7.0f} "
                        f"{s['cycles']:7.0f}  {segs}",
                        flush=True,
                    )
            planner.check(stream)  # the library's kernel left no error record behind
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=device, rows=results), f, indent=1)
    return 0
