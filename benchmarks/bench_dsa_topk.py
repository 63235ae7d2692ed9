"""Benchmark of the top-k -> slot conversion (kvaddr.dsa.topk_to_slots) at K = 2048.

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_dsa_topk.py [--json out.json]

Graph mode (as benchmarks/bench_step.py): N copies of one call captured in one CUDA graph;
time per copy = replay time (CUDA events, median of R replays) / N, for
  * plain     KvaddrTopkSlots.compute: one launch, checked, valid counts;
  * compact   the same with compact=True (valid slots first in each row);
  * baseline  BaselineTopkSlots.compute: the engines' design (one program per token and 128
              columns, no context check, no counts);
  * copy      cudaMemcpyAsync device to device of T * (K + 1) * 4 bytes: as many bytes read and
              written as the conversion's top-k read, slots written and counts written (the
              floor: it does strictly less). Not in the copy: the conversion's req_id and ctx
              reads (8 bytes per token, 0.1% of a row) and its block-table reads (at most
              ceil(ctx / B) entries per token, a table of 64 requests that stays in L2).
  * floor     a conversion doing strictly less than plain (CUDA source below, benchmark only):
              one thread per int4 of top-k, reading it and its token's req_id, looking each
              entry up in block_table[req, v >> log2(B)] and storing its slot (-1 for v < 0);
              no context or width check, no counts, no error records; the fastest of 128, 256
              and 512 threads per block (as many blocks as int4). It is checked against the
              reference on the same (valid) input.
  * row floor the floor's work laid out as plain lays a row out at K = 2048: one block of 256
              threads per row, each thread two 16-byte pieces half a row apart (both loads
              before any lookup); it tells the geometry's share of plain's time from the share
              of its checks, counts and records.
Rows: T = 1, 64, 1024, 8192 query tokens (requests of 1..32k tokens of context, B = 64, rows of
requests shorter than K ending in -1s), and the layers form (61 layers of T = 1 and 64 in one
launch against 61 baseline launches). Every implementation is first checked against the NumPy
reference (kvaddr.dsa_reference) on the same input; the baseline on valid input.
Printed: time per call, the copy's time over the conversion's (the conversion's bandwidth as a
fraction of the copy's), compact / plain, plain / baseline, and plain and compact over the floor.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr.dsa import topk_slot_errors
from kvaddr.dsa_reference import topk_to_slots as reference
from kvaddr.strategies.dsa_topk import BaselineTopkSlots, KvaddrTopkSlots

K = 2048
B = 64
MAX_CONTEXT = 32768

# The floor (above): B a power of two, K % 4 == 0, rows * K / 4 < 2^31, every token's req_id a row
# of the table and every position's block inside its width (the benchmark's input).
FLOOR_SOURCE = r"""
extern "C" __global__ void topk_floor(const int4* __restrict__ topk,   // [rows * K / 4] int4
                                      const int* __restrict__ req_id,  // [T] int32
                                      const int* __restrict__ table,   // [R, W] int32, contiguous
                                      int4* __restrict__ slots,        // [rows * K / 4] int4 (written)
                                      unsigned int n4,                 // rows * K / 4
                                      unsigned int k4,                 // K / 4
                                      unsigned int num_tokens,         // T
                                      int width,                       // W
                                      int block_shift) {               // log2(B)
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const unsigned int token = (i / k4) % num_tokens;
    const int4 v = topk[i];
    const int* row = table + (long long)__ldg(req_id + token) * width;
    const int m = (1 << block_shift) - 1;
    int4 s;
    s.x = v.x < 0 ? -1 : (__ldg(row + (v.x >> block_shift)) << block_shift) + (v.x & m);
    s.y = v.y < 0 ? -1 : (__ldg(row + (v.y >> block_shift)) << block_shift) + (v.y & m);
    s.z = v.z < 0 ? -1 : (__ldg(row + (v.z >> block_shift)) << block_shift) + (v.z & m);
    s.w = v.w < 0 ? -1 : (__ldg(row + (v.w >> block_shift)) << block_shift) + (v.w & m);
    slots[i] = s;
}

