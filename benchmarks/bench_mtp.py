"""Benchmark of every MTP substep's addressing in one launch (``StepPlanner.compute_draft_steps``).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_mtp.py [--json FILE]

k = 3 substeps, two caches (B = 64, one shared table, as DeepSeek-V3.2's MLA and indexer caches).
Graph mode (N copies of one call in one CUDA graph; median replay time over N), per batch
(decode 64, 1024 and 4096 requests, and 1024 requests of mixed lengths), each request having
accepted 0..k tokens:

* ``mtp``: the one launch of all k substeps;
* ``fused``: one core fused step (``compute``) on the same batch (substep 0's lengths);
* ``floor``: a kernel defined here that writes exactly the same output elements (every substep's
  per-token and per-request arrays) with values it reads from nowhere: strictly less work.

Printed: mtp/fused (bound 1.5x) and mtp/floor (bound 1.3x); a row passes when either holds.
FastDeploy's per-substep design at 64 requests (kvaddr/strategies/fastdeploy_mtp.py: per
substep a one-block length kernel, the one-block step, a host synchronisation) is first checked
equal to the one launch, then timed eagerly per verify-plus-drafts cycle (CUDA events around
the cycle, its synchronisations included; and its 2k launches alone under a graph), against the
one launch timed eagerly the same way (bound: 3x less). Eager host time of the bound launch
(``bind_draft_steps(...).launch()``) against an empty CuPy RawKernel launch (bound 1.0x).
Exit status 1 if a bound is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr import StepPlanner
from kvaddr.strategies.fastdeploy_mtp import FastDeployMtp

B = 64
K = 3

FLOOR_SRC = r"""
extern "C" __global__ void mtp_floor(int* cu, int* num_tokens, int* batch, long long* pos, int* kv,
                                     long long* slots, int bsz, int capacity, int caches, int max_requests,
                                     int k) {
    // Every element the MTP launch writes, once, with a value computed from its index only.
    const long long n_tok = (long long)capacity, n_req = (long long)bsz + 1;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < k * n_tok; i += stride) {
        const long long j = i / n_tok, t = i - j * n_tok;
        batch[i] = (int)t;
        pos[i] = t;
        for (int g = 0; g < caches; ++g) slots[(j * caches + g) * n_tok + t] = t;
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < k * n_req; i += stride) {
        const long long j = i / n_req, r = i - j * n_req;
        cu[j * (max_requests + 1) + r] = (int)r;
        if (r < bsz) kv[j * max_requests + r] = (int)r;
        if (r == 0) num_tokens[j] = (int)j;
    }
}
"""


def make_batch(rng, bsz, mixed=False):
    """Draft lengths and acceptance 0..K (mixed: 1/8 of the rows are prefill chunks of 0)."""
    acc = rng.integers(0, K + 1, size=bsz).astype(np.int32)
    if mixed:
        acc[rng.random(bsz) < 0.125] = 0
    dec = rng.integers(1024, 32768, size=bsz).astype(np.int32)
    width = int((dec.max() + 2 * K + 2) // B + 1)
    table = rng.permutation(bsz * width).astype(np.int32).reshape(bsz, width)
    return dec, acc, table


def graph_time_per_copy(launch, stream, copies, replays):
    """Median GPU time per copy of ``launch`` over graph replays (bench_step's, without the samples)."""
    return bench_step.graph_time_per_copy(launch, stream, copies, replays)[0]


def eager_cycle_time(fn, stream, n):
    """Median of CUDA-event time around one call (its own synchronisations included)."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(20):
        fn()
    stream.synchronize()
    samples = []
    for _ in range(n):
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0)
    return statistics.median(samples)


def host_per_call(fn, stream, n=3000):
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    floor = cupy.RawKernel(FLOOR_SRC, "mtp_floor")
    rows, ok = [], True
    with stream:
        for label, bsz, mixed in (
            ("decode 64", 64, False),
            ("decode 1024", 1024, False),
            ("decode 4096", 4096, False),
            ("mixed 1024", 1024, True),
        ):
            h_dec, h_acc, h_table = make_batch(rng, bsz, mixed)
            dec, acc, table = (cupy.asarray(x) for x in (h_dec, h_acc, h_table))
            C = max(int(h_acc.sum()), 1)
            p = StepPlanner(bsz, C, [B, B], draft_steps=K)
            d = p._draft
            t_mtp = graph_time_per_copy(
                lambda p=p: p.compute_draft_steps(dec, acc, table, stream=stream), stream, a.copies, a.replays
            )
            t_fused = graph_time_per_copy(
                lambda p=p: p.compute(dec, acc, table, stream=stream), stream, a.copies, a.replays
            )
            fargs = (
                d.cu_seqlens_q,
                d.num_tokens,
                d.batch_id_per_token,
                d.position_ids,
                d.seq_lens_kv,
                d.slot_mapping,
                np.int32(bsz),
                np.int32(C),
                np.int32(2),
                np.int32(bsz),
                np.int32(K),
            )
            fgrid = max(1, min(1024, -(-K * max(C, bsz + 1) // 256)))
            t_floor = graph_time_per_copy(lambda: floor((fgrid,), (256,), fargs), stream, a.copies, a.replays)
            r_fused, r_floor = t_mtp / t_fused, t_mtp / t_floor
            good = r_fused <= 1.5 or r_floor <= 1.3
            ok &= good
            rows.append(
                dict(
                    shape=label,
                    tokens=C,
                    mtp_us=t_mtp,
                    fused_us=t_fused,
                    floor_us=t_floor,
                    mtp_over_fused=r_fused,
                    mtp_over_floor=r_floor,
                    ok=good,
                )
            )
            p.check(stream)

        # FastDeploy's per-substep design at 64 requests, checked equal first.
        h_dec, h_acc, h_table = make_batch(rng, 64)
        dec, acc, table = (cupy.asarray(x) for x in (h_dec, h_acc, h_table))
        C = max(int(h_acc.sum()), 1)
        p = StepPlanner(64, C, [B, B], draft_steps=K)
        fd = FastDeployMtp(64, C, [B, B], K)
        want = p.compute_draft_steps(dec, acc, table, stream=stream)
        want = {f: getattr(want, f).get() for f in want.as_dict()}
        got = fd.run(dec, acc, table, stream=stream)
        for f, w in want.items():
            g = getattr(got, f).get()
            if not np.array_equal(g, w):
                print(f"FastDeploy per-substep design differs from the one launch in {f}")
                return 1
        t_one = eager_cycle_time(lambda: p.compute_draft_steps(dec, acc, table, stream=stream), stream, 200)
        t_fd = eager_cycle_time(lambda: fd.run(dec, acc, table, stream=stream), stream, 200)

        def fd_launches():
            for j in range(K):
                fd._len_launch[j](1, 64, stream.ptr)
                fd._step_launch[j](1, 64, stream.ptr)

        t_fd_graph = graph_time_per_copy(fd_launches, stream, a.copies // 4, a.replays)
        t_one_graph = graph_time_per_copy(
            lambda: p.compute_draft_steps(dec, acc, table, stream=stream), stream, a.copies, a.replays
        )
        r_fd = t_fd / t_one
        ok &= r_fd >= 3.0

        # Eager host time: the bound launch against an empty CuPy launch.
        bound = p.bind_draft_steps(dec, acc, table, stream=stream)
        empty = cupy.RawKernel('extern "C" __global__ void empty() {}', "empty")
        t_empty = host_per_call(lambda: empty((1,), (1,), ()), stream)
        t_bound = host_per_call(bound.launch, stream)
        t_compute = host_per_call(lambda: p.compute_draft_steps(dec, acc, table, stream=stream), stream)
        r_host = t_bound / t_empty
        ok &= r_host <= 1.0

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}; k = {K}, 2 caches (B = {B}); graph mode, {a.copies} copies, median of {a.replays}")
    print(f"{'batch':<14}{'tokens':>8}{'mtp us':>9}{'fused us':>10}{'floor us':>10}{'mtp/fused':>11}{'mtp/floor':>11}")
    for r in rows:
        print(
            f"{r['shape']:<14}{r['tokens']:>8}{r['mtp_us']:>9.3f}{r['fused_us']:>10.3f}{r['floor_us']:>10.3f}"
            f"{r['mtp_over_fused']:>11.2f}{r['mtp_over_floor']:>11.2f}  {'ok' if r['ok'] else 'OVER BOUND'}"
        )
    print(
        f"FastDeploy per-substep design, 64 requests (checked equal): {t_fd:.2f} us per cycle eager with its "
        f"{K} host syncs ({t_fd_graph:.2f} us for its {2 * K} launches alone in a graph); one launch "
        f"{t_one:.2f} us eager ({t_one_graph:.3f} us in a graph): {r_fd:.1f}x less"
    )
    print(
        f"eager host time per call: empty CuPy launch {t_empty:.2f} us, bound launch {t_bound:.2f} us "
        f"(x{r_host:.2f}), compute_draft_steps {t_compute:.2f} us"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                dict(
                    device=dev,
                    graph=rows,
                    fastdeploy=dict(cycle_us=t_fd, launches_graph_us=t_fd_graph, one_us=t_one, ratio=r_fd),
                    host=dict(empty_us=t_empty, bound_us=t_bound, compute_us=t_compute),
                ),
                fh,
                indent=1,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
