"""Run kernels/dsa.cuh's ``dsa_topk_slots`` on the CPU: its device code compiled by the host C++
compiler behind the prelude of tests/support/vllm_emulator.py, and a driver that restates the
kernel's entry: for each block, every thread runs one phase (the code between two barriers)
before any thread runs the next, so the shared-memory scan sees what a barrier guarantees.

What is emulated: every device helper of the conversion (the source text, unchanged), with the
warp-level scan and reduction replaced by their shared-memory twins (``#ifndef __CUDA_ARCH__``
in dsa.cuh). Not emulated: warp shuffles, atomics, memory ordering, and the entry's final
``kv_merge_record`` (restated here); the GPU tests cover them.
The baseline kernel (``kvaddr_dsa_topk_baseline``, kernels/baselines.cuh) runs whole, one
thread after another.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import tempfile
from pathlib import Path

from kvaddr import kernel_loader
from tests.support.vllm_emulator import CXX, PRELUDE

EXTRA_PRELUDE = r"""
#define __shared__ static
#include <cstddef>
struct int4 { int x, y, z, w; };
static inline int4 make_int4(int x, int y, int z, int w) { int4 v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __syncthreads_or(int v) { return v; }
"""

DRIVER = r"""
template <bool COMPACT, int VEC>
static void emu_block(const KvDsaTopkParams& p) {
    static DsaShared sm;
    static DsaLane<VEC> lanes[KV_THREADS];
    for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_begin<VEC>(p, lanes[t]); }
    const int chunks = dsa_chunks(p, VEC);
    for (int c = 0; c < chunks; ++c) {
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_chunk_load<COMPACT, VEC>(p, sm, lanes[t], c); }
        if (COMPACT)
            for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_chunk_store<VEC>(p, sm, lanes[t], c); }
    }
    if (COMPACT) {
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_compact_tail<VEC>(p, sm, lanes[t]); }
    } else {
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_count_partial<VEC>(sm, lanes[t]); }
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_count_write<VEC>(p, sm, lanes[t]); }
    }
    // kv_merge_record restated: every thread's record ORed / min-merged into its layer's (the
    // warp's vote and shuffles are not emulated).
    for (int t = 0; t < KV_THREADS; ++t) {
        const KvErr& e = lanes[t].err;
        if (!e.mask) continue;
        u64* rec = p.errors + 2 * (i64)lanes[t].layer;
        rec[0] |= e.mask;
        if (e.key < rec[1]) rec[1] = e.key;
    }
}

// The power-of-two forms, phase by phase. Plain: every thread's phase 1 (its record merged), then
// phase 2. Compacting: every thread's phase 1 (its record merged), then phase 2, then phase 3.
static void emu_merge(const KvDsaTopkParams& p, int layer, const KvErr& e) {
    if (!e.mask) return;
    u64* rec = p.errors + 2 * (i64)layer;
    rec[0] |= e.mask;
    if (e.key < rec[1]) rec[1] = e.key;
}

extern "C" void emu_dsa_pow2(const KvDsaTopkParams* pp, int compact, unsigned int grid) {
    static DsaPow2Shared<false> sm;
    static DsaPow2Plain plain[KV_THREADS];
    static DsaPow2Shared<true> smc;
    static DsaPow2Lane lanes[KV_THREADS];
    gridDim.x = grid; gridDim.y = 1; gridDim.z = 1;
    for (unsigned int x = 0; x < grid; ++x) {
        blockIdx.x = x; blockIdx.y = 0; blockIdx.z = 0;
        if (compact) {
            for (int t = 0; t < KV_THREADS; ++t) {
                threadIdx.x = t;
                dsa_pow2c_convert(*pp, smc, lanes[t]);
                int row = 0, layer = 0, token = 0;
                dsa_row32(*pp, row, layer, token);
                emu_merge(*pp, layer, lanes[t].err);
            }
            for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_pow2c_place(*pp, smc, lanes[t]); }
            for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_pow2c_store(*pp, smc, lanes[t]); }
            continue;
        }
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_pow2_begin(*pp, sm, plain[t]); }
        bool any = false;
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; any |= dsa_pow2_finish(*pp, sm, plain[t]); }
        if (!any) continue;
        for (int t = 0; t < KV_THREADS; ++t) {
            threadIdx.x = t;
            int layer = 0;
            const KvErr e = dsa_pow2_recount(*pp, sm, layer);
            emu_merge(*pp, layer, e);
        }
        for (int t = 0; t < KV_THREADS; ++t) { threadIdx.x = t; dsa_pow2_count(*pp, sm); }
    }
}

