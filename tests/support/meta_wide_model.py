"""A line-by-line Python model of the metadata blocks of ``step_wide_attention<G, pos>`` (the
across-blocks step with attention outputs, 256 < bsz <= 4096).

Like tests/support/meta_small_model.py it reads the launch's ``KvStepParams`` from the host
memory its pointers address (the fake device arrays of tests/unit/test_planner_attention.py),
with the launch geometry ``(blocks, threads)`` the planner chose, and writes the metadata
there. The M = blocks - ceil(C / threads) metadata blocks are counted from the grid's end:
block blockIdx.x is mr = blocks - 1 - blockIdx.x, cache g = mr % G, block k = mr // G of it
(with flashinfer or page_table; else one block owning every request). With W = threads / 32
warps, block k is a REQUEST block when k W < bsz (it owns requests [k W, k W + W), a warp per
request) and otherwise a PAD block (j = k - ceil(bsz / W) of J = M / G - ceil(bsz / W)). A
request block reads only the lengths below its last request, a pad block all of them (the
views are sized so: a read past them raises). Thread i holds requests [R i, R i + R); the
errors an owned request raises (bits 1 and 16) go to the record of its thread's warp, a
negative block id (bit 2) to the record of the warp copying the row. Returns the error records
``(record index, mask, key)`` of every warp of every metadata block (record = blockIdx.x *
threads / 32 + warp).
"""

from __future__ import annotations

from kvaddr.errors import NO_ERROR_KEY, error_key
from tests.support.meta_kernel_model import FLASHINFER, PAGE_TABLE, VARLEN, _pages, _sat, _view


def run_meta_wide(P, blocks: int, threads: int, num_caches: int, per_thread: int, pre: int = 16) -> list:
    bsz, flags, N, T, R = P.bsz, P.attention, P.kv_indices_capacity, threads, per_thread
    assert R in (4, 8, 16) and T % 32 == 0 and 32 <= T <= 4096 // R and bsz <= R * T, (R, T, bsz)
    G = num_caches
    token_blocks = -(-P.capacity // T)
    M = blocks - token_blocks
    assert M >= 1
    fi = bool(flags & FLASHINFER)
    rows = G > 0 and bool(flags & (FLASHINFER | PAGE_TABLE))
    warps = T // 32
    kreq = -(-bsz // warps)
    records = []
    for blk in range(token_blocks, blocks):
        first_rec = blk * warps
        mr = blocks - 1 - blk
        g, k = (mr % G, mr // G) if rows and G > 1 else (0, mr)
        owner = not rows or k * warps < bsz
        r0, r1 = (min(k * warps, bsz), min(min(k * warps, bsz) + warps, bsz)) if rows else (0, bsz)
        lim = r1 if owner else bsz
        dec = _view(P.seq_lens_decoder, lim)  # the lengths this block reads, no more
        q = _view(P.seq_lens_this_time, lim)
        varlen = bool(flags & VARLEN) and g == 0
        B, W, stride = (P.block_size[g], P.max_blocks[g], P.table_stride[g]) if G else (1, 1, 0)
        table = _view(P.block_tables[g], (bsz - 1) * stride + W if bsz and rows else 0)
        indptr = _view(P.kv_indptr + 4 * g * P.attn_stride, bsz + 1) if fi else None
        last_len = _view(P.kv_last_page_len + 4 * g * P.attn_stride, bsz) if fi else None
        idx = _view(P.kv_indices + 4 * g * N, N) if fi else None
        cuk = _view(P.cu_seqlens_k, bsz + 1) if varlen else None
        mask = [0] * warps
        key = [NO_ERROR_KEY] * warps

        def flag(w, bit, token, request, cache=g, mask=mask, key=key):
            mask[w] |= bit
            key[w] = min(key[w], error_key(token, request, cache, bit))

        # 1. the lengths below lim; the row loads of the warps' requests (columns < W, before any
        # length is known: they must stay inside the table)
        vals = [[0] * lim for _ in range(3)]
        for i in range(lim):
            d, n = int(dec[i]), int(q[i])
            bad = d < 0 or n < 0
            nn, L = (0, 0) if bad else (n, _sat(d, n))
            vals[0][i], vals[1][i], vals[2][i] = nn, L, _pages(L, B) if G else 0
        if fi and owner:
            for w in range(warps):
                if r0 + w < r1 and W > 0:
                    int(table[(r0 + w) * stride + min(pre * 32, W) - 1])  # its last loaded column

        # saturating prefix sums (the order of the additions does not matter: non-negative values)
        pre_sums = []
        for v in range(3):
            acc, run = [0], 0
            for x in vals[v]:
                run = _sat(run, x)
                acc.append(run)
            pre_sums.append(acc)

        def prefix(v, i, pre_sums=pre_sums):
            return pre_sums[v][i]

        # 2. entry bsz and the maxima: the block owning request bsz - 1 (block 0 for bsz = 0)
        last = (not rows) or (k == 0 if bsz == 0 else owner and r1 == bsz)
        if last:
            if fi:
                indptr[bsz] = prefix(2, lim)
            if varlen:
                cuk[bsz] = prefix(1, lim)
                mx = _view(P.max_seqlen, 2)
                mx[0], mx[1] = max(vals[0], default=0), max(vals[1], default=0)
        if owner:
            for b in range(r0, r1):
                xq, xp = prefix(0, b), prefix(2, b)
                L, P_ = vals[1][b], vals[2][b]
                w = (b // R) // 32  # the warp of the thread holding request b
                if fi:
                    indptr[b] = xp
                    last_len[b] = (L - 1) % B + 1 if L > 0 else 0
                if varlen:
                    cuk[b] = prefix(1, b)
                if fi and xp <= N < _sat(xp, P_):
                    flag(w, 16, xq, b)
                if rows and P_ > W:
                    flag(w, 1, xq, b)
            if fi:  # 3. warp w copies request r0 + w's row
                for w in range(warps):
                    b0 = r0 + w
                    if b0 >= r1:
                        continue
                    s0, tok, pages = prefix(2, b0), prefix(0, b0), vals[2][b0]
                    end = min(pages, N - s0) if s0 < N else 0
                    for col in range(end):
                        v = int(table[b0 * stride + col]) if col < W else -1
                        if col < W and v < 0:
                            flag(w, 2, tok, b0)
                        idx[s0 + col] = v if v >= 0 else -1
        elif fi:  # a pad block: entries [tp + j c, tp + (j + 1) c) below N
            J, j = max(M // G - kreq, 1), k - kreq
            tp = prefix(2, lim)
            if tp < N:
                left = N - tp
                c = -(-left // J)
                lo = min(j * c, left)
                hi = min(lo + c, left)
                for e in range(tp + lo, tp + hi):
                    idx[e] = -1
        records += [(first_rec + w, mask[w], key[w] if mask[w] else NO_ERROR_KEY) for w in range(warps)]
    return records
