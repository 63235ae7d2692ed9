"""Floors under the fused step: what a step costs with less than the spec asks.

Times, side by side and the same way as ``bench_step.py`` (N copies of one call in one
CUDA graph, median of R replays, time per copy), kernels that do strictly less than the
spec's step, so the fused step can be compared with what no step can beat:

``roundtrip``
    One global round trip: load seq_lens_this_time[t], store it.
``decode-min``
    Decode addressing that trusts its input (token t is request t): load
    seq_lens_decoder[t], load the block id per cache, store batch id, position and
    one slot per cache, -1 padding to capacity. No uniformity test, no checks,
    no error record, no cu_seqlens_q or seq_lens_kv.
``decode-out``
    decode-min plus the per-request outputs the spec also requires
    (cu_seqlens_q, seq_lens_kv, num_tokens), still with no checks.
``mixed-min``
    The same for a mixed batch of at most 256 requests: every block scans the
    lengths (one request per thread, warp shuffles and one shared-memory round),
    then each token binary-searches its request; no checks, no per-request outputs.
``slot call``
    One per-layer slot-kernel call (``kvaddr_slots_i64``).
``step``
    ``StepPlanner.compute``: the kernel the dispatch table (kvaddr/dispatch.py) chooses
    for the batch (``step_small``, ``step_wide`` or ``step_multiblock``; every output,
    every check), its name and launch geometry printed per row.
``one-block``
    FastDeploy's one-block step as kvaddr's ``one-block`` strategy
    (``kvaddr_one_block_i64``: ``<<<1, bsz>>>``, a thread per request adding up the
    earlier lengths, then looping over its tokens; every output, padding included).
    It runs at most 1024 requests: "not run" for larger batches.

Shapes: decode batches of 1, 64, 512, 1024 and 4096 requests and 256 requests with mixed
lengths (~16k tokens), one and two caches (B = 64, one shared table). The step's outputs and
error record, the floors' token layout and one-block's outputs are first checked against the
NumPy reference (kvaddr.reference). A second table puts the step beside its floor
(decode-out for decode batches, mixed-min for the mixed one) and beside one-block, with the
ratios step/floor, one-block/floor and step/one-block; then what the second cache adds.

The minimal kernels' CUDA source lives here, not in ``kvaddr/kernels.cu``: it is a
measuring instrument, not library code.

    PYTHONPATH=. python benchmarks/floor_step.py [--copies 200] [--replays 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import B, graph_time_per_copy, make_batch

from kvaddr import StepPlanner, kernel_loader
from kvaddr.constants import ONE_BLOCK_MAX_REQUESTS
from kvaddr.outputs import OUTPUT_FIELDS
from kvaddr.reference import step_addressing
from kvaddr.strategies.gpu import OneBlock, PerLayerKernel

SOURCE = r"""
typedef long long i64;

extern "C" __global__ void __launch_bounds__(256)
floor_roundtrip(const int* __restrict__ q, int bsz, int capacity, int* __restrict__ out) {
    const int t = blockIdx.x * 256 + threadIdx.x;
    if (t < capacity) out[t] = t < bsz ? q[t] : 0;
}

// Token t of request b at position pos: its block ids (per cache), batch id, position
// and slots; or padding when b < 0. No checks.
template <int G>
__device__ __forceinline__ void gather_store(int t, int b, int pos, int capacity, const int* __restrict__ t0,
                                             const int* __restrict__ t1, long long stride, int bs,
                                             int* __restrict__ batch_out, i64* __restrict__ pos_out,
                                             i64* __restrict__ slot_out) {
    if (b >= 0) {
        const unsigned int idx = (unsigned int)pos / (unsigned int)bs, off = (unsigned int)pos - idx * (unsigned int)bs;
        const int b0 = t0[(i64)b * stride + idx];
        int b1 = 0;
        if (G > 1) b1 = t1[(i64)b * stride + idx];
        batch_out[t] = b;
        pos_out[t] = pos;
        slot_out[t] = (i64)b0 * bs + off;
        if (G > 1) slot_out[(i64)capacity + t] = (i64)b1 * bs + off;
    } else {
        batch_out[t] = -1;
        pos_out[t] = 0;
        slot_out[t] = -1;
        if (G > 1) slot_out[(i64)capacity + t] = -1;
    }
}