extern "C" void emu_dsa(const KvDsaTopkParams* pp, int compact, int vec, unsigned int grid) {
    gridDim.x = grid; gridDim.y = 1; gridDim.z = 1;
    for (unsigned int x = 0; x < grid; ++x) {
        blockIdx.x = x; blockIdx.y = 0; blockIdx.z = 0;
        if (compact) { if (vec == 4) emu_block<true, 4>(*pp); else emu_block<true, 1>(*pp); }
        else { if (vec == 4) emu_block<false, 4>(*pp); else emu_block<false, 1>(*pp); }
    }
}

// sizeof(KvDsaTopkParams), then each field's offset, in order (the ctypes mirror's check).
#define EMU_OFF(f) out[n++] = (long long)offsetof(KvDsaTopkParams, f);
extern "C" int emu_dsa_layout(long long* out) {
    int n = 0;
    out[n++] = (long long)sizeof(KvDsaTopkParams);
    EMU_OFF(topk) EMU_OFF(req_id) EMU_OFF(block_table) EMU_OFF(ctx) EMU_OFF(slots) EMU_OFF(counts)
    EMU_OFF(errors) EMU_OFF(table_stride) EMU_OFF(num_layers) EMU_OFF(num_tokens) EMU_OFF(k) EMU_OFF(rows)
    EMU_OFF(width) EMU_OFF(block_size) EMU_OFF(cp_size) EMU_OFF(cp_rank) EMU_OFF(cp_interleave) EMU_OFF(row_shift)
    EMU_OFF(block_shift) EMU_OFF(reserved)
    return n;
}

extern "C" void emu_dsa_baseline(const KvDsaTopkParams* pp, unsigned int gx, unsigned int gy) {
    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
    for (unsigned int y = 0; y < gy; ++y)
        for (unsigned int x = 0; x < gx; ++x) {
            blockIdx.x = x; blockIdx.y = y; blockIdx.z = 0;
            for (int t = 0; t < KV_DSA_BASELINE_COLUMNS; ++t) { threadIdx.x = t; kvaddr_dsa_topk_baseline(*pp); }
        }
}
"""


def _section(src: str, start: str, end: str | None = None) -> str:
    a = src.index(start)
    return src[a:] if end is None else src[a : src.index(end, a)]


def emulated_source() -> str:
    """The shared helpers (kernels/common.cuh), the conversion (kernels/dsa.cuh) and the baseline's
    section of kernels/baselines.cuh, behind the prelude, with the driver."""
    src = kernel_loader.source()
    common = _section(src, "// ---- kernels/common.cuh ----", "// ---- kernels/attention.cuh ----")
    dsa = kernel_loader.SOURCE_PATH.parent.joinpath("kernels", "dsa.cuh").read_text()
    base = kernel_loader.SOURCE_PATH.parent.joinpath("kernels", "baselines.cuh").read_text()
    # the section runs to the banner (a line of "=" signs) above the next section's title
    a = base.index("// ==== The engines' top-k -> slot conversion")
    baseline = base[a : base.rindex("\n// =====", a, base.index("\n// ==== ", a))]
    return PRELUDE + EXTRA_PRELUDE + common + dsa + baseline + DRIVER


@functools.cache
def library():
    """The compiled emulator (ctypes.CDLL), or None without a C++ compiler."""
    if CXX is None:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_dsa_emu_"))
    cpp = tmp / "emu.cpp"
    cpp.write_text(emulated_source())
    so = tmp / "emu.so"
    proc = subprocess.run(
        [CXX, "-std=c++14", "-O1", "-shared", "-fPIC", "-w", "-o", str(so), str(cpp)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError("the DSA kernel emulator did not compile:\n" + proc.stdout + proc.stderr)
    lib = ctypes.CDLL(str(so))
    lib.emu_dsa.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint]
    lib.emu_dsa_pow2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.emu_dsa_baseline.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    return lib


def run(name: str, params_address: int, gx: int, gy: int) -> None:
    """Emulate one launch of ``name`` (``dsa_topk_slots<C, V>``, ``dsa_topk_slots_pow2<C>`` or
    ``kvaddr_dsa_topk_baseline``) with its ``KvDsaTopkParams`` at ``params_address``."""
    lib = library()
    if name == "kvaddr_dsa_topk_baseline":
        lib.emu_dsa_baseline(params_address, gx, gy)
        return
    if name.startswith("dsa_topk_slots_pow2<"):
        lib.emu_dsa_pow2(params_address, int(name == "dsa_topk_slots_pow2<true>"), gx)
        return
    compact = name.startswith("dsa_topk_slots<true")
    vec = 4 if name.endswith("4>") else 1
    lib.emu_dsa(params_address, int(compact), vec, gx)
