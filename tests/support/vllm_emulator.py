"""Run the vLLM sections of kernels.cu on the CPU: its device code compiled by the host
C++ compiler, one thread after another, behind a fake CuPy whose launches go here.

What is emulated: the device helpers of ``vllm_step<false>`` (token guess and write,
request row, gather pair; with its DSA row, vllm_dsa.cuh's token helpers; the source text of
kernels.cu, unchanged) driven by a few lines
of C++ that stand for the kernel's entry (roles, rows to visit, the sticky error record),
and the three-launch kernels whole (their threads run in reverse order, so thread 0's
end-of-block write comes last, as after their barrier). Not emulated: warp shuffles,
atomics, memory ordering — the GPU tests and compute-sanitizer cover those.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvaddr import dispatch, kernel_loader

CXX = shutil.which("g++") or shutil.which("c++")

PRELUDE = r"""
#include <cstdint>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
struct EmuIdx { unsigned int x, y, z; };
static EmuIdx threadIdx, blockIdx, gridDim;
static inline void __syncwarp() {}
static inline void __syncthreads() {}
// common.cuh's warp-level helpers, which the emulated code does not call, need these to compile.
template <typename T> static inline T __shfl_up_sync(unsigned, T v, int) { return v; }
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
static inline unsigned __reduce_or_sync(unsigned, unsigned v) { return v; }
static inline bool __any_sync(unsigned, bool v) { return v; }
#define EMU_MINMAX(T) \
    static inline T min(T a, T b) { return b < a ? b : a; } \
    static inline T max(T a, T b) { return a < b ? b : a; }
EMU_MINMAX(int)
EMU_MINMAX(unsigned int)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
template <typename T> static inline T atomicOr(T* p, T v) { T o = *p; *p |= v; return o; }
template <typename T> static inline T atomicMin(T* p, T v) { T o = *p; if (v < o) *p = v; return o; }
"""

DRIVER = r"""
static inline void emu_merge(VllmErr& all, const VllmErr& e) {
    all.mask |= e.mask;
    if (e.key < all.key) all.key = e.key;
}

// vllm_step<false>: its device helpers (token guess and write, request row, gather
// pair), driven as the entry drives them. The entry's warp-level code is re-stated here,
// not emulated: the staged query_start_loc (the same values: the search runs on the
// global array), the spare rows' zeroing (one row after another), the per-warp records
// (the launch's merged errors go into record 0, ORed and min-merged as the kernel's atomics
// do: sticky; a clean launch writes no record).
extern "C" void emu_vllm_step(const VllmStepParams* pp, unsigned int grid) {
    const VllmStepParams& p = *pp;
    VllmErr all; all.mask = 0; all.key = KV_NO_ERROR;
    const int n = p.num_reqs;
    for (int t = 0; t < p.max_tokens; ++t) {
        threadIdx.x = t % VLLM_THREADS;
        VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
        int b = 0, q0 = 0, q1 = 0, num_tokens = 0;
        long long r = 0;
        if (n > 0 && vllm_token_guess(p, t, b, q0, q1, r, num_tokens)) {
            b = vllm_owner_search(p.query_start_loc, n, t);
            q0 = p.query_start_loc[b];
            q1 = p.query_start_loc[b + 1];
            r = vllm_row_of(p, b);
        }
        if (p.cp_size > 1) vllm_token_write<true>(p, t, b, q0, q1, r, num_tokens, e);
        else vllm_token_write<false>(p, t, b, q0, q1, r, num_tokens, e);
        emu_merge(all, e);
    }
    for (int b = 0; b < p.max_num_reqs; ++b) {
        threadIdx.x = b % VLLM_THREADS;
        VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
        vllm_request_row(p, b, e);
        emu_merge(all, e);
    }
    for (int g = 0; g < p.num_groups; ++g)
        for (int b = n; b < p.max_num_reqs; ++b) {
            const int fill = p.row_fill[g][b];
            for (int j = 0; j < fill; ++j) p.gathered[g][(long long)b * p.gathered_stride[g] + j] = 0;
            if (fill > 0) p.row_fill[g][b] = 0;
        }
    for (int g = 0; g < p.num_groups; ++g)
        for (int b = 0; b < n; ++b)
            for (int sub = p.pair_lanes - 1; sub >= 0; --sub) {  // lane 0 (which stores the fill) last
                threadIdx.x = sub;
                vllm_gather_row(p, true, g, b, sub, p.pair_lanes);
            }
    if (all.mask) {
        p.errors[0] |= all.mask;
        if (all.key < p.errors[1]) p.errors[1] = all.key;
    }
    (void)grid;
}

