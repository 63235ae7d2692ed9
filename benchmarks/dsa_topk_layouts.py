"""The top-k conversion's plain form against stripped conversions laid out in other ways (an instrument).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/dsa_topk_layouts.py

At K = 2048, B = 64 (benchmarks/bench_dsa_topk.py's input), T = 1, 64, 1024, graph mode, us per call:
the library's plain form (``KvaddrTopkSlots``), the baseline, the floor and row floor of
bench_dsa_topk.py, and conversions in the CUDA source below that check the context and the width,
refuse a block id whose slots pass int32 and write each row's valid count, but hold no DCP or
error-record code (B a power of two, one chunk per row):
  * lean256   one 256-thread block per row; the row's count zeroed before a barrier, warp sums added
  * lean256n  the same without the count
  * endbar256 one 256-thread block per row; the row's count reduced behind a barrier at the end,
              the plain form's scheme
  * c4n / c4s a row over a 4-block cluster (sm_90), without the count / the count pushed through
              distributed shared memory behind the cluster's barrier
Each is checked against the NumPy reference first. It tells the plain form's layout (endbar256)
from the code that its generality and error records add.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dsa_topk as bt

from kvaddr import kernel_loader
from kvaddr.dsa_reference import topk_to_slots as reference

SRC = r"""
__device__ __forceinline__ unsigned cta_rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ void st_remote(int* p, unsigned rank, int v) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(ra), "r"(v) : "memory");
}
__device__ __forceinline__ void cl_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cl_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

struct P {
    const int* topk; const int* req_id; const int* table; const int* ctx; int* slots; int* counts; int* flags;
    long long stride; int T; int K; int rows; int width; int shift; unsigned maxid;
};

// NV int4 per thread, at i0 + j * step (int4 index within the row)
template <int NV>
__device__ __forceinline__ int conv(const P& p, int token, long long row_off4, int i0, int step, bool do_count) {
    int4 v[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] = reinterpret_cast<const int4*>(p.topk)[row_off4 + i0 + j * step];
    const int req = p.req_id[token];
    const int c = p.ctx[token];
    const bool pad = req < 0;
    const int* tab = (!pad && req < p.rows) ? p.table + (long long)req * p.stride : p.table;
    const unsigned width = (!pad && req < p.rows) ? (unsigned)p.width : 0u;
    const unsigned lim = pad ? 0u : (unsigned)max(c, 0);
    const int* e = reinterpret_cast<const int*>(v);
    unsigned blk[NV * 4]; bool look[NV * 4]; int id[NV * 4];
    bool bad = false;
#pragma unroll
    for (int i = 0; i < NV * 4; ++i) {
        const unsigned q = (unsigned)e[i];
        blk[i] = q >> p.shift;
        look[i] = q < lim && blk[i] < width;
    }
#pragma unroll
    for (int i = 0; i < NV * 4; ++i) id[i] = look[i] ? __ldg(tab + blk[i]) : -1;
    int r[NV * 4]; int n = 0;
    const unsigned m = (1u << p.shift) - 1u;
#pragma unroll
    for (int i = 0; i < NV * 4; ++i) {
        const bool ok = look[i] && (unsigned)id[i] <= p.maxid;
        bad |= e[i] >= 0 && !pad && !ok;
        r[i] = ok ? (int)(((unsigned)id[i] << p.shift) | ((unsigned)e[i] & m)) : -1;
        n += ok;
    }
#pragma unroll
    for (int j = 0; j < NV; ++j)
        reinterpret_cast<int4*>(p.slots)[row_off4 + i0 + j * step] = make_int4(r[4 * j], r[4 * j + 1], r[4 * j + 2], r[4 * j + 3]);
    if (bad) atomicOr(p.flags, 1);
    return n;
}

// one block per row, NT threads, NV int4 each; count zeroed before a barrier, warp sums added at the end
template <int NT, int NV, bool COUNT>
__global__ void __launch_bounds__(NT) lean(const P p) {
    const int token = blockIdx.x;
    const long long row_off4 = (long long)token * (p.K >> 2);
    if (COUNT) {
        if (threadIdx.x == 0) p.counts[token] = 0;
        __syncthreads();
    }
    int n = conv<NV>(p, token, row_off4, threadIdx.x, NT, COUNT);
    if (COUNT) {
        n = __reduce_add_sync(0xffffffffu, n);
        if ((threadIdx.x & 31) == 0) atomicAdd(p.counts + token, n);
    }
}

// one block per row, the count reduced behind a barrier at the end (the shipped scheme, lean body)
template <int NT, int NV>
__global__ void __launch_bounds__(NT) lean_endbar(const P p) {
    __shared__ int ws[NT / 32];
    const int token = blockIdx.x;
    const long long row_off4 = (long long)token * (p.K >> 2);
    int n = conv<NV>(p, token, row_off4, threadIdx.x, NT, true);
    n = __reduce_add_sync(0xffffffffu, n);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = n;
    __syncthreads();
    if (threadIdx.x < 32) {
        int s = threadIdx.x < NT / 32 ? ws[threadIdx.x] : 0;
        s = __reduce_add_sync(0xffffffffu, s);
        if (threadIdx.x == 0) p.counts[token] = s;
    }
}

