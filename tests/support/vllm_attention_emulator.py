"""Run ``vllm_step<true>``'s attention metadata blocks (``vllm_attention_block`` in kvaddr/kernels/vllm.cuh,
the source text unchanged) on the CPU: each block's VLLM_THREADS threads are real host
threads, ``__syncthreads`` a block barrier, the warp shuffles an exchange between a warp's
32 threads behind a warp barrier, ``__shared__`` one static copy (blocks run one after
another). With tests/support/vllm_emulator.py (the step's roles), a fake-CuPy planner built with
``attention=`` runs its whole launch on the CPU (:func:`install`).

Not emulated: memory ordering between blocks (none is relied on: no block waits for another)
and timing; the GPU tests and compute-sanitizer cover those.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import tempfile
from pathlib import Path

from kvaddr import dispatch, kernel_loader
from tests.support import vllm_emulator

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
using std::max;
using std::min;
struct EmuIdx { unsigned int x, y, z; };
static thread_local EmuIdx threadIdx;
static EmuIdx blockIdx, gridDim;
static std::barrier<>* emu_block_bar;
static std::barrier<>* emu_warp_bar[8];
static unsigned long long emu_xchg[8][32];
static inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
static inline void __syncwarp() { emu_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
template <typename T>
static inline T emu_get(T v, int src) {
    const int w = (int)(threadIdx.x >> 5), l = (int)(threadIdx.x & 31);
    emu_xchg[w][l] = (unsigned long long)v;
    __syncwarp();
    const T r = (T)emu_xchg[w][src];
    __syncwarp();
    return r;
}
template <typename T>
static inline T __shfl_up_sync(unsigned, T v, int off) {
    const int l = (int)(threadIdx.x & 31);
    return emu_get(v, l >= off ? l - off : l);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int m) {
    return emu_get(v, (int)(threadIdx.x & 31) ^ m);
}
static inline int __reduce_max_sync(unsigned, int v) {
    for (int s = 16; s > 0; s >>= 1) v = max(v, __shfl_xor_sync(0u, v, s));
    return v;
}
// common.cuh's record merge (not called by the emulated blocks: the driver keeps the records).
static inline unsigned __reduce_or_sync(unsigned, unsigned v) { return v; }
static inline bool __any_sync(unsigned, bool v) { return v; }
template <typename T> static inline T atomicOr(T* p, T v) { T o = *p; *p |= v; return o; }
template <typename T> static inline T atomicMin(T* p, T v) { T o = *p; if (v < o) *p = v; return o; }
"""

DRIVER = r"""
extern "C" void emu_vllm_attn(const VllmStepParams* pp, int staged) {
    const VllmStepParams& p = *pp;
    const int blocks = p.num_groups * p.meta_blocks;
    std::barrier<> bb(VLLM_THREADS);
    emu_block_bar = &bb;
    std::vector<std::barrier<>*> wb;
    for (int w = 0; w < VLLM_WARPS; ++w) emu_warp_bar[w] = new std::barrier<>(32);
    for (int m = 0; m < blocks; ++m) {
        std::vector<std::thread> th;
        for (int t = 0; t < VLLM_THREADS; ++t)
            th.emplace_back([&p, t, m, staged] {
                threadIdx.x = (unsigned int)t;
                VllmErr err;
                err.mask = 0;
                err.key = KV_NO_ERROR;
                if (staged) vllm_attention_block<true>(p, m, err);
                else vllm_attention_block<false>(p, m, err);
                for (int s = 16; s > 0; s >>= 1) {  // the kernel's per-warp record
                    err.mask |= __shfl_xor_sync(0u, err.mask, s);
                    const unsigned long long k = __shfl_xor_sync(0u, err.key, s);
                    err.key = k < err.key ? k : err.key;
                }
                if ((t & 31) == 0 && err.mask) {  // sticky: only a warp with an error merges
                    const long long w = (long long)(p.token_blocks + p.request_blocks + m) * VLLM_WARPS + (t >> 5);
                    p.errors[2 * w] |= (unsigned long long)err.mask;
                    if (err.key < p.errors[2 * w + 1]) p.errors[2 * w + 1] = err.key;
                }
            });
        for (auto& x : th) x.join();
    }
    for (int w = 0; w < VLLM_WARPS; ++w) delete emu_warp_bar[w];
}
"""


def emulated_source() -> str:
    """The vLLM helpers (as vllm_emulator takes them) and the metadata section of kernels.cu."""
    src = kernel_loader.source()
    body = vllm_emulator.emulated_source()
    body = body[len(vllm_emulator.PRELUDE) : len(body) - len(vllm_emulator.DRIVER)]
    a = src.index("// ---- attention metadata of the vLLM step")
    b = src.index("// The vLLM step: <<<", a)  # up to the kernel entry's comment
    return PRELUDE + body + src[a:b] + DRIVER


@functools.cache
def cxx20() -> bool:
    """Whether the host compiler builds C++20 with std::barrier (the emulator's block barrier)."""
    if vllm_emulator.CXX is None:
        return False
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_vattn_probe_"))
    (tmp / "p.cpp").write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    proc = subprocess.run(
        [vllm_emulator.CXX, "-std=c++20", "-pthread", "-o", str(tmp / "p"), str(tmp / "p.cpp")],
        capture_output=True,
        timeout=120,
    )
    return proc.returncode == 0


@functools.cache
def library():
    """The compiled emulator (ctypes.CDLL), or None without a C++20 compiler."""
    if not cxx20():
        return None
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_vattn_emu_"))
    cpp = tmp / "emu.cpp"
    cpp.write_text(emulated_source())
    so = tmp / "emu.so"
    proc = subprocess.run(
        [vllm_emulator.CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(so), str(cpp)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError("the attention metadata emulator did not compile:\n" + proc.stdout + proc.stderr)
    lib = ctypes.CDLL(str(so))
    lib.emu_vllm_attn.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def on_launch(name: str, address: int, gx: int, gy: int) -> None:
    """vllm_fake_cupy's launch callback: the step's roles (vllm_emulator), then the metadata blocks."""
    staged = dispatch.vllm_staged_kernels(True)[1]
    if name in (dispatch.vllm_kernel(True), staged):
        step = dispatch.vllm_staged_kernels(False)[1] if name == staged else dispatch.vllm_kernel(False)
        vllm_emulator.run(step, address, gx, gy)
        library().emu_vllm_attn(address, int(name == staged))
    else:
        vllm_emulator.run(name, address, gx, gy)
