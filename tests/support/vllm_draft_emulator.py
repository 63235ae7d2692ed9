"""Run the draft-addressing kernel (kernels/spec.cuh) on the CPU: its device helpers compiled by
the host C++ compiler, one thread after another, behind the fake CuPy of
tests/support/vllm_fake_cupy.py whose launches come here.

What is emulated: the kernel's per-thread helpers (vdraft_request_thread, vdraft_first_slot and the
attention rows: vdraft_attn_len, vdraft_attn_row, vdraft_attn_copy; the source text of
kernels.cu, unchanged), driven by a few lines of C++ that stand for the entry: the request threads, the
running sums of each (step, group) metadata block (the block scan's values, serially), the pad
of kv_indices and the merged error record. Not emulated: warp shuffles, barriers, atomics — the
GPU tests and compute-sanitizer cover those.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from kvaddr import kernel_loader
from tests.support import vllm_fake_cupy
from tests.support.vllm_emulator import CXX, PRELUDE, _section

DRIVER = r"""
extern "C" void emu_vllm_draft(const VllmDraftParams* pp) {
    const VllmDraftParams& p = *pp;
    VllmErr all; all.mask = 0; all.key = KV_NO_ERROR;
    auto merge = [&](const VllmErr& e) { all.mask |= e.mask; if (e.key < all.key) all.key = e.key; };
    const int M = p.max_num_reqs, G = p.num_groups, N = p.kv_indices_capacity;
    for (int blk = 0; blk < p.request_blocks; ++blk)  // the request blocks, thread by thread
        for (int tid = 0; tid < VDRAFT_THREADS; ++tid) {
            VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
            vdraft_request_thread(p, blk, tid, e);
            merge(e);
        }
    const int meta = p.attention_blocks ? p.steps * G : 0;  // (step, group) pairs: each block chunk, serially
    for (int m = 0; m < meta; ++m) {
        const int j = 1 + m / G, g = m - (j - 1) * G;
        const int B = vllm_pick(p.block_size, g);
        const bool fi = (p.attention & VLLM_ATTN_FLASHINFER) != 0;
        int cp = 0, cl = 0, ml = 0;
        for (int b = 0; b <= M; ++b) {
            VllmErr e; e.mask = 0; e.key = KV_NO_ERROR;
            long long r = 0;
            const int L = vdraft_attn_len(p, j, g, b, r);
            const int P = kv_pages(L, B);
            vdraft_attn_row(p, j, g, b, L, r, cp, cl, e);
            if (fi && b < p.num_reqs)
                for (int c = 0; c < P; ++c) vdraft_attn_copy(p, j, g, b, r, cp, c, e);
            cp = kv_sat_add_nn(cp, P);
            cl = kv_sat_add_nn(cl, L);
            ml = max(ml, L);
            merge(e);
        }
        if (fi)
            for (int e = cp; e < N; ++e) p.kv_indices[(long long)m * N + e] = -1;
        if (p.attention & VLLM_ATTN_VARLEN) p.max_seqlen_k[m] = ml;
    }
    if (p.token_blocks)
        for (int t = 0; t < p.max_tokens; ++t) vdraft_first_slot(p, t);
    if (all.mask) {
        p.errors[0] |= all.mask;
        if (all.key < p.errors[1]) p.errors[1] = all.key;
    }
}
"""


def emulated_source() -> str:
    """common.cuh, vllm.cuh's helpers (up to its attention metadata) and spec.cuh's per-thread
    helpers (up to the attention block entry), with the driver above."""
    src = kernel_loader.source()
    common = _section(src, "// ---- kernels/common.cuh ----", "// ---- kernels/attention.cuh ----")
    vllm = _section(src, "// ---- kernels/vllm.cuh ----", "// ---- attention metadata of the vLLM step")
    spec = _section(src, "// ---- kernels/spec.cuh ----", "// Block c of (step j, group g)")
    defs = "#define VLLM_ATTN_FLASHINFER 1\n#define VLLM_ATTN_VARLEN 2\n#define VLLM_ERR_KV_INDICES_CAPACITY 512\n"
    return PRELUDE + common + vllm + defs + spec + DRIVER


@functools.cache
def library():
    """The compiled emulator (ctypes.CDLL), or None without a C++ compiler."""
    if CXX is None:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="kvaddr_draft_emu_"))
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
        raise RuntimeError("the draft kernel emulator did not compile:\n" + proc.stdout + proc.stderr)
    lib = ctypes.CDLL(str(so))
    lib.emu_vllm_draft.argtypes = [ctypes.c_void_p]
    return lib


def install(monkeypatch) -> types.SimpleNamespace:
    """The fake CuPy with launches of the draft kernel emulated; ``launches`` records
    ``(name, grid, block, params copy)``."""
    from kvaddr.engines.vllm_draft import VllmDraftParams

    fake = vllm_fake_cupy.install(monkeypatch)
    by_ptr = {}
    get = kernel_loader.load_kernels

    def load(ks, device_id=None):
        out = get(ks, device_id)
        for k, f in out.items():
            by_ptr[f.ptr] = k
        return out

    monkeypatch.setattr(kernel_loader, "load_kernels", load)
    getf = kernel_loader.get_function

    def get_function(name, device_id=None):  # (the per-step baseline's kernels: each runs the whole emulation)
        f = getf(name, device_id)
        by_ptr[f.ptr] = name
        return f

    monkeypatch.setattr(kernel_loader, "get_function", get_function)

    def launch(fptr, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        arg0 = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        p = VllmDraftParams.from_buffer_copy(ctypes.string_at(arg0, ctypes.sizeof(VllmDraftParams)))
        fake.launches.append(dict(name=by_ptr[fptr], grid=(gx, gy, gz), block=bx, stream=stream, params=p))
        library().emu_vllm_draft(ctypes.addressof(p))

    sys.modules["cupy"].cuda.driver = types.SimpleNamespace(launchKernel=launch)
    return fake


def host(x):
    """A fake device array's NumPy copy (None as is)."""
    return None if x is None else np.array(x.a)
