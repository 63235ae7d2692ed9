"""Benchmark of the DSA outputs of the fused step and of the vLLM step (docs/dsa.md).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_dsa_step.py [--quick] [--json FILE]

Graph mode, as benchmarks/bench_step.py: N copies of one call captured in one CUDA graph; time
per copy is the replay time (CUDA events, median of R replays) over N.

On/off: the fused step with the DSA outputs on (each token's indexer-cache value and scale
offsets, ks, ke, ctx, and the prefills' cu_seq_lens; ``StepPlanner(dsa=True)``) against the
fused step without them, two caches (the MLA and indexer caches of DeepSeek-V3.2: one shared
table, B = 64), at 64, 1024 and 4096 decode requests, 1024 MTP decodes of 2 tokens, and a mixed
step of 192 decodes and 64 prefill chunks (~16k tokens). Both planners run the kernel the
dispatch table chooses (printed per row; the DSA one is its ``DSA = true`` instantiation).

Floor: one kernel (CUDA source below, an instrument) that only writes the DSA outputs of the
same shape: every token's two int64 offsets and three int32 values and the ``max_requests + 1``
cu_seq_lens entries, from the token index alone (no lengths, no scan, no table), timed the same
way in the same run, with 1, 2, 4 and 8 blocks of 256 threads per SM (the fastest counts).

vLLM step: the same shapes through ``VllmStepPlanner`` (two groups of B = 64, permuted request
rows in idx_mapping) with ``dsa=True`` against without (``vllm_step<false, true>``, a second grid
row of DSA blocks, against ``vllm_step<false>``), beside the same floor.

Bound per row: on <= 1.3 x off, or on <= 1.3 x the floor, whichever is larger (both ratios
printed). Exit status 1 if a row misses it. ``--quick``: fewer copies and replays.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr import StepPlanner

B = 64
BOUND = 1.3

FLOOR_SOURCE = r"""
extern "C" __global__ void dsa_floor(long long* __restrict__ value,  // [C], int64
                                     long long* __restrict__ scale,  // [C], int64
                                     int* __restrict__ ks, int* __restrict__ ke, int* __restrict__ ctx,  // [C]
                                     int* __restrict__ cu,           // [cu_len], int32
                                     int C, int cu_len) {
    const int stride = gridDim.x * blockDim.x;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < C; t += stride) {
        value[t] = (long long)t * 128;
        scale[t] = (long long)t * 4 + 8192;
        ks[t] = t;
        ke[t] = t + 1;
        ctx[t] = t + 2;
        if (t < cu_len) cu[t] = t;
    }
    for (int i = C + blockIdx.x * blockDim.x + threadIdx.x; i < cu_len; i += stride) cu[i] = i;
}
"""


@functools.cache
def floor_kernel():
    return cupy.RawModule(code=FLOOR_SOURCE).get_function("dsa_floor")


def floor_time(C, M, stream, copies, replays):
    """The floor's time in us: the fastest of 1, 2, 4, 8 blocks of 256 threads per SM."""
    fn = floor_kernel()
    value, scale = cupy.empty(C, np.int64), cupy.empty(C, np.int64)
    ks, ke, ctx = (cupy.empty(C, np.int32) for _ in range(3))
    cu = cupy.empty(M + 1, np.int32)
    args = (value, scale, ks, ke, ctx, cu, np.int32(C), np.int32(M + 1))
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    need = -(-max(C, M + 1) // 256)
    times = []
    for m in (1, 2, 4, 8):
        blocks = max(1, min(m * sms, need))
        times.append(
            bench_step.graph_time_per_copy(
                lambda blocks=blocks: fn((blocks,), (256,), args, stream=stream), stream, copies, replays
            )[0]
        )
    return min(times)


def make_step(rng, decodes, n, prefills=0, chunk=(1, 1)):
    """``decodes`` requests of n tokens, then ``prefills`` chunks of chunk[0]..chunk[1] tokens;
    contexts 1k-32k; a permuted table (one block per 64 positions)."""
    q = np.concatenate([np.full(decodes, n), rng.integers(chunk[0], chunk[1] + 1, prefills)]).astype(np.int32)
    bsz = decodes + prefills
    dec = rng.integers(1024, 32768, size=bsz).astype(np.int32)
    width = int((dec.max() + q.max()) // B + 1)
    table = rng.permutation(bsz * width).astype(np.int32).reshape(bsz, width)
    return cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table), int(q.sum())


def make_vllm_step(rng, decodes, n, prefills=0, chunk=(1, 1)):
    """The same step for the vLLM planner: ``(planner kwargs, idx_mapping, query_start_loc, state)``;
    request rows permuted, contexts 1k-32k, each row's blocks a permuted range of block ids."""
    q = np.concatenate([np.full(decodes, n), rng.integers(chunk[0], chunk[1] + 1, prefills)]).astype(np.int64)
    M = decodes + prefills
    nct = rng.integers(1024, 32768, size=M).astype(np.int32)
    width = int((int(nct.max()) + int(q.max())) // B + 1)
    table = cupy.asarray(rng.permutation(M * width).astype(np.int32).reshape(M, width))
    idx = cupy.asarray(rng.permutation(M).astype(np.int32))
    qsl = cupy.asarray(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
    nb = cupy.full(M, width, np.int32)
    kw = dict(max_num_reqs=M, max_num_batched_tokens=int(q.sum()), block_sizes=[B, B], widths=[width, width])
    return kw, idx, qsl, (cupy.asarray(nct), [table, table], [nb, nb])


def vllm_rows(rng, shapes, stream, a):
    from kvaddr.engines.vllm import VllmStepPlanner

    rows = []
    for label, decodes, n, prefills, chunk in shapes:
        kw, idx, qsl, state = make_vllm_step(rng, decodes, n, prefills, chunk)
        M, total = kw["max_num_reqs"], kw["max_num_batched_tokens"]
        off = VllmStepPlanner(**kw)
        on = VllmStepPlanner(**kw, dsa=True, dsa_decode_len=n)

        def timed(p):
            return bench_step.graph_time_per_copy(
                lambda: p.compute(idx, qsl, *state, num_reqs_padded=M, stream=stream), stream, a.copies, a.replays
            )[0]

        t_off, t_on = timed(off), timed(on)
        on.check(stream)
        t_floor = floor_time(total, M, stream, a.copies, a.replays)
        row = dict(shape="vLLM " + label, tokens=total, kernel=on.kernel_name, off_us=t_off, on_us=t_on)
        row.update(floor_us=t_floor, on_off=t_on / t_off, on_floor=t_on / t_floor)
        row["ok"] = min(row["on_off"], row["on_floor"]) <= BOUND
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="50 copies per graph, 10 replays (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.copies, a.replays = min(a.copies, 50), min(a.replays, 10)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    shapes = [
        ("decode 64", 64, 1, 0, (1, 1)),
        ("decode 1024", 1024, 1, 0, (1, 1)),
        ("decode 4096", 4096, 1, 0, (1, 1)),
        ("MTP 1024 x 2 tok", 1024, 2, 0, (1, 1)),
        ("mixed 192 dec + 64 pf (~16k)", 192, 1, 64, (2, 500)),
    ]
    with stream:
        for label, decodes, n, prefills, chunk in shapes:
            dec, q, table, total = make_step(rng, decodes, n, prefills, chunk)
            bsz = decodes + prefills
            off = StepPlanner(bsz, total, [B, B])
            on = StepPlanner(bsz, total, [B, B], dsa=True, dsa_decode_len=n)
            tables = [table, table]

            def timed(p):
                return bench_step.graph_time_per_copy(
                    lambda: p.compute(dec, q, tables, stream=stream), stream, a.copies, a.replays
                )[0]

            t_off, t_on = timed(off), timed(on)
            on.check(stream)  # every replay's error record: clean
            t_floor = floor_time(total, bsz, stream, a.copies, a.replays)
            row = dict(shape=label, tokens=total, kernel=on.kernel_for(bsz)[0], off_us=t_off, on_us=t_on)
            row.update(floor_us=t_floor, on_off=t_on / t_off, on_floor=t_on / t_floor)
            row["ok"] = min(row["on_off"], row["on_floor"]) <= BOUND
            rows.append(row)
        rows += vllm_rows(rng, shapes, stream, a)

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}; graph mode, {a.copies} copies per graph, median of {a.replays} replays")
    print(
        f"{'shape':<30}{'tokens':>8}{'off us':>9}{'on us':>9}{'floor us':>10}{'on/off':>8}{'on/floor':>10}  verdict  kernel"
    )
    for r in rows:
        verdict = "ok" if r["ok"] else "OVER BOUND"
        print(
            f"{r['shape']:<30}{r['tokens']:>8}{r['off_us']:>9.3f}{r['on_us']:>9.3f}{r['floor_us']:>10.3f}"
            f"{r['on_off']:>8.2f}{r['on_floor']:>10.2f}  {verdict:<8} {r['kernel']}"
        )
    print(f"bound: on <= {BOUND} x max(off, floor): on/off or on/floor <= {BOUND}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=dev, copies=a.copies, replays=a.replays, rows=rows), f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