// The same work, one block of blockDim.x threads per row of 8 * blockDim.x entries (K / 8 threads):
// thread t converts the row's int4 number t and t + blockDim.x.
extern "C" __global__ void topk_row_floor(const int4* __restrict__ topk, const int* __restrict__ req_id,
                                          const int* __restrict__ table, int4* __restrict__ slots,
                                          unsigned int num_tokens, int width, int block_shift) {
    const unsigned int i = blockIdx.x * 2u * blockDim.x + threadIdx.x;
    const unsigned int token = blockIdx.x % num_tokens;
    const int4 v0 = topk[i];
    const int4 v1 = topk[i + blockDim.x];
    const int* row = table + (long long)__ldg(req_id + token) * width;
    const int m = (1 << block_shift) - 1;
    int4 s, r;
    s.x = v0.x < 0 ? -1 : (__ldg(row + (v0.x >> block_shift)) << block_shift) + (v0.x & m);
    s.y = v0.y < 0 ? -1 : (__ldg(row + (v0.y >> block_shift)) << block_shift) + (v0.y & m);
    s.z = v0.z < 0 ? -1 : (__ldg(row + (v0.z >> block_shift)) << block_shift) + (v0.z & m);
    s.w = v0.w < 0 ? -1 : (__ldg(row + (v0.w >> block_shift)) << block_shift) + (v0.w & m);
    r.x = v1.x < 0 ? -1 : (__ldg(row + (v1.x >> block_shift)) << block_shift) + (v1.x & m);
    r.y = v1.y < 0 ? -1 : (__ldg(row + (v1.y >> block_shift)) << block_shift) + (v1.y & m);
    r.z = v1.z < 0 ? -1 : (__ldg(row + (v1.z >> block_shift)) << block_shift) + (v1.z & m);
    r.w = v1.w < 0 ? -1 : (__ldg(row + (v1.w >> block_shift)) << block_shift) + (v1.w & m);
    slots[i] = s;
    slots[i + blockDim.x] = r;
}
"""


@functools.cache
def floor_kernel():
    return cupy.RawModule(code=FLOOR_SOURCE).get_function("topk_floor")


def row_floor_launch(topk, req, table, slots, stream):
    """A launch of the row floor on ``stream``: one block of K / 8 threads per row."""
    fn = cupy.RawModule(code=FLOOR_SOURCE).get_function("topk_row_floor")
    rows = topk.size // K
    args = (topk, req, table, slots, np.uint32(req.size), np.int32(table.shape[1]), np.int32(B.bit_length() - 1))
    return lambda: fn((rows,), (K // 8,), args, stream=stream)


def floor_launch(topk, req, table, slots, threads, stream):
    """A launch of the floor on ``stream``, ``threads`` threads per block."""
    n4 = topk.size // 4
    t = req.size
    args = (topk, req, table, slots, np.uint32(n4), np.uint32(K // 4), np.uint32(t), np.int32(table.shape[1]))
    args += (np.int32(B.bit_length() - 1),)
    fn = floor_kernel()
    return lambda: fn((-(-n4 // threads),), (threads,), args, stream=stream)


def graph_time_per_copy(launch, stream, copies, replays):
    """Median GPU time per copy of ``launch`` over graph replays (bench_step's, without the samples)."""
    return bench_step.graph_time_per_copy(launch, stream, copies, replays)[0]


def make_input(rng, t, layers=1):
    """Host arrays: topk [L, T, K], req_id [T], table [R, W], ctx [T] (every entry inside its context)."""
    reqs = max(1, min(t, 64))
    width = MAX_CONTEXT // B
    table = rng.permutation(reqs * width * 2)[: reqs * width].reshape(reqs, width).astype(np.int32)
    req = (np.arange(t) % reqs).astype(np.int32)
    ctx = rng.integers(1, MAX_CONTEXT + 1, size=t).astype(np.int32)
    ctx[: max(1, t // 8)] = rng.integers(1, K, size=max(1, t // 8))  # short requests: rows end in -1s
    topk = np.empty((layers, t, K), np.int32)
    for i in range(t):
        c = int(ctx[i])
        for layer in range(layers):
            if c <= K:
                row = np.full(K, -1, np.int32)
                row[:c] = rng.permutation(c)
            else:
                row = rng.choice(c, size=K, replace=False).astype(np.int32)
            topk[layer, i] = row
    return topk, req, table, ctx


def check(name, got_slots, got_counts, want, compact):
    slots = cupy.asnumpy(got_slots)
    np.testing.assert_array_equal(slots, want.slots, err_msg=name)
    if got_counts is not None:
        np.testing.assert_array_equal(cupy.asnumpy(got_counts), want.valid_counts, err_msg=name)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=50)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"].decode()
    shapes = [(1, 1), (64, 1), (1024, 1), (8192, 1), (1, 61), (64, 61)]
    results = []
    with stream:
        for t, layers in shapes:
            h_topk, h_req, h_table, h_ctx = make_input(rng, t, layers)
            topk = cupy.asarray(h_topk if layers > 1 else h_topk[0])
            req, table, ctx = cupy.asarray(h_req), cupy.asarray(h_table), cupy.asarray(h_ctx)
            plain = KvaddrTopkSlots(t, K, B, num_layers=layers)
            packed = KvaddrTopkSlots(t, K, B, num_layers=layers, compact=True)
            base = BaselineTopkSlots(t, K, B, num_layers=layers)
            ref_in = h_topk if layers > 1 else h_topk[0]
            want = reference(ref_in, h_req, h_table, B, h_ctx)
            want_c = reference(ref_in, h_req, h_table, B, h_ctx, compact=True)
            assert np.all(np.asarray(want.error_mask) == 0)
            o = plain.compute(topk, req, table, ctx, stream=stream)
            check("plain", o.slots, o.valid_counts, want, False)
            o = packed.compute(topk, req, table, ctx, stream=stream)
            check("compact", o.slots, o.valid_counts, want_c, True)
            o = base.compute(topk, req, table, ctx, stream=stream)
            check("baseline", o.slots, None, want, False)
            floor_out = cupy.empty_like(topk)
            floors = {n: floor_launch(topk, req, table, floor_out, n, stream) for n in (128, 256, 512)}
            floors[256]()
            check("floor", floor_out, None, want, False)
            row_floor_out = cupy.empty_like(topk)
            row_floor = row_floor_launch(topk, req, table, row_floor_out, stream)
            row_floor()
            check("row floor", row_floor_out, None, want, False)
            for s in (plain, packed):
                masks, _ = topk_slot_errors(s.errors, stream=stream)
                assert not masks.any()
            nbytes = layers * t * (K + 1) * 4
            src = cupy.empty(nbytes // 4, np.int32)
            dst = cupy.empty_like(src)
            row = {"tokens": t, "layers": layers, "k": K, "copy_bytes": nbytes}
            row["copy_us"] = graph_time_per_copy(
                lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, stream.ptr),
                stream,
                a.copies,
                a.replays,
            )
            for name, s in (("plain", plain), ("compact", packed), ("baseline", base)):
                row[f"{name}_us"] = graph_time_per_copy(
                    lambda s=s: s.compute(topk, req, table, ctx, stream=stream), stream, a.copies, a.replays
                )
            per_threads = {n: graph_time_per_copy(f, stream, a.copies, a.replays) for n, f in floors.items()}
            row["floor_threads"] = min(per_threads, key=per_threads.get)
            row["floor_us"] = per_threads[row["floor_threads"]]
            row["row_floor_us"] = graph_time_per_copy(row_floor, stream, a.copies, a.replays)
            row["plain_bw_of_copy"] = row["copy_us"] / row["plain_us"]
            row["compact_bw_of_copy"] = row["copy_us"] / row["compact_us"]
            row["compact_over_plain"] = row["compact_us"] / row["plain_us"]
            row["plain_over_baseline"] = row["plain_us"] / row["baseline_us"]
            row["compact_over_baseline"] = row["compact_us"] / row["baseline_us"]
            row["plain_over_floor"] = row["plain_us"] / row["floor_us"]
            row["compact_over_floor"] = row["compact_us"] / row["floor_us"]
            row["plain_over_row_floor"] = row["plain_us"] / row["row_floor_us"]
            results.append(row)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {dev}; {when}; K = {K}, B = {B}; graph mode, {a.copies} copies per graph, median of {a.replays}")
    print(
        f"{'T':>6}{'L':>4}{'copy us':>10}{'plain us':>10}{'compact us':>12}{'baseline us':>13}{'floor us':>10}"
        f"{'plain bw/copy':>15}{'compact/plain':>15}{'plain/base':>12}{'compact/base':>14}"
        f"{'plain/floor':>13}{'compact/floor':>15}{'floor thr':>11}{'row floor us':>14}{'plain/row floor':>17}"
    )
    for r in results:
        print(
            f"{r['tokens']:>6}{r['layers']:>4}{r['copy_us']:>10.2f}{r['plain_us']:>10.2f}{r['compact_us']:>12.2f}"
            f"{r['baseline_us']:>13.2f}{r['floor_us']:>10.2f}{r['plain_bw_of_copy']:>15.2f}"
            f"{r['compact_over_plain']:>15.2f}{r['plain_over_baseline']:>12.2f}{r['compact_over_baseline']:>14.2f}"
            f"{r['plain_over_floor']:>13.2f}{r['compact_over_floor']:>15.2f}{r['floor_threads']:>11}"
            f"{r['row_floor_us']:>14.2f}{r['plain_over_row_floor']:>17.2f}"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": dev, "date": when, "rows": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
