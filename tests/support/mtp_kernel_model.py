"""A Python model of ``mtp_step<PosT>`` (kvaddr/kernels/mtp.cuh), block by block.

It reads the launch's ``MtpParams`` (kernel_loader.MtpParams) as the kernel does, from host
memory the pointers address (the planner fake of tests/support/fake_cupy.py allocates NumPy
buffers), over the grid ``(blocks, k)`` of KV_THREADS-thread blocks, and writes the outputs
there. Each block (x, j) follows the kernel: it owns requests [r_lo, r_hi) (rq = ceil((bsz + 1) /
blocks) rounded up to a multiple of 4) and scans the window [w_lo, w_hi) holding them (the whole
batch within a tile, else a tile around them, or their own range when rq exceeds a tile); the
other requests' sums (token, kv-length and page prefixes before w_lo, totals from w_hi on,
maxima) come first, then the window in tiles of KV_MTP_TILE, thread i holding requests
[4 i, 4 i + 4) of the tile; the block's requests of the tile [k_lo, k_hi) get their outputs and
checks, their tokens one per thread in turn (thread (t - first) % KV_THREADS: one token per thread
up to KV_THREADS tokens, past that the kernel's two per thread per round, t and t + KV_THREADS,
on the same thread), their kv_indices
rows (a warp per request: request k of the tile on warp (k - k_lo) % KV_WARPS); the padding of
its token range after the loop, the pad entries of kv_indices in a grid stride; the block owning request bsz
writes the totals and the maxima. Blocks run in reverse order: every output element has one
writer, so the order must not matter. Errors are merged into record ``(j * blocks + x) * KV_WARPS +
warp`` of the thread that found them, as the kernel does (mask OR, smallest key).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvaddr import kernel_loader
from kvaddr.errors import (
    ERR_BLOCK_INDEX,
    ERR_CAPACITY,
    ERR_KV_INDICES_CAPACITY,
    ERR_NEGATIVE_BLOCK,
    ERR_NEGATIVE_LENGTH,
    error_key,
)

_C = kernel_loader.constants()
T = _C["KV_THREADS"]
WARPS = _C["KV_WARPS"]
ITEMS = _C["KV_MTP_ITEMS"]
TILE = T * ITEMS
INT_MAX = 2**31 - 1


def _view(ptr: int, n: int, dtype=np.int32) -> np.ndarray:
    if n <= 0 or ptr == 0:
        return np.zeros(0, dtype)
    buf = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype)


def _lengths(d: int, a: int, j: int) -> tuple[int, int]:
    if j == 0:
        return d, a
    if a > 0:
        return min(d + a + j - 1, INT_MAX), 1
    return d, min(a, 0)


def run_mtp(M: kernel_loader.MtpParams, blocks: int, k: int, pos_dtype=np.int64) -> None:
    """Run the whole grid ``(blocks, k)`` on host memory."""
    p = M.step
    bsz, C, G, Mr = p.bsz, p.capacity, p.num_caches, M.max_requests
    flags, N, AS = p.attention, p.kv_indices_capacity, p.attn_stride
    fi, varlen, rows = bool(flags & 1), bool(flags & 2), bool(flags & 5)
    dec_in, acc_in = _view(p.seq_lens_decoder, bsz), _view(M.accept_num, bsz)
    recs = _view(p.error_records, 2 * (k * blocks * WARPS), np.uint64)
    tables = []
    for g in range(G):
        W, stride = p.max_blocks[g], p.table_stride[g]
        tables.append(_view(p.block_tables[g], (bsz - 1) * stride + W if bsz else 0))

    for j in range(k):
        cu_out = _view(p.cu_seqlens_q + 4 * j * (Mr + 1), bsz + 1)
        batch = _view(p.batch_id_per_token + 4 * j * C, C)
        pos_out = _view(p.position_ids + np.dtype(pos_dtype).itemsize * j * C, C, pos_dtype)
        kv_out = _view(p.seq_lens_kv + 4 * j * Mr, bsz)
        slots = _view(p.slot_mapping + 8 * j * G * C, G * C, np.int64).reshape(G, C) if G else None
        for x in reversed(range(blocks)):  # blocks own disjoint outputs: any order (not the launch order)
            rec = {}

            def flag(tid, bit, token, request, cache, x=x, j=j, rec=rec):
                r = (j * blocks + x) * WARPS + tid // 32
                m, key = rec.get(r, (0, 2**64 - 1))
                rec[r] = (m | bit, min(key, error_key(token, request, cache, bit)))

            def write_token(tid, t, b, pos, flag=flag, batch=batch, pos_out=pos_out, slots=slots):
                batch[t], pos_out[t] = b, pos
                for g in range(G):
                    B, W, stride = p.block_size[g], p.max_blocks[g], p.table_stride[g]
                    idx, off = divmod(pos, B)
                    slot = -1
                    if idx >= W:
                        flag(tid, ERR_BLOCK_INDEX, t, b, g)
                    else:
                        blk = int(tables[g][b * stride + idx])
                        if blk < 0:
                            flag(tid, ERR_NEGATIVE_BLOCK, t, b, g)
                        else:
                            slot = blk * B + off
                    slots[g, t] = slot

            rq = (-(-(bsz + 1) // blocks) + 3) & ~3  # a multiple of 4: int4 loads
            r_lo = min(x * rq, bsz + 1)
            r_hi = min(r_lo + rq, bsz + 1)
            r_end = min(r_hi, bsz)
            # the window the block scans: the whole batch within a tile, else a tile holding its requests
            w_lo = 0 if bsz <= TILE else min(r_lo, (bsz - TILE + 3) & ~3)
            w_hi = min(bsz, max(r_end, w_lo + TILE))
            # the other requests' sums (kv_mtp_others): prefixes before w_lo, totals from w_hi on
            n_before = n_after = k_before = max_n = max_l = 0
            pg_before, pg_after = [0] * G, [0] * G
            if w_lo > 0 or w_hi < bsz:
                for b in [*range(0, w_lo), *range(w_hi, bsz)]:
                    dj, qj = _lengths(int(dec_in[b]), int(acc_in[b]), j)
                    bad = dj < 0 or qj < 0
                    n, L = (0, 0) if bad else (qj, min(dj + qj, INT_MAX))
                    before = b < w_lo
                    if before:
                        n_before += n
                    else:
                        n_after += n
                    if varlen:
                        k_before += L if before else 0
                        max_n, max_l = max(max_n, n), max(max_l, L)
                    if fi:
                        for g in range(G):
                            pgs = -(-L // p.block_size[g])
                            if before:
                                pg_before[g] += pgs
                            else:
                                pg_after[g] += pgs
            carry, carry_k = n_before, k_before
            carry_pg = list(pg_before)
            max_q = max_k = 0
            for base in range(w_lo, w_hi, TILE):
                count = min(TILE, w_hi - base)
                k_lo = min(max(r_lo - base, 0), count)  # the block's requests in the tile: [k_lo, k_hi)
                k_hi = max(min(r_end - base, count), k_lo)
                d = np.full(count, -1, np.int64)
                n = np.zeros(count, np.int64)
                L = np.zeros(count, np.int64)
                for kk in range(count):
                    dj, qj = _lengths(int(dec_in[base + kk]), int(acc_in[base + kk]), j)
                    if dj >= 0 and qj >= 0:
                        d[kk], n[kk], L[kk] = dj, qj, min(dj + qj, INT_MAX)
                cu = np.concatenate([[0], np.cumsum(n)]) + carry  # int64, true sums
                cuk = np.concatenate([[0], np.cumsum(L)]) + carry_k
                for kk in range(count):
                    b, tid = base + kk, kk // ITEMS
                    cs, ce = min(cu[kk], INT_MAX), min(cu[kk + 1], INT_MAX)
                    max_q, max_k = max(max_q, ce - cs), max(max_k, int(L[kk]))
                    if not k_lo <= kk < k_hi:
                        continue
                    cu_out[b] = cs
                    kv_out[b] = L[kk]
                    if d[kk] < 0:
                        flag(tid, ERR_NEGATIVE_LENGTH, cs, b, 0)
                    if cu[kk] <= C < cu[kk + 1]:
                        flag(tid, ERR_CAPACITY, C, b, 0)
                    if varlen:
                        _view(p.cu_seqlens_k + 4 * j * (Mr + 1), bsz + 1)[b] = min(cuk[kk], INT_MAX)
                t_first = int(cu[k_lo])
                for t in range(t_first, min(int(cu[k_hi]), C)):
                    tid = (t - t_first) % T  # the block's tokens of the tile, one per thread in turn
                    lo = k_lo + int(np.searchsorted(cu[k_lo + 1 : k_hi], t, side="right"))
                    write_token(tid, t, base + lo, int(d[lo]) + (t - int(cu[lo])))
                if rows:
                    for g in range(G):
                        B, W, stride = p.block_size[g], p.max_blocks[g], p.table_stride[g]
                        pages = -(-L // B)
                        pg = np.concatenate([[0], np.cumsum(pages)]) + carry_pg[g]
                        row = j * G * AS + g * AS
                        for kk in range(k_lo, k_hi):
                            b = base + kk
                            first = min(int(cu[kk]), INT_MAX)
                            if pages[kk] > W:
                                flag(kk // ITEMS, ERR_BLOCK_INDEX, first, b, g)
                            if fi:
                                _view(p.kv_indptr, (k * G * AS))[row + b] = min(pg[kk], INT_MAX)
                                last = (L[kk] - 1) % B + 1 if L[kk] > 0 else 0
                                _view(p.kv_last_page_len, (k * G * AS))[row + b] = last
                                if pg[kk] + pages[kk] > N:
                                    flag(kk // ITEMS, ERR_KV_INDICES_CAPACITY, first, b, g)
                                idx_out = _view(p.kv_indices + 4 * (j * G * N + g * N), N)
                                warp = (kk - k_lo) % WARPS
                                for e in range(int(pages[kk])):
                                    if pg[kk] + e >= N:
                                        break
                                    v = -1
                                    if e < W:
                                        v = int(tables[g][b * stride + e])
                                        if v < 0:
                                            flag(warp * 32, ERR_NEGATIVE_BLOCK, first, b, g)
                                    idx_out[pg[kk] + e] = v if v >= 0 else -1
                        carry_pg[g] = int(pg[count])
                carry, carry_k = int(cu[count]), int(cuk[count])
            n_total = carry + n_after
            for tid in range(T):
                t = x * T + tid
                if t < C and t >= n_total:
                    batch[t], pos_out[t] = -1, 0
                    for g in range(G):
                        slots[g, t] = -1
            if r_lo <= bsz < r_hi:
                cu_out[bsz] = min(carry, INT_MAX)
                if varlen:
                    _view(p.cu_seqlens_k + 4 * j * (Mr + 1), bsz + 1)[bsz] = min(carry_k, INT_MAX)
                if fi:
                    for g in range(G):
                        _view(p.kv_indptr, k * G * AS)[j * G * AS + g * AS + bsz] = min(carry_pg[g], INT_MAX)
            tail = r_lo <= bsz < r_hi  # the block owning request bsz writes the totals
            if tail:
                _view(p.num_tokens + 4 * j, 1)[0] = min(n_total, C)
            if fi:
                for g in range(G):
                    idx_out = _view(p.kv_indices + 4 * (j * G * N + g * N), N)
                    for e in range(x * T, N, blocks * T):
                        hi = min(e + T, N)
                        for ee in range(max(e, carry_pg[g] + pg_after[g]), hi):
                            idx_out[ee] = -1
            if varlen and tail:
                if n_total > INT_MAX:  # saturated differences: from a scan of every request
                    qs = [_lengths(int(dec_in[b]), int(acc_in[b]), j) for b in range(bsz)]
                    nn = [0 if dj < 0 or qj < 0 else qj for dj, qj in qs]
                    cum = np.minimum(np.concatenate([[0], np.cumsum(nn, dtype=np.int64)]), INT_MAX)
                    max_q, max_n = int(np.diff(cum).max(initial=0)), 0
                _view(p.max_seqlen + 8 * j, 2)[:] = (max(max_q, max_n), max(max_k, max_l))
            for r, (m, key) in rec.items():
                recs[2 * r] |= np.uint64(m)
                recs[2 * r + 1] = min(int(recs[2 * r + 1]), key)