// vllm_step<false, true>'s second grid row: its device helpers (vllm_dsa.cuh: locate, prefill
// length, token) driven as vllm_dsa_block drives them, its block scan re-stated as one serial
// prefix over the batch (the same saturating sums and ordinals).
extern "C" void emu_vllm_dsa(const VllmStepParams* pp) {
    const VllmStepParams& p = *pp;
    const int n = p.num_reqs;
    int* ks_of = new int[n > 0 ? n : 1];
    int total = 0, cnt = 0;
    for (int b = 0; b < n; ++b) {
        const int len = vllm_dsa_prefill_len(p, b);
        ks_of[b] = len >= 0 ? total : -1;
        if (len >= 0) {
            p.dsa_cu_seq_lens[cnt++] = total;
            total = kv_sat_add_nn(total, len);
        }
    }
    for (int i = cnt; i <= p.max_num_reqs; ++i) p.dsa_cu_seq_lens[i] = total;
    for (int t = 0; t < p.max_tokens; ++t) {
        int b = 0;
        bool valid = false;
        long long pos = 0, slot = -1;
        vllm_dsa_locate(p, t, b, valid, pos, slot);
        vllm_dsa_token(p, t, valid, pos, b, valid ? ks_of[b] : -1, slot);
    }
    delete[] ks_of;
}

typedef void (*emu_kernel)(const VllmStepParams);

static void emu_grid(emu_kernel k, const VllmStepParams* pp, unsigned int gx, unsigned int gy) {
    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
    for (unsigned int y = 0; y < gy; ++y)
        for (unsigned int x = 0; x < gx; ++x) {
            blockIdx.x = x; blockIdx.y = y; blockIdx.z = 0;
            for (int t = VLLM3_THREADS - 1; t >= 0; --t) {
                threadIdx.x = (unsigned int)t;
                k(*pp);
            }
        }
}

extern "C" void emu_vllm3(int which, const VllmStepParams* pp, unsigned int gx, unsigned int gy) {
    emu_grid(which == 0 ? kvaddr_vllm3_prepare : which == 1 ? kvaddr_vllm3_gather : kvaddr_vllm3_slots, pp, gx, gy);
}
"""


def _section(src: str, start: str, end: str) -> str:
    a = src.index(start)
    return src[a : src.index(end, a)]


def emulated_source() -> str:
    """The vLLM step's device helpers (kernels/vllm.cuh up to its attention metadata) with the
    shared helpers they use (kernels/common.cuh), and the three-launch baseline's kernels
    (kernels/baselines.cuh), less every kernel entry's warp-level code."""
    src = kernel_loader.source()
    common = _section(src, "// ---- kernels/common.cuh ----", "// ---- kernels/attention.cuh ----")
    vllm = _section(src, "// ---- kernels/vllm.cuh ----", "// ---- attention metadata of the vLLM step")
    dsa = _section(src, "// ---- kernels/vllm_dsa.cuh ----", "// ---- the DSA block of the vLLM step")
    base = kernel_loader.SOURCE_PATH.parent.joinpath("kernels", "baselines.cuh").read_text()
    three = (
        _section(base, "// ==== vLLM's three-launch design", "\n#endif")
        if "#endif" in base[base.index("// ==== vLLM's three-launch design") :]
        else base[base.index("// ==== vLLM's three-launch design") :]
    )
    # return inside a void kernel called once per emulated thread is fine as is
    return PRELUDE + common + vllm + dsa + three + DRIVER


@functools.cache
def library():
    """The compiled emulator (ctypes.CDLL), or None without a C++ compiler."""
    if CXX is None:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_vllm_emu_"))
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
        raise RuntimeError("the vLLM kernel emulator did not compile:\n" + proc.stdout + proc.stderr)
    lib = ctypes.CDLL(str(so))
    lib.emu_vllm_step.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.emu_vllm_dsa.argtypes = [ctypes.c_void_p]
    lib.emu_vllm3.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    return lib


def run(name: str, params_address: int, gx: int, gy: int) -> None:
    """Emulate one launch of kernel ``name`` (``vllm_step<false>`` or a three-launch baseline's)
    with its parameter struct at ``params_address``."""
    lib = library()
    if name == dispatch.vllm_kernel(False):
        lib.emu_vllm_step(params_address, gx)
    elif name == dispatch.vllm_kernel(False, dsa=True):
        lib.emu_vllm_step(params_address, gx)
        if gy == 2:  # the DSA row
            lib.emu_vllm_dsa(params_address)
    else:
        which = {"kvaddr_vllm3_prepare": 0, "kvaddr_vllm3_gather": 1, "kvaddr_vllm3_slots": 2}[name]
        lib.emu_vllm3(which, params_address, gx, gy)
