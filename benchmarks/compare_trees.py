"""Two source trees of kvaddr timed side by side on one GPU: every production path, old against new.

Each tree runs in its own processes (``PYTHONPATH`` set to the tree), alternating round by round
(old, new, old, new, ...), so both see the same machine. Every row uses the public API only, so
any two versions with the same API compare:

* ``step``: ``StepPlanner.compute`` captured N times in one CUDA graph (GPU time per step),
  decode batches of 64, 1024 and 4096 requests and a mixed batch (256 requests, 16k tokens,
  chunked prefill), one and two caches, without and with attention outputs (flashinfer and
  varlen);
* ``vllm``: ``VllmStepPlanner.compute`` the same way (decode 64, 1024, 4096; one and two groups);
* ``torch``: ``kvaddr.torch.step`` under ``torch.cuda.graph`` (decode 64 and 1024, one cache);
* ``host``: eager host time per call of ``StepPlanner.compute`` (same arrays every call) and of
  the bound launch (``planner.bind(...).launch(bsz)``), decode 64, one cache.

Prints one row per measurement: the median over rounds of each side's median, and new / old.

Run on a GPU: ``python benchmarks/compare_trees.py --old /path/to/old/tree --new .``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PAYLOAD = r"""
import json, sys, time
import numpy as np
import cupy as cp

COPIES, REPLAYS = 100, 15
rng = np.random.default_rng(7)


def decode(bsz, C, width=512):
    dec = cp.asarray(rng.integers(1, 8000, bsz), dtype=cp.int32)
    q = cp.ones(bsz, dtype=cp.int32)
    table = cp.asarray(rng.permutation(bsz * width).reshape(bsz, width), dtype=cp.int32)
    return dec, q, table, C


def mixed():
    bsz = 256
    q = np.ones(bsz, dtype=np.int32)
    q[:8] = 2000 - 248 // 8
    dec = rng.integers(1, 8000, bsz).astype(np.int32)
    width = 1024
    table = rng.permutation(bsz * width).reshape(bsz, width).astype(np.int32)
    return cp.asarray(dec), cp.asarray(q), cp.asarray(table), int(q.sum())


def graph_time(fn):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(COPIES):
            fn()
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        times = []
        for _ in range(REPLAYS):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / COPIES)
    return float(np.median(times))


def host_time(fn, n=3000):
    for _ in range(200):
        fn()
    cp.cuda.get_current_stream().synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) * 1e6 / n)
        cp.cuda.get_current_stream().synchronize()
    return float(np.median(best))


rows = {}
from kvaddr import StepPlanner

shapes = [("decode 64", decode(64, 64)), ("decode 1024", decode(1024, 1024)), ("decode 4096", decode(4096, 4096)),
          ("mixed 256x16k", mixed())]
for label, (dec, q, table, C) in shapes:
    for G in (1, 2):
        for attn in (None, "flashinfer,varlen"):
            kw = {}
            if attn:
                kw = dict(attention=attn, kv_indices_capacity=int(dec.shape[0]) * 1024)
            p = StepPlanner(max_requests=int(dec.shape[0]), capacity=C, block_sizes=[64] * G, **kw)
            tables = [table] * G if G > 1 else table
            t = graph_time(lambda: p.compute(dec, q, tables))
            p.check()
            rows[f"step {label}, {G} cache{'s' if G > 1 else ''}{', attention' if attn else ''}"] = t

from kvaddr.engines.vllm import VllmStepPlanner

for bsz in (64, 1024, 4096):
    for G in (1, 2):
        width = 512
        pl = VllmStepPlanner(max_num_reqs=bsz, max_num_batched_tokens=bsz, block_sizes=[16] * G, widths=[width] * G)
        idx = cp.asarray(rng.permutation(bsz), dtype=cp.int32)
        qsl = cp.arange(bsz + 1, dtype=cp.int32)
        nct = cp.asarray(rng.integers(1, 16 * width - 1, bsz), dtype=cp.int32)
        tables = [cp.asarray(rng.integers(0, 1 << 20, (bsz, width)), dtype=cp.int32) for _ in range(G)]
        nb = [cp.full(bsz, width, dtype=cp.int32) for _ in range(G)]
        t = graph_time(lambda: pl.compute(idx, qsl, nct, tables, nb, num_reqs_padded=bsz))
        pl.check()
        rows[f"vllm decode {bsz}, {G} group{'s' if G > 1 else ''}"] = t

try:
    import torch
    import kvaddr.torch
    from kvaddr.torch import StepBuffers
except Exception:
    torch = None
if torch is not None:
    for bsz in (64, 1024):
        bufs = StepBuffers(bsz, bsz, [64], device="cuda")
        d = torch.as_tensor(rng.integers(1, 8000, bsz), dtype=torch.int32, device="cuda")
        qq = torch.ones(bsz, dtype=torch.int32, device="cuda")
        tt = torch.as_tensor(rng.permutation(bsz * 512).reshape(bsz, 512), dtype=torch.int32, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            kvaddr.torch.step(d, qq, tt, bufs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(COPIES):
                    kvaddr.torch.step(d, qq, tt, bufs)
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(REPLAYS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                g.replay()
                b.record(s)
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000 / COPIES)
        bufs.check()
        rows[f"torch step decode {bsz}, 1 cache"] = float(np.median(times))

dec, q, table, C = decode(64, 64)
p = StepPlanner(max_requests=64, capacity=64, block_sizes=[64])
rows["host compute decode 64 (us)"] = host_time(lambda: p.compute(dec, q, table))
b = p.bind(dec, q, table)
rows["host bound launch decode 64 (us)"] = host_time(lambda: b.launch(64))
p.check()
print("ROWS " + json.dumps(rows))
"""


def run_side(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", PAYLOAD], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(
            f"{tree}: the timing run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the old tree (its kvaddr package is imported from it)")
    ap.add_argument("--new", default=".", help="the new tree (default: the current folder)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per side (default 2)")
    ap.add_argument("--json", help="also write every round's rows to this file")
    args = ap.parse_args()
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in ("old", "new"):
            runs[side].append(run_side(getattr(args, side)))
            print(f"round {r + 1}: {side} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["new"][0] if k in runs["old"][0]]
    print(f"{'measurement (GPU us per step unless named)':<52} {'old':>8} {'new':>8} {'new/old':>8}  spread old / new")
    for k in keys:
        o = [run[k] for run in runs["old"]]
        n = [run[k] for run in runs["new"]]
        mo, mn = statistics.median(o), statistics.median(n)
        spread = f"{max(o) / min(o):.3f} / {max(n) / min(n):.3f}"
        print(f"{k:<52} {mo:8.3f} {mn:8.3f} {mn / mo:8.3f}  {spread}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