template <int G, bool OUTPUTS>
__device__ __forceinline__ void decode_min(const int* __restrict__ dec, int bsz, int capacity,
                                           const int* __restrict__ t0, const int* __restrict__ t1, long long stride,
                                           int bs, int* __restrict__ batch_out, i64* __restrict__ pos_out,
                                           i64* __restrict__ slot_out, int* __restrict__ cu_out,
                                           int* __restrict__ kv_out, int* __restrict__ num_tokens_out) {
    const int t = blockIdx.x * 256 + threadIdx.x;
    if (OUTPUTS) {
        if (t < bsz) cu_out[t] = t;
        if (t == 0) {
            cu_out[bsz] = bsz;
            *num_tokens_out = bsz;
        }
    }
    if (t >= capacity) return;
    const int d = t < bsz ? dec[t] : 0;
    gather_store<G>(t, t < bsz ? t : -1, d, capacity, t0, t1, stride, bs, batch_out, pos_out, slot_out);
    if (OUTPUTS && t < bsz) kv_out[t] = d + 1;
}

#define FLOOR_DECODE(NAME, G, OUT)                                                                        \
extern "C" __global__ void __launch_bounds__(256)                                                        \
NAME(const int* __restrict__ dec, int bsz, int capacity, const int* __restrict__ t0,                     \
     const int* __restrict__ t1, long long stride, int bs, int* __restrict__ batch_out,                  \
     i64* __restrict__ pos_out, i64* __restrict__ slot_out, int* __restrict__ cu_out,                    \
     int* __restrict__ kv_out, int* __restrict__ num_tokens_out) {                                       \
    decode_min<G, OUT>(dec, bsz, capacity, t0, t1, stride, bs, batch_out, pos_out, slot_out, cu_out,     \
                       kv_out, num_tokens_out);                                                          \
}
FLOOR_DECODE(floor_decode_min_1, 1, false)
FLOOR_DECODE(floor_decode_min_2, 2, false)
FLOOR_DECODE(floor_decode_out_1, 1, true)
FLOOR_DECODE(floor_decode_out_2, 2, true)

// A mixed batch of at most 256 requests, trusting its input: one block-wide scan of
// the lengths (one request per thread) in every block, a binary search per token,
// the block ids, batch id, position and slots. No checks, no per-request outputs.
template <int G>
__device__ __forceinline__ void mixed_min(const int* __restrict__ dec, const int* __restrict__ q, int bsz,
                                          int capacity, const int* __restrict__ t0, const int* __restrict__ t1,
                                          long long stride, int bs, int* __restrict__ batch_out,
                                          i64* __restrict__ pos_out, i64* __restrict__ slot_out) {
    __shared__ int cu[257];
    __shared__ int dsh[256];
    __shared__ int wsum[8];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.x * 256 + tid;
    const int n = tid < bsz ? q[tid] : 0;
    dsh[tid] = tid < bsz ? dec[tid] : 0;
    int x = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int base = 0;
    for (int w = 0; w < warp; ++w) base += wsum[w];
    cu[tid + 1] = base + x;
    if (tid == 0) cu[0] = 0;
    __syncthreads();
    if (t >= capacity) return;
    int b = -1, pos = 0;
    if (t < cu[bsz]) {
        int lo = 0, hi = bsz;  // the largest b with cu[b] <= t
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (cu[mid] <= t) lo = mid; else hi = mid;
        }
        b = lo;
        pos = dsh[lo] + (t - cu[lo]);
    }
    gather_store<G>(t, b, pos, capacity, t0, t1, stride, bs, batch_out, pos_out, slot_out);
}

#define FLOOR_MIXED(NAME, G)                                                                              \
extern "C" __global__ void __launch_bounds__(256)                                                        \
NAME(const int* __restrict__ dec, const int* __restrict__ q, int bsz, int capacity,                      \
     const int* __restrict__ t0, const int* __restrict__ t1, long long stride, int bs,                   \
     int* __restrict__ batch_out, i64* __restrict__ pos_out, i64* __restrict__ slot_out) {               \
    mixed_min<G>(dec, q, bsz, capacity, t0, t1, stride, bs, batch_out, pos_out, slot_out);               \
}
FLOOR_MIXED(floor_mixed_min_1, 1)
FLOOR_MIXED(floor_mixed_min_2, 2)
"""


SHAPES = (
    ("decode 1", 1, 1, False),
    ("decode 64", 64, 1, False),
    ("decode 512", 512, 1, False),
    ("decode 1024", 1024, 1, False),
    ("decode 4096", 4096, 1, False),
    ("256 req, mixed (~16k)", 256, 64, True),
)


def check_outputs(got, ref, label: str) -> None:
    """Every output field of ``got`` (device arrays) equals the reference's."""
    for f in OUTPUT_FIELDS:
        assert np.array_equal(cupy.asnumpy(getattr(got, f)), np.asarray(getattr(ref.outputs, f))), f"{label}: {f}"