// C blocks (one cluster) per row, NT threads each, NV int4 each; MODE 0: no count, 1: cluster sync, 2: arrive all / wait rank 0
template <int C, int NT, int NV, int MODE>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NT) split(const P p) {
    __shared__ int ws[C * NT / 32];
    const int token = blockIdx.x / C;
    const unsigned rank = MODE ? cta_rank() : (blockIdx.x % C);
    const long long row_off4 = (long long)token * (p.K >> 2);
    int n = conv<NV>(p, token, row_off4, rank * NT * NV + threadIdx.x, NT, MODE != 0);
    if (MODE == 0) return;
    n = __reduce_add_sync(0xffffffffu, n);
    if ((threadIdx.x & 31) == 0) st_remote(ws + rank * (NT / 32) + (threadIdx.x >> 5), 0, n);
    cl_arrive();
    if (MODE == 2 && rank != 0) return;
    cl_wait();
    if (rank == 0 && threadIdx.x < 32) {
        int s = 0;
        for (int i = threadIdx.x; i < C * NT / 32; i += 32) s += ws[i];
        s = __reduce_add_sync(0xffffffffu, s);
        if (threadIdx.x == 0) p.counts[token] = s;
    }
}
"""

NAMES = {
    "lean256": ("lean<256, 2, true>", 256, 1),
    "lean256n": ("lean<256, 2, false>", 256, 1),
    "endbar256": ("lean_endbar<256, 2>", 256, 1),
    "c4n": ("split<4, 128, 1, 0>", 128, 4),
    "c4s": ("split<4, 128, 1, 1>", 128, 4),
}


class Args(ctypes.Structure):
    """The CUDA source's ``P``, passed by value."""

    _fields_ = [
        ("topk", ctypes.c_void_p),
        ("req_id", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
        ("flags", ctypes.c_void_p),
        ("stride", ctypes.c_longlong),
        ("T", ctypes.c_int),
        ("K", ctypes.c_int),
        ("rows", ctypes.c_int),
        ("width", ctypes.c_int),
        ("shift", ctypes.c_int),
        ("maxid", ctypes.c_uint),
    ]


def checked(fn, t, threads, blocks_per_row, args, stream, slots, counts, flags, want, with_count):
    """A launch of ``fn`` over ``t`` rows, checked against the reference once."""
    fa = kernel_loader.function_args(args, by_value=True)

    def launch():
        fn((t * blocks_per_row,), (threads,), fa, stream=stream)

    slots.fill(-7)
    counts.fill(-7)
    flags.fill(0)
    launch()
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(slots), want.slots)
    if with_count:
        np.testing.assert_array_equal(cupy.asnumpy(counts), want.valid_counts)
    assert int(flags[0]) == 0
    return launch


def main():
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=[v[0] for v in NAMES.values()])
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)

    def gt(f):
        return bt.graph_time_per_copy(f, stream, 50, 20)

    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; K = {bt.K}, B = {bt.B}; us per call")
    with stream:
        for t in (1, 64, 1024):
            h_topk, h_req, h_table, h_ctx = bt.make_input(rng, t, 1)
            want = reference(h_topk[0], h_req, h_table, bt.B, h_ctx)
            topk, req = cupy.asarray(h_topk[0]), cupy.asarray(h_req)
            table, ctx = cupy.asarray(h_table), cupy.asarray(h_ctx)
            stream.synchronize()
            plain, base = bt.KvaddrTopkSlots(t, bt.K, bt.B), bt.BaselineTopkSlots(t, bt.K, bt.B)
            plain.compute(topk, req, table, ctx, stream=stream)
            base.compute(topk, req, table, ctx, stream=stream)
            fl = bt.floor_launch(topk, req, table, cupy.empty_like(topk), 128, stream)
            rf = bt.row_floor_launch(topk, req, table, cupy.empty_like(topk), stream)
            slots, counts, flags = cupy.empty_like(topk), cupy.zeros(t, np.int32), cupy.zeros(1, np.int32)
            args = Args(
                topk.data.ptr, req.data.ptr, table.data.ptr, ctx.data.ptr, slots.data.ptr, counts.data.ptr,
                flags.data.ptr, table.shape[1], t, bt.K, table.shape[0], table.shape[1], bt.B.bit_length() - 1,
                (2**31 - 1 - (bt.B - 1)) // bt.B,
            )  # fmt: skip
            row = {
                "T": t,
                "plain": gt(lambda: plain.compute(topk, req, table, ctx, stream=stream)),
                "baseline": gt(lambda: base.compute(topk, req, table, ctx, stream=stream)),
                "floor128": gt(fl),
                "row_floor": gt(rf),
            }
            for name, (expr, threads, per_row) in NAMES.items():
                launch = checked(
                    mod.get_function(expr), t, threads, per_row, args, stream, slots, counts, flags, want,
                    not name.endswith("n"),
                )  # fmt: skip
                row[name] = gt(launch)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
