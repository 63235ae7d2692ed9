"""Run the vLLM sections of kernels.cu on the CPU: its device code compiled by the host
C++ compiler, one thread after another, behind a fake CuPy whose launches go here.

What is emulated: the device helpers of ``vllm_step<false>`` (the batch's shared-memory copy,
token guess and write, request row, gather pair; the source text of kernels.cu, unchanged)
driven by a few lines of C++ that stand for the kernel's entry (roles, rows to visit, the
sticky error record);
with DSA (``vllm_step<false, true>``), the token writes' DSA outputs and vllm_dsa.cuh's
helpers driven as its DSA blocks drive them, checking that each element of each DSA output
is written by exactly one of the two grid rows; and the three-launch kernels whole (their
threads run in reverse order, so thread 0's end-of-block write comes last, as after their
barrier). Not emulated: warp shuffles, block votes and scans (re-stated as loops),
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

// vllm_step<false>: its device helpers (the batch's shared-memory copy, token guess and
// write, request row, gather pair), driven as the entry drives them. The entry's block-level
// code is re-stated here, not emulated: each token block's copy of the batch (every thread's
// part, then each token's owner from the copy, as after the barrier), the spare rows' zeroing (one
// row after another), the per-warp records (the launch's merged errors go into record 0, ORed
// and min-merged as the kernel's atomics do: sticky; a clean launch writes no record). DSA
// (vllm_step<false, true>): the token writes are vllm_token_write<DCP, true>'s, which write the
// token's DSA outputs too.
static int emu_sq[VLLM_QSL_SMEM], emu_srow[VLLM_QSL_SMEM];

template <bool DSA, bool STAGED>
static void emu_step(const VllmStepParams& p) {
    VllmErr all; all.mask = 0; all.key = KV_NO_ERROR;
    const int n = p.num_reqs;
    const bool copy = n >= 1 && n + 1 <= VLLM_QSL_SMEM;
    for (int t0 = 0; t0 < p.max_tokens; t0 += VLLM_THREADS) {
        int last = 0;
        if (copy) {  // every thread's part of the block's copy
            last = p.query_start_loc[n];
            for (int tid = 0; tid < VLLM_THREADS; ++tid) {
                threadIdx.x = tid;
                vllm_stage_batch(p, emu_sq, emu_srow, last);
            }
        }
        for (int t = t0; t < p.max_tokens && t < t0 + VLLM_THREADS; ++t) {
            threadIdx.x = t - t0;
            VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
            int b = 0, q0 = 0, q1 = 0, num_tokens = 0;
            long long r = 0;
            if (copy) {
                vllm_token_owner_copied(p, emu_sq, emu_srow, t, last, b, q0, q1, r, num_tokens);
            } else if (n > 0 && vllm_token_guess(p, t, b, q0, q1, r, num_tokens)) {
                b = vllm_owner_search(p.query_start_loc, n, t);
                q0 = p.query_start_loc[b];
                q1 = p.query_start_loc[b + 1];
                r = vllm_row_of(p, b);
            }
            if (p.cp_size > 1) vllm_token_write<true, DSA, STAGED>(p, t, b, q0, q1, r, num_tokens, e);
            else vllm_token_write<false, DSA, STAGED>(p, t, b, q0, q1, r, num_tokens, e);
            emu_merge(all, e);
        }
    }
    for (int b = 0; b < p.max_num_reqs; ++b) {
        threadIdx.x = b % VLLM_THREADS;
        VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
        vllm_request_row<STAGED>(p, b, e);
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
                vllm_gather_row<STAGED>(p, true, g, b, sub, p.pair_lanes);
            }
    if (all.mask) {
        p.errors[0] |= all.mask;
        if (all.key < p.errors[1]) p.errors[1] = all.key;
    }
}

template <bool DSA>
static void emu_step_as(const VllmStepParams& p, int staged) {
    if (staged) emu_step<DSA, true>(p);
    else emu_step<DSA, false>(p);
}

extern "C" void emu_vllm_step(const VllmStepParams* pp, unsigned int grid, int staged) {
    emu_step_as<false>(*pp, staged);
    (void)grid;
}

// vllm_stage_num_blocks: every group's rows [0, max_num_reqs) of num_blocks_src into num_blocks
// (the kernel's copy, a thread per row, restated as a loop).
extern "C" void emu_vllm_stage(const VllmStepParams* pp) {
    const VllmStepParams& p = *pp;
    for (int g = 0; g < p.num_groups; ++g)
        for (int i = 0; i < p.max_num_reqs; ++i) const_cast<int*>(p.num_blocks[g])[i] = p.num_blocks_src[g][i];
}

// vllm_step<false, true>'s second grid row: its device helpers (vllm_dsa.cuh: load, votes,
// owner, prefill length, prefill token) driven as vllm_dsa_block drives them, block by block,
// its block votes re-stated as loops over the block's threads and its block scan as one serial
// prefix over the batch (the same saturating sums and ordinals).
static void emu_dsa_row(const VllmStepParams& p, unsigned int gx) {
    const int n = p.num_reqs, M = p.max_num_reqs;
    // 1. the vote (every block's is the same: the first tile's requests and the rest's)
    bool any = false;
    for (int tid = 0; tid < VLLM_THREADS; ++tid) {
        int q[VLLM_DSA_R + 1], r[VLLM_DSA_R];
        vllm_dsa_load(p, tid * VLLM_DSA_R, q, r);
        any = vllm_dsa_vote_rest(p, tid) || vllm_dsa_long(p, tid * VLLM_DSA_R, q) || any;
    }
    // the scan: each prefill's ks and num_computed_tokens (ks -1: not a prefill), cu_seq_lens
    int* ks_of = new int[n > 0 ? n : 1];
    int* nct_of = new int[n > 0 ? n : 1];
    int* cu = new int[M + 1];
    int total = 0, cnt = 0;
    for (int b0 = 0; b0 < n; b0 += VLLM_DSA_R) {
        int q[VLLM_DSA_R + 1], r[VLLM_DSA_R];
        vllm_dsa_load(p, b0, q, r);
        for (int u = 0; u < VLLM_DSA_R && b0 + u < n; ++u) {
            const int b = b0 + u;
            const int nct = r[u] >= 0 ? p.num_computed_tokens[r[u]] : 0;
            const int len = vllm_dsa_prefill(p, q[u], q[u + 1], r[u], nct);
            ks_of[b] = len >= 0 ? total : -1;
            nct_of[b] = nct;
            if (len >= 0) {
                if (cnt <= M) cu[cnt] = total;
                ++cnt;
                total = kv_sat_add_nn(total, len);
            }
        }
    }
    for (int i = cnt; i <= M; ++i) cu[i] = total;
    for (int k = 0; k < (int)gx && k < p.token_blocks; ++k) {
        blockIdx.x = k;
        if (!any) {  // 2. a decode step
            if (k == 0)
                for (int i = 0; i <= M; ++i) p.dsa_cu_seq_lens[i] = 0;
            continue;
        }
        int bs[VLLM_THREADS], q0s[VLLM_THREADS];
        bool cands[VLLM_THREADS], some = false;
        for (int tid = 0; tid < VLLM_THREADS; ++tid) {
            threadIdx.x = tid;
            cands[tid] = vllm_dsa_owner(p, p.query_start_loc, k * VLLM_THREADS + tid, bs[tid], q0s[tid]);
            some = some || cands[tid];
        }
        if (!some && k != 0) continue;
        if (k == 0)
            for (int i = 0; i <= M; ++i) p.dsa_cu_seq_lens[i] = cu[i];
        for (int tid = 0; tid < VLLM_THREADS; ++tid)  // 3. the candidates whose owner is a prefill
            if (cands[tid] && ks_of[bs[tid]] >= 0)
                vllm_dsa_prefill_token(p, k * VLLM_THREADS + tid, q0s[tid], ks_of[bs[tid]], nct_of[bs[tid]]);
    }
    delete[] ks_of;
    delete[] nct_of;
    delete[] cu;
}

// vllm_step<false, true> whole (both rows), checking that every element of every DSA output is
// written by exactly one of them: the outputs are set to a value no writer stores (-7) first; the
// token row must write every offset, ctx and req_id and, per token, ks and ke both or neither; the
// DSA row must write cu_seq_lens whole, the ks and ke the token row left, no others, and none of
// the token row's other outputs. Returns 0, or the number of the broken rule.
extern "C" int emu_vllm_step_dsa(const VllmStepParams* pp, unsigned int gx, int staged) {
    const VllmStepParams& p = *pp;
    const int T = p.max_tokens, M = p.max_num_reqs, U = -7;
    for (int t = 0; t < T; ++t) {
        p.dsa_value_offsets[t] = p.dsa_scale_offsets[t] = U;
        p.dsa_ctx[t] = p.dsa_ks[t] = p.dsa_ke[t] = p.dsa_req_id[t] = U;
    }
    for (int i = 0; i <= M; ++i) p.dsa_cu_seq_lens[i] = U;
    emu_step_as<true>(p, staged);
    int rc = 0;
    unsigned char* tok = new unsigned char[T > 0 ? T : 1];
    int* saved = new int[4 * (T > 0 ? T : 1)];
    for (int t = 0; t < T && !rc; ++t) {
        if (p.dsa_value_offsets[t] == U || p.dsa_scale_offsets[t] == U || p.dsa_ctx[t] == U || p.dsa_req_id[t] == U)
            rc = 1;
        tok[t] = p.dsa_ks[t] != U;
        if ((p.dsa_ke[t] != U) != (tok[t] != 0)) rc = 2;
        saved[4 * t] = p.dsa_ks[t];
        saved[4 * t + 1] = p.dsa_ke[t];
        saved[4 * t + 2] = p.dsa_ctx[t];
        saved[4 * t + 3] = p.dsa_req_id[t];
        p.dsa_ks[t] = p.dsa_ke[t] = U;
    }
    for (int i = 0; i <= M && !rc; ++i)
        if (p.dsa_cu_seq_lens[i] != U) rc = 3;
    long long* off = new long long[2 * (T > 0 ? T : 1)];
    for (int t = 0; t < T; ++t) {
        off[2 * t] = p.dsa_value_offsets[t];
        off[2 * t + 1] = p.dsa_scale_offsets[t];
    }
    if (!rc) emu_dsa_row(p, gx);
    for (int t = 0; t < T && !rc; ++t) {
        const bool dsa = p.dsa_ks[t] != U;
        if (dsa == (tok[t] != 0) || (p.dsa_ke[t] != U) != dsa) rc = 4;
        if (off[2 * t] != p.dsa_value_offsets[t] || off[2 * t + 1] != p.dsa_scale_offsets[t] ||
            saved[4 * t + 2] != p.dsa_ctx[t] || saved[4 * t + 3] != p.dsa_req_id[t])
            rc = 5;
        if (tok[t]) {
            p.dsa_ks[t] = saved[4 * t];
            p.dsa_ke[t] = saved[4 * t + 1];
        }
    }
    for (int i = 0; i <= M && !rc; ++i)
        if (p.dsa_cu_seq_lens[i] == U) rc = 6;
    delete[] tok;
    delete[] saved;
    delete[] off;
    return rc;
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
    lib.emu_vllm_step.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    lib.emu_vllm_stage.argtypes = [ctypes.c_void_p]
    lib.emu_vllm_step_dsa.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    lib.emu_vllm_step_dsa.restype = ctypes.c_int
    lib.emu_vllm3.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    return lib


_DSA_RULES = {
    1: "the token row left an offset, ctx or req_id unwritten",
    2: "the token row wrote one of a token's ks and ke",
    3: "the token row wrote cu_seq_lens",
    4: "a token's ks and ke are written by both rows, by neither, or split between them",
    5: "the DSA row wrote an offset, ctx or req_id",
    6: "the DSA row left cu_seq_lens unwritten",
}


def run(name: str, params_address: int, gx: int, gy: int) -> None:
    """Emulate one launch of kernel ``name`` (``vllm_step<false>`` or a three-launch baseline's)
    with its parameter struct at ``params_address``."""
    lib = library()
    staged_step = dispatch.vllm_staged_kernels(False)[1]
    staged_dsa = dispatch.vllm_staged_kernels(False, dsa=True)[1]
    if name.startswith("vllm_stage_num_blocks<"):
        lib.emu_vllm_stage(params_address)
    elif name in (dispatch.vllm_kernel(False), staged_step):
        lib.emu_vllm_step(params_address, gx, int(name == staged_step))
    elif name in (dispatch.vllm_kernel(False, dsa=True), staged_dsa):
        assert gy == 2, "the DSA step launches two grid rows"
        rc = lib.emu_vllm_step_dsa(params_address, gx, int(name == staged_dsa))
        assert rc == 0, f"the DSA outputs are not each written by exactly one thread: {_DSA_RULES[rc]}"
    else:
        which = {"kvaddr_vllm3_prepare": 0, "kvaddr_vllm3_gather": 1, "kvaddr_vllm3_slots": 2}[name]
        lib.emu_vllm3(which, params_address, gx, gy)
