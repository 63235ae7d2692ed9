"""A line-by-line Python model of the attention metadata blocks of ``step_multiblock``
(:func:`run_meta_blocks`), and the helpers the models of the other attention kernels share
(tests/support/meta_small_model.py, tests/support/meta_wide_model.py).

It reads the launch's ``KvStepParams`` (kernel_loader.StepParams) exactly as the kernel
does, from host memory the pointers address (the fake device arrays of
tests/unit/test_planner_attention.py are NumPy buffers), and writes the metadata there.
So the planner's sizing (num_meta, meta_per_cache, meta_entries, attn_stride, the
pointers and the error-record slots) and the kernel's algorithm (rounds carried from one
to the next, per-block request and entry ranges, the pad, the error keys)
are checked against the NumPy reference on the CPU. The round size is a parameter so that
small batches run several rounds.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvaddr.errors import error_key

IMAX = 2**31 - 1
FLASHINFER, VARLEN, PAGE_TABLE = 1, 2, 4


def _sat(a, b):
    return min(a + b, IMAX)


def _pages(L, B):
    return -(-L // B)


def _view(ptr, count, dtype=np.int32):
    """A NumPy view of ``count`` elements at host address ``ptr``."""
    if count == 0:
        return np.zeros(0, dtype)
    buf = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype)


def run_meta_blocks(P, round_size: int = 256) -> list:
    """The metadata blocks of ``step_multiblock`` (request-parallel), line by line: block (g, k) owns requests [k rq, (k + 1) rq), rq = ceil(bsz / meta_per_cache);
    pass 1 (sums before r0, totals, maxima over every request), its requests ``round_size``
    at a time (KV_THREADS in the kernel: a parameter so that small batches run several
    rounds) with the carries, the row copy below N, the pad of its fixed entry range, entry
    bsz from block k = 0 and the maxima from block 0. Returns the ``(slot, mask, key)`` error
    record of each block (slot: the block's index in the grid; the smallest key of the block)."""
    bsz, flags = P.bsz, P.attention
    dec = _view(P.seq_lens_decoder, bsz)
    q = _view(P.seq_lens_this_time, bsz)
    fi = bool(flags & FLASHINFER)
    N = P.kv_indices_capacity
    G = P.num_caches
    num_chunks = -(-P.capacity // 256)
    records = []
    for m in range(P.num_meta):
        g, k = divmod(m, P.meta_per_cache)
        B, W, stride = P.block_size[g], P.max_blocks[g], P.table_stride[g]
        rows = bool(flags & (FLASHINFER | PAGE_TABLE)) and G > 0
        varlen = bool(flags & VARLEN) and g == 0
        table = _view(P.block_tables[g], (bsz - 1) * stride + W if bsz and rows else 0)
        indptr = _view(P.kv_indptr + 4 * g * P.attn_stride, bsz + 1) if fi else None
        last = _view(P.kv_last_page_len + 4 * g * P.attn_stride, bsz) if fi else None
        idx = _view(P.kv_indices + 4 * g * N, N) if fi else None
        cuk = _view(P.cu_seqlens_k, bsz + 1) if varlen else None
        rq = -(-bsz // P.meta_per_cache)
        r0 = min(k * rq, bsz)
        r1 = min(r0 + rq, bsz)
        keys, mask = [], 0

        def lengths(b, B=B):
            d, n = int(dec[b]), int(q[b])
            bad = d < 0 or n < 0
            nn, L = (0, 0) if bad else (n, _sat(d, n))
            return nn, L, _pages(L, B)

        # 1. sums before r0, totals, maxima
        cq = cl = cp = tl = tp = mq = ml = 0
        for b in range(bsz):
            nn, L, P_ = lengths(b)
            if b < r0:
                cq, cl, cp = _sat(cq, nn), _sat(cl, L), _sat(cp, P_)
            tl, tp = _sat(tl, L), _sat(tp, P_)
            mq, ml = max(mq, nn), max(ml, L)
        # 5. entry bsz and the maxima
        if k == 0:
            if fi:
                indptr[bsz] = tp
            if varlen:
                cuk[bsz] = tl
        if varlen and m == 0:
            mx = _view(P.max_seqlen, 2)
            mx[0], mx[1] = mq, ml
        # 2. + 3. the block's requests, round by round
        for c0 in range(r0, r1, round_size):
            staged = []
            for b in range(c0, min(c0 + round_size, r1)):
                nn, L, P_ = lengths(b)
                xq, xl, xp = cq, cl, cp
                if fi:
                    indptr[b] = xp
                    last[b] = (L - 1) % B + 1 if L > 0 else 0
                    if xp <= N < _sat(xp, P_):
                        mask |= 16
                        keys.append(error_key(xq, b, g, 16))
                if rows and P_ > W:
                    mask |= 1
                    keys.append(error_key(xq, b, g, 1))
                if varlen:
                    cuk[b] = xl
                staged.append((b, xp, P_, xq))
                cq, cl, cp = _sat(cq, nn), _sat(cl, L), _sat(cp, P_)
            if not fi:
                continue
            for b, s0, P_, xq in staged:
                end = min(P_, N - s0) if s0 < N else 0
                for col in range(end):
                    v = -1
                    if col < W:
                        v = int(table[b * stride + col])
                        if v < 0:
                            mask |= 2
                            keys.append(error_key(xq, b, g, 2))
                    idx[s0 + col] = v if v >= 0 else -1
        # 4. the pad of the block's fixed entry range
        if fi:
            e_lo = min(k * P.meta_entries, N)
            e_hi = min(e_lo + P.meta_entries, N)
            idx[max(e_lo, tp) : e_hi] = -1
        records.append((num_chunks + P.max_tiles + m, mask, min(keys) if keys else (1 << 64) - 1))
    return records
