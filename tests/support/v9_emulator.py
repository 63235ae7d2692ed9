"""v9's small-batch step and its ablation/fix variants (kernels.cu's v9 section, compiled with
``KV_ABLATION`` as tests/support/ablation.py cuts it) run on the CPU: the device code compiled by
the host C++ compiler (C++20), one std::thread per CUDA thread, warp shuffles, votes and block
barriers emulated with std::barrier. Used by tests/unit/test_v9_fixes_emulated.py to prove the
candidate fixes (KV_FIX_*, KV_ABL_PARAM_REGS) against the NumPy reference without a GPU; mask 0
(v9 as shipped, proven on the H200) is the emulator's own control. Not emulated: memory
ordering between blocks (the blocks run one after another), timing."""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tests.support.ablation import ablation_source

CXX = shutil.which("g++")
#: The masks the emulator is built for (kvaddr_step1_abl_c{G}_m{MASK}, G = 1, 2).
MASKS = (0, 32, 128, 256, 384, 416)

PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <barrier>
#include <algorithm>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
using std::min;
using std::max;
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
struct Warp { std::barrier<>* bar; unsigned long long raw[32]; };
static Warp g_warps[32];
static std::barrier<>* g_block;
static unsigned long long g_bvals[1024];
static inline int emu_lane() { return threadIdx.x & 31; }
static inline Warp& emu_warp() { return g_warps[threadIdx.x >> 5]; }
template <class T> static T emu_xchg(T v, int src) {
    Warp& w = emu_warp();
    unsigned long long r = 0; memcpy(&r, &v, sizeof(T));
    w.raw[emu_lane()] = r;
    w.bar->arrive_and_wait();
    unsigned long long o = w.raw[src & 31];
    w.bar->arrive_and_wait();
    T out; memcpy(&out, &o, sizeof(T));
    return out;
}
template <class T> T __shfl_up_sync(unsigned, T v, int off) {
    int l = emu_lane(); return emu_xchg(v, l >= off ? l - off : l);
}
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu_xchg(v, src); }
template <class T> T __shfl_xor_sync(unsigned, T v, int m) { return emu_xchg(v, emu_lane() ^ m); }
static unsigned emu_gather_or(unsigned v, int mode) {  // 0 or, 1 and, 2 ballot
    Warp& w = emu_warp();
    w.raw[emu_lane()] = v;
    w.bar->arrive_and_wait();
    unsigned r = mode == 1 ? 1u : 0u;
    for (int i = 0; i < 32; ++i) {
        if (mode == 0) r |= (unsigned)w.raw[i];
        else if (mode == 1) r &= (w.raw[i] != 0);
        else r |= (w.raw[i] != 0) << i;
    }
    w.bar->arrive_and_wait();
    return r;
}
static unsigned __reduce_or_sync(unsigned, unsigned v) { return emu_gather_or(v, 0); }
static int __any_sync(unsigned, int p) { return emu_gather_or(p != 0, 0) != 0; }
static int __all_sync(unsigned, int p) { return emu_gather_or(p != 0, 1) != 0; }
static unsigned __ballot_sync(unsigned, int p) { return emu_gather_or(p != 0, 2); }
static void __syncwarp(unsigned = 0xffffffffu) { emu_warp().bar->arrive_and_wait(); }
static void __syncthreads() { g_block->arrive_and_wait(); }
static int emu_block_red(int p, int mode) {
    g_bvals[threadIdx.x] = p != 0;
    g_block->arrive_and_wait();
    int r = mode;
    for (unsigned i = 0; i < blockDim.x; ++i) r = mode ? (r && g_bvals[i]) : (r || g_bvals[i]);
    g_block->arrive_and_wait();
    return r;
}
static int __syncthreads_or(int p) { return emu_block_red(p, 0); }
static int __syncthreads_and(int p) { return emu_block_red(p, 1); }
template <class T> T __ldcg(const T* p) { return *p; }
static unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
struct alignas(16) int4 { int x, y, z, w; };
static inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
static unsigned long long atomicOr(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);
}
static unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
    unsigned long long o = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (v < o && !__atomic_compare_exchange_n(a, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return o;
}
"""

DRIVER = r"""
typedef void (*KernelFn)(const KvStepParams);
template <KernelFn F>
static void emu_launch(const KvStepParams* p, int grid, int block) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid, 1, 1};
    for (int b = 0; b < grid; ++b) {
        std::barrier<> blockbar(block);
        g_block = &blockbar;
        std::vector<std::barrier<>*> wb;
        for (int w = 0; w < block / 32; ++w) { wb.push_back(new std::barrier<>(32)); g_warps[w].bar = wb.back(); }
        std::vector<std::thread> ts;
        for (int t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)b, 0, 0}; F(*p); });
        for (auto& t : ts) t.join();
        for (auto* x : wb) delete x;
    }
}
#define EMU(G, M) if (g == G && m == M) { emu_launch<kvaddr_step1_abl_c##G##_m##M>(p, grid, block); return 0; }
// v9 across blocks (kvaddr_step1w{R}_c{G}_i64 of the library: kv_step_one_ablate<G, i64, KV_V9_DEFAULT, R>)
template <int G, int R>
static void emu_wide_kernel(const KvStepParams params) { kv_step_one_ablate<G, i64, KV_V9_DEFAULT, R>(params); }
#define EMUW(G, R) if (g == G && r == R) { emu_launch<emu_wide_kernel<G, R>>(p, grid, block); return 0; }
extern "C" int emu_run_wide(int g, int r, const KvStepParams* p, int grid, int block) {
    EMUW(0, 4) EMUW(0, 8) EMUW(0, 16) EMUW(1, 4) EMUW(1, 8) EMUW(1, 16) EMUW(2, 4) EMUW(2, 8) EMUW(2, 16)
    EMUW(3, 4) EMUW(3, 8) EMUW(3, 16) EMUW(4, 4) EMUW(4, 8) EMUW(4, 16)
    return 1;
}
extern "C" int emu_run(int g, int m, const KvStepParams* p, int grid, int block) {
    EMU(1, 0) EMU(1, 32) EMU(1, 128) EMU(1, 256) EMU(1, 384) EMU(1, 416)
    EMU(2, 0) EMU(2, 32) EMU(2, 128) EMU(2, 256) EMU(2, 384) EMU(2, 416)
    return 1;
}
"""


def num_records(capacity: int, max_requests: int) -> tuple[int, int]:
    """``(records, max_tiles)`` of a planner of this capacity and max_requests (StepPlanner.__init__:
    every record either kernel may write)."""
    num_chunks = -(-capacity // 256)
    max_tiles = -(-max_requests // 4096) if max_requests > 4096 else 0
    max_tiles = max(max_tiles, -(-max(32, -(-(capacity + 1024) // 32)) // 8) - num_chunks)
    return (num_chunks + max_tiles) * 8, max_tiles


def clean_records(capacity: int, max_requests: int) -> np.ndarray:
    """Cleared records (mask 0, key all ones), flat uint64 [2 * records]."""
    rec = np.zeros(2 * num_records(capacity, max_requests)[0], np.uint64)
    rec[1::2] = np.uint64((1 << 64) - 1)
    return rec


@functools.cache
def library() -> ctypes.CDLL:
    """Compile (once per process) and load the emulated v9 kernels."""
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_v9emu_"))
    # x86 has no "l" asm constraint: "r" takes 64-bit operands there
    code = PRELUDE + ablation_source().replace('"+l"', '"+r"') + DRIVER
    (tmp / "v9emu.cpp").write_text(code)
    out = tmp / "v9emu.so"
    cmd = [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(out), str(tmp / "v9emu.cpp")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))


def _at(values, offset: int) -> np.ndarray:
    """An int32 copy of ``values`` whose data starts ``offset`` bytes past a 16-byte boundary."""
    values = np.asarray(values, dtype=np.int32)
    buf = np.zeros(values.size + 8, np.int32)
    skip = ((16 - buf.ctypes.data % 16) % 16 + offset) // 4
    out = buf[skip : skip + values.size]
    out[:] = values
    assert out.ctypes.data % 16 == offset
    return out


def wide_geometry(bsz: int, capacity: int, r: int = 0, wide_threads: int = 256) -> tuple[int, int, int]:
    """``(R, blocks, threads)`` of v9 across blocks: StepPlanner._wide_geometry's rule (R forced
    where R x 1024 >= bsz, else the smallest of 4, 8, 16 with R x wide_threads >= bsz; T = bsz / R
    in warps)."""
    if not r or r * 1024 < bsz:
        r = next((k for k in (4, 8, 16) if k * wide_threads >= bsz), 16)
        if r * 1024 < bsz:
            r = 16
    threads = min(4096 // r, max(32, (-(-bsz // r) + 31) & ~31))
    return r, -(-capacity // threads), threads


def run(
    mask: int,
    case: dict,
    *,
    wide: bool = False,
    max_requests: int | None = None,
    records=None,
    across: tuple[int, int, int] | None = None,
    unaligned_lengths: bool = False,
):
    """Run ``kvaddr_step1_abl_c{G}_m{mask}`` on ``case`` (step_cases' dict) with v9's geometry
    (the planner's: T = max(bsz, min(C, 256 or 1024 if wide), 32) rounded to a warp), from
    poisoned outputs and clean (sticky) records; returns ``(outputs dict, (error_mask,
    first_bad_key))``, the reduction of every record. ``records``: a uint64 array of
    :func:`num_records` ``* 2`` words to use (and keep) instead, e.g. the last run's: the
    records are sticky, so it then holds every error of both runs.
    ``across = (R, blocks, threads)``: run v9 across blocks (the library's ``kvaddr_step1w{R}_c{G}_i64``,
    any G of 0-4) instead, with that geometry (``mask`` ignored). ``unaligned_lengths``: the length
    arrays start 4 bytes past a 16-byte boundary (the wide kernel's scalar loads, no int4)."""
    from kvaddr.kernel_loader import StepParams

    G = len(case["block_sizes"])
    bsz = case["seq_lens_decoder"].shape[0]
    C = case["capacity"]
    maxr = max(max_requests or bsz, 1)
    P = StepParams()
    dec = _at(case["seq_lens_decoder"], 4 if unaligned_lengths else 0)
    q = _at(case["seq_lens_this_time"], 4 if unaligned_lengths else 0)
    P.seq_lens_decoder = dec.ctypes.data
    P.seq_lens_this_time = q.ctypes.data
    tables = case["block_tables"]
    tables = list(tables) if isinstance(tables, (list, tuple)) else [tables] * G
    for g in range(4):
        if g < G:
            t = tables[g]
            assert t.dtype == np.int32 and t.strides[1] == 4
            P.block_tables[g] = t.ctypes.data
            P.table_stride[g] = t.strides[0] // 4
            P.max_blocks[g] = t.shape[1]
            P.block_size[g] = case["block_sizes"][g]
        else:
            P.max_blocks[g] = 1
            P.block_size[g] = 1
    out = dict(
        cu_seqlens_q=np.full(maxr + 1, 0x5A5A5A5A, np.int32),
        num_tokens=np.full((), -77, np.int32),
        batch_id_per_token=np.full(C, 0x5A5A5A5A, np.int32),
        position_ids=np.full(C, 0x5A5A5A5A, np.int64),
        seq_lens_kv=np.full(maxr, 0x5A5A5A5A, np.int32),
        slot_mapping=np.full((G, C), 0x5A5A5A5A, np.int64),
    )
    for k, v in out.items():
        setattr(P, k, v.ctypes.data)
    n_rec, max_tiles = num_records(C, maxr)
    if records is None:
        records = clean_records(C, maxr)
    rec = records
    assert rec.dtype == np.uint64 and rec.shape == (2 * n_rec,) and rec.flags.c_contiguous
    P.error_records = rec.ctypes.data
    P.bsz, P.capacity, P.num_caches, P.max_tiles, P.num_meta = bsz, C, G, max_tiles, 0
    if across is not None:
        r, grid, T = across
        assert r * T >= bsz and T <= 1024 and grid * T // 32 <= n_rec, (across, bsz, n_rec)
        rc = library().emu_run_wide(G, r, ctypes.byref(P), grid, T)
        assert rc == 0, f"no emulated wide kernel for {G} caches, R {r}"
    else:
        n = max(bsz, min(C, 1024 if wide else 256), 32)
        T = min(1024, (n + 31) & ~31)
        rc = library().emu_run(G, mask, ctypes.byref(P), -(-C // T), T)
        assert rc == 0, f"no emulated kernel for {G} caches, mask {mask}"
    out["cu_seqlens_q"] = out["cu_seqlens_q"][: bsz + 1]
    out["seq_lens_kv"] = out["seq_lens_kv"][:bsz]
    return out, (int(np.bitwise_or.reduce(rec[0::2])), int(rec[1::2].min()))
