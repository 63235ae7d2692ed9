"""Benchmark of the fused step against one per-layer slot call and an empty kernel.

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_step.py [--json FILE]

Graph mode: N copies of one call captured in one CUDA graph; time per copy is the
graph's replay time (CUDA events, median of R replays) over N. Shapes: decode
batches of 64, 1024 and 4096 requests (one token each), 256 requests carrying 16k
tokens (64 each: a uniform batch; and mixed lengths of the same mean), and 1024
requests with one speculative token each, with one and with two caches (B = 64, one
shared table). The fused step is ``StepPlanner.compute``: the kernel the dispatch table
(kvaddr/dispatch.py) chooses for the batch, printed per row. Bound per row:
fused <= 1.25x the slot call and <= 3x the empty kernel (exit status 1 if missed).
Eager: host time per call of StepPlanner.compute against a bare launch of the same
kernel (``kernel_loader.get_function`` of the planner's choice) with its prebuilt
argument (the KvStepParams struct, handed to CuPy as a CPointer: no conversion per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import cupy
import numpy as np

from kvaddr import StepPlanner, kernel_loader
from kvaddr.strategies.gpu import PerLayerKernel

B = 64


def make_batch(rng, bsz, tokens_per_request, width=None, mixed=False):
    """Every request runs tokens_per_request tokens (a uniform batch), or, with mixed,
    a length drawn from 1..2*tokens_per_request-1 (same mean: the scan path)."""
    if mixed:
        q = rng.integers(1, 2 * tokens_per_request, size=bsz).astype(np.int32)
    else:
        q = np.full(bsz, tokens_per_request, dtype=np.int32)
    dec = rng.integers(1024, 32768, size=bsz).astype(np.int32)
    width = width or int((dec.max() + q.max()) // B + 1)
    pool = rng.permutation(bsz * width).astype(np.int32)
    table = pool.reshape(bsz, width)
    return cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table), int(q.sum())


def graph_time_per_copy(launch, stream, copies, replays):
    launch()  # warm up outside capture
    stream.synchronize()
    stream.begin_capture()
    for _ in range(copies):
        launch()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(replays):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0 / copies)
    return statistics.median(samples), samples


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    empty = kernel_loader.get_function("kvaddr_empty")
    s_obj = kernel_loader.raw_stream(stream.ptr)
    results = []
    with stream:
        t_empty, _ = graph_time_per_copy(lambda: empty((1,), (1,), (), 0, s_obj), stream, a.copies, a.replays)
        shapes = [
            ("decode 64", 64, 1, False),
            ("decode 1024", 1024, 1, False),
            ("decode 4096", 4096, 1, False),
            ("256 req x 64 tok (16k)", 256, 64, False),
            ("256 req, mixed (~16k)", 256, 64, True),
            ("MTP 1024 x 2 tok", 1024, 2, False),
        ]
        for label, bsz, per, mixed in shapes:
            dec, q, table, total = make_batch(rng, bsz, per, mixed=mixed)
            for G in (1, 2):
                fused = StepPlanner(bsz, total, [B] * G)
                slot = PerLayerKernel(max_requests=bsz, capacity=total, block_sizes=[B] * G, num_layers=1)
                slot.step(dec, q, table, stream=stream)  # positions for the slot kernel
                launcher = slot._launchers[0]  # cache 0's slot kernel, its table set by step()
                grid = (total + 255) // 256
                t_slot, _ = graph_time_per_copy(lambda: launcher(grid, 256, stream.ptr), stream, a.copies, a.replays)
                t_fused, _ = graph_time_per_copy(
                    lambda: fused.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
                )
                results.append(
                    dict(
                        shape=label,
                        caches=G,
                        kernel=fused.kernel_for(bsz)[0],
                        empty_us=t_empty,
                        slot_call_us=t_slot,
                        fused_us=t_fused,
                        fused_over_slot=t_fused / t_slot,
                        fused_over_empty=t_fused / t_empty,
                    )
                )

        # Eager host overhead: planner.compute vs a bare RawKernel launch of the same kernel
        # (its one argument, the planner's KvStepParams struct, prebuilt by launch_args).
        dec, q, table, total = make_batch(rng, 64, 1)
        planner = StepPlanner(64, total, [B, B])
        _, args = planner.launch_args(dec, q, table)
        kernel, blocks, threads = planner.kernel_for(64)
        raw = kernel_loader.get_function(kernel)  # the library kernel compute() launches (a cupy.cuda.Function)

        def host_per_call(fn, n=3000):
            for _ in range(200):
                fn()
            stream.synchronize()
            best = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                t1 = time.perf_counter()
                stream.synchronize()
                best.append((t1 - t0) / n * 1e6)
            return min(best)

        t_bare = host_per_call(lambda: raw((blocks,), (threads,), args))
        t_wrap = host_per_call(lambda: planner.compute(dec, q, table, stream=stream))
        t_wrap_torch = None
        try:
            import torch

            td, tq, tt = (torch.from_dlpack(x) for x in (dec, q, table))
            t_wrap_torch = host_per_call(lambda: planner.compute(td, tq, tt, stream=stream))
        except ImportError:
            pass

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}; graph mode, {a.copies} copies per graph, median of {a.replays} replays")
    print(
        f"{'shape':<24}{'caches':>7}{'empty us':>10}{'slot us':>10}{'fused us':>10}{'fused/slot':>12}"
        f"{'fused/empty':>13}  bound  kernel"
    )
    ok = True
    for r in results:
        good = r["fused_over_slot"] <= 1.25 and r["fused_over_empty"] <= 3.0
        ok &= good
        print(
            f"{r['shape']:<24}{r['caches']:>7}{r['empty_us']:>10.3f}{r['slot_call_us']:>10.3f}"
            f"{r['fused_us']:>10.3f}{r['fused_over_slot']:>12.2f}{r['fused_over_empty']:>13.2f}  "
            f"{'ok' if good else 'OVER BOUND'}  {r['kernel']}"
        )
    ratio = t_wrap / t_bare
    print(
        f"eager host time per call: bare launch of {kernel} {t_bare:.2f} us, StepPlanner.compute {t_wrap:.2f} us "
        f"(cupy inputs, x{ratio:.2f})" + (f", {t_wrap_torch:.2f} us with torch inputs" if t_wrap_torch else "")
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                dict(
                    device=dev,
                    graph=results,
                    eager=dict(bare_us=t_bare, compute_us=t_wrap, compute_torch_us=t_wrap_torch),
                ),
                fh,
                indent=1,
            )
    return 0 if ok and ratio <= 1.30 else 1


if __name__ == "__main__":
    sys.exit(main())
