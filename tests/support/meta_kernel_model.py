"""A line-by-line Python model of kernels.cu's attention metadata blocks: the first version
(kv_meta_block, :func:`run_meta_blocks`), the request-parallel one (kv_meta_block2,
:func:`run_meta_blocks2`) and the one-round one (kv_meta_block3, :func:`run_meta_blocks3`).

It reads the launch's ``KvStepParams`` (kernel_loader.StepParams) exactly as the kernel
does, from host memory the pointers address (the fake device arrays of
tests/unit/test_planner_attention.py are NumPy buffers), and writes the metadata there.
So the planner's sizing (num_meta, meta_per_cache, meta_entries, attn_stride, the
pointers and the error-record slots) and the kernel's algorithm (tiles carried from one
to the next, per-block request and entry ranges, the early stop, the pad, the error keys)
are checked against the NumPy reference on the CPU. Tile size is a parameter so that
small batches run the multi-tile path.
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


def run_meta_blocks(P, tile: int = 4096) -> list:
    """Run every metadata block of a launch with parameters ``P``; returns the
    (slot, mask, key) error record of each block (the smallest key of the block)."""
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
        rq = -(-(bsz + 1) // P.meta_per_cache)
        r_lo, r_hi = k * rq, min(k * rq + rq, bsz + 1)
        e_lo = min(k * P.meta_entries, N) if fi else 0
        e_hi = min(e_lo + P.meta_entries, N) if fi else 0
        keys, mask = [], 0
        cq = cl = cp = 0
        mq = ml = 0
        base = 0
        while base < bsz:
            count = min(tile, bsz - base)
            sq, spg = [], []
            for i in range(count):
                d, n = int(dec[base + i]), int(q[base + i])
                bad = d < 0 or n < 0
                nn, L = (0, 0) if bad else (n, _sat(d, n))
                sq.append(nn)
                spg.append(L)
                mq, ml = max(mq, nn), max(ml, L)
            rq_, rl, rp = cq, cl, cp
            tq = tl = tp = 0
            for i in range(count):
                b, nn, L = base + i, sq[i], spg[i]
                P_ = _pages(L, B)
                nxt = _sat(rp, P_)
                if r_lo <= b < r_hi:
                    if fi:
                        indptr[b] = rp
                        last[b] = (L - 1) % B + 1 if L > 0 else 0
                        if rp <= N < nxt:
                            mask |= 16
                            keys.append(error_key(rq_, b, g, 16))
                    if rows and P_ > W:
                        mask |= 1
                        keys.append(error_key(rq_, b, g, 1))
                    if varlen:
                        cuk[b] = rl
                sq[i], spg[i] = rq_, rp
                rq_, rl, rp = _sat(rq_, nn), _sat(rl, L), nxt
                tq, tl, tp = _sat(tq, nn), _sat(tl, L), _sat(tp, P_)
            t0 = cp
            cq, cl, cp = _sat(cq, tq), _sat(cl, tl), _sat(cp, tp)
            spg.append(cp)
            if fi:
                kk = 0
                for e in range(max(e_lo, t0), min(e_hi, cp)):
                    if spg[kk + 1] <= e:
                        lo, hi = kk + 1, count
                        while hi - lo > 1:
                            mid = (lo + hi) // 2
                            lo, hi = (mid, hi) if spg[mid] <= e else (lo, mid)
                        kk = lo
                    col = e - spg[kk]
                    v = -1
                    if col < W:
                        v = int(table[(base + kk) * stride + col])
                        if v < 0:
                            mask |= 2
                            keys.append(error_key(sq[kk], base + kk, g, 2))
                    idx[e] = v if v >= 0 else -1
            if not (bool(flags & VARLEN) and m == 0) and r_hi <= base + count and cp >= e_hi:
                break
            base += tile
        if r_lo <= bsz < r_hi:
            if fi:
                indptr[bsz] = cp
            if varlen:
                cuk[bsz] = cl
        if fi:
            idx[max(e_lo, cp) : e_hi] = -1
        if varlen and m == 0:
            mx = _view(P.max_seqlen, 2)
            mx[0], mx[1] = mq, ml
        records.append((num_chunks + P.max_tiles + m, mask, min(keys) if keys else (1 << 64) - 1))
    return records


def run_meta_blocks2(P, round_size: int = 256) -> list:
    """The request-parallel metadata blocks (kv_meta_block2, ``P.meta_impl`` 1 or 2), line by
    line: block (g, k) owns requests [k rq, (k + 1) rq), rq = ceil(bsz / meta_per_cache);
    pass 1 (sums before r0, totals, maxima over every request), its requests ``round_size``
    at a time (KV_THREADS in the kernel: a parameter so that small batches run several
    rounds) with the carries, the row copy below N, the pad of its fixed entry range, entry
    bsz from block k = 0 and the maxima from block 0. Returns the error records as
    :func:`run_meta_blocks`."""
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


def run_meta_blocks3(P, threads: int = 256, pre: int = 16) -> list:
    """kv_meta_block3 (``P.meta_impl & 255 == 3``), thread by thread where it differs from
    kv_meta_block2: a block whose rq exceeds ``threads`` (KV_THREADS) runs
    :func:`run_meta_blocks2` instead (the kernel's dispatch). Per block: the own requests'
    (tokens, L, pages) in-warp exclusive prefixes and warp totals (32-lane warps, saturating),
    pass 1's sums before r0 / totals / maxima, then each request's absolute prefix formed as
    the kernel forms it after its one barrier (sum before r0 + warp totals before + in-warp
    prefix); the group's first request's first ``pre`` x lanes columns "loaded" before the
    barrier (columns < min(pages, W)), stored below ``end``; the rest as block2. Returns the
    error records as :func:`run_meta_blocks`."""
    bsz, flags = P.bsz, P.attention
    rq_all = -(-bsz // P.meta_per_cache)
    if rq_all > threads:
        return run_meta_blocks2(P)
    dec = _view(P.seq_lens_decoder, bsz)
    q = _view(P.seq_lens_this_time, bsz)
    fi = bool(flags & FLASHINFER)
    N = P.kv_indices_capacity
    G = P.num_caches
    lanes = P.meta_lanes if P.meta_lanes in (4, 8, 16) else 32
    groups = threads // lanes
    warps = threads // 32
    num_chunks = -(-P.capacity // 256)
    records = []

    def sat_sum(values):
        s = 0
        for v in values:
            s = _sat(s, int(v))
        return s

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
        r0 = min(k * rq_all, bsz)
        own = min(r0 + rq_all, bsz) - r0
        keys, mask = [], 0

        def lengths(b, B=B):
            d, n = int(dec[b]), int(q[b])
            bad = d < 0 or n < 0
            nn, L = (0, 0) if bad else (n, _sat(d, n))
            return nn, L, _pages(L, B)

        # a. + c. per thread: own request's values (0 past own), in-warp scans, warp totals
        vals = np.zeros((3, threads), np.int64)
        for t in range(own):
            vals[:, t] = lengths(r0 + t)
        x = np.zeros((3, threads), np.int64)  # in-warp exclusive prefixes
        red_own = np.zeros((3, warps), np.int64)  # warp totals (lane 31's inclusive)
        for v in range(3):
            for w in range(warps):
                inc = 0
                for lane in range(32):
                    x[v, w * 32 + lane] = inc
                    inc = _sat(inc, int(vals[v, w * 32 + lane]))
                red_own[v, w] = inc
        # pass 1 (thread partials summed in any order: saturating sums of non-negatives)
        cq = cl = cp = tl = tp = mq = ml = 0
        for b in range(bsz):
            nn, L, P_ = lengths(b)
            if b < r0:
                cq, cl, cp = _sat(cq, nn), _sat(cl, L), _sat(cp, P_)
            tl, tp = _sat(tl, L), _sat(tp, P_)
            mq, ml = max(mq, nn), max(ml, L)

        def prefix(v, i, base, red_own=red_own, x=x):  # the kernel's absolute prefix of own request i
            return _sat(base, _sat(sat_sum(red_own[v, : i >> 5]), int(x[v, i])))

        # the group's first request: columns loaded before the barrier
        preloaded = {}
        if fi:
            for grp in range(min(groups, own)):
                gP = int(vals[2, grp])
                for sub in range(lanes):
                    for u in range(pre):
                        col = sub + u * lanes
                        if col < min(gP, W):
                            preloaded[(grp, col)] = int(table[(r0 + grp) * stride + col])
        # stores of the loaded columns
        if fi:
            for grp in range(min(groups, own)):
                s0, tok, gP = prefix(2, grp, cp), prefix(0, grp, cq), int(vals[2, grp])
                end = min(gP, N - s0) if s0 < N else 0
                for sub in range(lanes):
                    for u in range(pre):
                        col = sub + u * lanes
                        if col < end:
                            v = preloaded.get((grp, col), -1)
                            if col < W and v < 0:
                                mask |= 2
                                keys.append(error_key(tok, r0 + grp, g, 2))
                            idx[s0 + col] = v if v >= 0 else -1
        # d. per-request outputs
        for t in range(own):
            b = r0 + t
            xq, xp = prefix(0, t, cq), prefix(2, t, cp)
            nn, L, P_ = (int(v) for v in vals[:, t])
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
                cuk[b] = prefix(1, t, cl)
        if k == 0 and fi:
            indptr[bsz] = tp
        if k == 0 and varlen:
            cuk[bsz] = tl
        if varlen and m == 0:
            mx = _view(P.max_seqlen, 2)
            mx[0], mx[1] = mq, ml
        # the rest of the rows: group grp's requests grp, grp + groups, ...
        if fi:
            for grp in range(groups):
                for i in range(grp, own, groups):
                    s0, tok, P_ = prefix(2, i, cp), prefix(0, i, cq), int(vals[2, i])
                    end = min(P_, N - s0) if s0 < N else 0
                    first = pre * lanes if i == grp else 0
                    for col in range(first, end):
                        v = -1
                        if col < W:
                            v = int(table[(r0 + i) * stride + col])
                            if v < 0:
                                mask |= 2
                                keys.append(error_key(tok, r0 + i, g, 2))
                        idx[s0 + col] = v if v >= 0 else -1
        # the pad
        if fi:
            e_lo = min(k * P.meta_entries, N)
            e_hi = min(e_lo + P.meta_entries, N)
            idx[max(e_lo, tp) : e_hi] = -1
        records.append((num_chunks + P.max_tiles + m, mask, min(keys) if keys else (1 << 64) - 1))
    return records