def floor_launches(mod, label, G, bsz, cap, dec, q, table, mixed, ref, stream):
    """The floor kernels of one row as ``{kind: (function, args)}``, each checked against the reference."""
    grid = ((cap + 255) // 256,)
    stride = np.int64(table.shape[1])
    batch_out = cupy.empty(cap, dtype=cupy.int32)
    pos_out = cupy.empty(cap, dtype=cupy.int64)
    slot_out = cupy.empty((G, cap), dtype=cupy.int64)
    cu_out = cupy.empty(bsz + 1, dtype=cupy.int32)
    kv_out = cupy.empty(bsz, dtype=cupy.int32)
    nt_out = cupy.empty(1, dtype=cupy.int32)
    common = (table, table, stride, np.int32(B), batch_out, pos_out, slot_out)
    if mixed:
        assert bsz <= 256, "the mixed floor kernel scans one request per thread"
        kinds = {"min": (mod.get_function(f"floor_mixed_min_{G}"), (dec, q, np.int32(bsz), np.int32(cap), *common))}
    else:
        kinds = {
            kind: (
                mod.get_function(f"floor_decode_{kind}_{G}"),
                (dec, np.int32(bsz), np.int32(cap), *common, cu_out, kv_out, nt_out),
            )
            for kind in ("min", "out")
        }
    o = ref.outputs
    for kind, (fn, args) in kinds.items():
        fn(grid, (256,), args)
        stream.synchronize()
        # the floor kernels compute the same token layout as the step
        assert np.array_equal(batch_out.get(), o.batch_id_per_token), f"{label} {kind}: batch ids differ"
        assert np.array_equal(pos_out.get(), o.position_ids), f"{label} {kind}: positions differ"
        assert np.array_equal(slot_out.get(), o.slot_mapping), f"{label} {kind}: slots differ"
        if kind == "out":
            assert np.array_equal(cu_out.get(), o.cu_seqlens_q) and np.array_equal(kv_out.get(), o.seq_lens_kv)
    return grid, kinds


def print_tables(rows, copies, replays, dev) -> None:
    print(f"device: {dev}; graph mode, {copies} copies per graph, median of {replays} replays; us per copy")
    print(
        f"{'batch':<23}{'caches':>7}{'empty':>8}{'roundtrip':>11}{'min':>8}{'outputs':>9}"
        f"{'slot call':>11}{'step':>8}{'bound':>8}"
    )
    for r in rows:
        outputs = "-" if r["outputs_us"] is None else f"{r['outputs_us']:.3f}"
        print(
            f"{r['batch']:<23}{r['caches']:>7}{r['empty_us']:>8.3f}{r['roundtrip_us']:>11.3f}"
            f"{r['min_us']:>8.3f}{outputs:>9}{r['slot_call_us']:>11.3f}{r['step_us']:>8.3f}{r['bound_us']:>8.3f}"
        )
    print(
        "bound = min(1.25 x slot call, 3 x empty). min: decode-min (decode) or mixed-min (mixed); outputs:"
        " decode-out. None of them checks anything the spec requires checked."
    )
    print()
    print(
        f"{'batch':<23}{'caches':>7}{'floor':>8}{'step':>8}{'step/floor':>12}{'one-block':>11}"
        f"{'1b/floor':>10}{'step/1b':>9}  kernel <<<blocks, threads>>>"
    )
    for r in rows:
        if r["one_block_us"] is None:
            ob, ob_floor, step_ob = "not run", "-", "-"
        else:
            ob = f"{r['one_block_us']:.3f}"
            ob_floor, step_ob = f"{r['one_block_over_floor']:.2f}x", f"{r['step_over_one_block']:.2f}x"
        k, blocks, threads = r["launch"]
        print(
            f"{r['batch']:<23}{r['caches']:>7}{r['floor_us']:>8.3f}{r['step_us']:>8.3f}"
            f"{r['step_over_floor']:>11.2f}x{ob:>11}{ob_floor:>10}{step_ob:>9}  {k} <<<{blocks}, {threads}>>>"
        )
    print(
        "floor: decode-out (decode batches) or mixed-min (the mixed one). one-block (1b): FastDeploy's one-block"
        f" step (one block, a thread per request), every output; not run: it runs at most {ONE_BLOCK_MAX_REQUESTS}"
        " requests. step/1b below 1: kvaddr's step is faster."
    )
    by = {(r["batch"], r["caches"]): r for r in rows}
    for (batch, caches), r in by.items():
        two = by.get((batch, 2))
        if caches == 1 and two is not None:
            print(f"second cache adds, {batch}: {two['step_us'] - r['step_us']:+.3f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    mod = cupy.RawModule(code=SOURCE, options=("--std=c++17",))
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    empty = kernel_loader.get_function("kvaddr_empty")
    s_obj = kernel_loader.raw_stream(stream.ptr)

    def timed(launch):
        return graph_time_per_copy(launch, stream, a.copies, a.replays)[0]

    rows = []
    with stream:
        t_empty = timed(lambda: empty((1,), (1,), (), 0, s_obj))
        for label, bsz, per, mixed in SHAPES:
            dec, q, table, cap = make_batch(rng, bsz, per, mixed=mixed)
            out_i = cupy.zeros(cap, dtype=cupy.int32)
            roundtrip = mod.get_function("floor_roundtrip")
            grid = ((cap + 255) // 256,)
            t_rt = timed(lambda: roundtrip(grid, (256,), (q, np.int32(bsz), np.int32(cap), out_i)))
            for G in (1, 2):
                ref = step_addressing(dec.get(), q.get(), table.get(), [B] * G, cap)
                # the library's step, as users get it: the dispatch table's kernel for this batch
                planner = StepPlanner(bsz, cap, [B] * G)
                got = planner.compute(dec, q, table, stream=stream)
                stream.synchronize()
                check_outputs(got, ref, f"{label} step")
                assert planner.errors(stream) == (ref.error_mask, ref.error_key), f"{label} step: error record"
                grid, kinds = floor_launches(mod, label, G, bsz, cap, dec, q, table, mixed, ref, stream)
                times = {
                    kind: timed(lambda fn=fn, args=args: fn(grid, (256,), args)) for kind, (fn, args) in kinds.items()
                }
                slot = PerLayerKernel(max_requests=bsz, capacity=cap, block_sizes=[B] * G, num_layers=1)
                slot.step(dec, q, table, stream=stream)
                launcher = slot._launchers[0]  # cache 0's slot kernel, its table set by step()
                t_slot = timed(lambda: launcher(grid[0], 256, stream.ptr))
                t_step = timed(lambda: planner.compute(dec, q, table, stream=stream))
                t_one_block = None
                if bsz <= ONE_BLOCK_MAX_REQUESTS:
                    one_block = OneBlock(max_requests=bsz, capacity=cap, block_sizes=[B] * G, num_layers=1)
                    check_outputs(one_block.step(dec, q, table, stream=stream), ref, f"{label} one-block")
                    t_one_block = timed(lambda: one_block.step(dec, q, table, stream=stream))
                t_floor = times["min"] if mixed else times["out"]
                rows.append(
                    dict(
                        batch=label,
                        caches=G,
                        launch=list(planner.kernel_for(bsz)),
                        empty_us=t_empty,
                        roundtrip_us=t_rt,
                        min_us=times["min"],
                        outputs_us=times.get("out"),
                        slot_call_us=t_slot,
                        step_us=t_step,
                        bound_us=min(1.25 * t_slot, 3.0 * t_empty),
                        floor_kind="mixed-min" if mixed else "decode-out",
                        floor_us=t_floor,
                        one_block_us=t_one_block,
                        step_over_floor=t_step / t_floor,
                        one_block_over_floor=None if t_one_block is None else t_one_block / t_floor,
                        step_over_one_block=None if t_one_block is None else t_step / t_one_block,
                    )
                )
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print_tables(rows, a.copies, a.replays, dev)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=dev, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
