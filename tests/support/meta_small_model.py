"""A line-by-line Python model of the metadata blocks of ``step_small_attention<G, pos>`` (the
small-batch step with attention outputs).

It reads the launch's ``KvStepParams`` (kernel_loader.StepParams) as the kernel does, from
host memory the pointers address (the fake device arrays of
tests/unit/test_planner_attention.py are NumPy buffers), with the launch geometry
``(blocks, threads)`` the planner chose, and writes the metadata there. The M = blocks -
ceil(C / threads) metadata blocks are counted from the grid's end: block blockIdx.x is
mr = blocks - 1 - blockIdx.x, cache g = mr % G, block k = mr // G of it (K = M // G with
flashinfer or page_table, else one block), owning requests [k rq, k rq + rq) with rq = the
block's warps when K x warps >= bsz (a warp per request), else ceil(bsz / K), and the pad range
[k ceil(N / K), (k + 1) ceil(N / K)). Each thread i holds request i (threads >= bsz): in-warp
exclusive prefixes (32-lane warps, saturating), warp totals, the absolute prefix formed after
the one barrier; each warp copies the rows of requests r0 + warp, r0 + warp + warps, ..., the
first one's first ``pre`` x 32 columns loaded before the barrier (columns < the table width,
whatever the row's pages). Returns the error records ``(record index, mask, key)`` of every
warp of every metadata block (record = blockIdx.x * threads / 32 + warp).
"""

from __future__ import annotations

from kvaddr.errors import NO_ERROR_KEY, error_key
from tests.support.meta_kernel_model import FLASHINFER, PAGE_TABLE, VARLEN, _pages, _sat, _view


def run_meta_small(P, blocks: int, threads: int, num_caches: int, pre: int = 16) -> list:
    bsz, flags, N, T = P.bsz, P.attention, P.kv_indices_capacity, threads
    assert bsz <= T <= 256 and T % 32 == 0, (bsz, T)
    G = num_caches
    token_blocks = -(-P.capacity // T)
    M = blocks - token_blocks
    assert M >= 1
    dec = _view(P.seq_lens_decoder, bsz)
    q = _view(P.seq_lens_this_time, bsz)
    fi = bool(flags & FLASHINFER)
    rows = G > 0 and bool(flags & (FLASHINFER | PAGE_TABLE))
    K = max(M // G, 1) if rows else 1
    warps = T // 32  # a warp per request's row
    records = []
    for blk in range(token_blocks, blocks):
        first_rec = blk * warps
        mr = blocks - 1 - blk
        g, k = (mr % G, mr // G) if rows and G > 1 else (0, mr)
        varlen = bool(flags & VARLEN) and g == 0
        copy = fi
        B, W, stride = (P.block_size[g], P.max_blocks[g], P.table_stride[g]) if G else (1, 1, 0)
        table = _view(P.block_tables[g], (bsz - 1) * stride + W if bsz and rows else 0)
        indptr = _view(P.kv_indptr + 4 * g * P.attn_stride, bsz + 1) if fi else None
        last = _view(P.kv_last_page_len + 4 * g * P.attn_stride, bsz) if fi else None
        idx = _view(P.kv_indices + 4 * g * N, N) if fi else None
        cuk = _view(P.cu_seqlens_k, bsz + 1) if varlen else None
        rq = warps if K * warps >= bsz else -(-bsz // K)
        r0 = min(k * rq, bsz)
        r1 = min(r0 + rq, bsz)
        mask = [0] * warps
        key = [NO_ERROR_KEY] * warps

        def flag(thread, bit, token, request, cache=g, mask=mask, key=key):
            w = thread >> 5
            mask[w] |= bit
            key[w] = min(key[w], error_key(token, request, cache, bit))

        # 1. + 3. thread i: request i's (tokens, L, pages), in-warp exclusive prefixes, warp totals
        vals = [[0] * T for _ in range(3)]
        for i in range(bsz):
            d, n = int(dec[i]), int(q[i])
            bad = d < 0 or n < 0
            nn, L = (0, 0) if bad else (n, _sat(d, n))
            vals[0][i], vals[1][i], vals[2][i] = nn, L, _pages(L, B) if G else 0
        x = [[0] * T for _ in range(3)]
        red = [[0] * warps for _ in range(3)]
        for v in range(3):
            for w in range(warps):
                inc = 0
                for lane in range(32):
                    x[v][w * 32 + lane] = inc
                    inc = _sat(inc, vals[v][w * 32 + lane])
                red[v][w] = inc
        mq = max(vals[0][:bsz], default=0)
        ml = max(vals[1][:bsz], default=0)

        def prefix(v, i, red=red, x=x):
            s = 0
            for w in range(i >> 5):
                s = _sat(s, red[v][w])
            return _sat(s, x[v][i])

        def total(v, red=red):
            s = 0
            for w in range(warps):
                s = _sat(s, red[v][w])
            return s

        # 2. + 4. the copy: a warp per request b0, b0 + warps, ...; the first one's first
        # pre x 32 columns were loaded before the barrier, columns < W, before any length is
        # known (the reads must stay inside the table: the view raises past row bsz - 1's W
        # columns). The kernel first loads the row of k x warps + warp (the usual geometry), a
        # row below bsz, then again the right one when rq differs: the model checks the first
        # stays inside the table too.
        if copy:
            for w in range(warps):
                b_first = k * warps + w
                if b_first < bsz and W > 0:
                    int(table[b_first * stride + min(pre * 32, W) - 1])  # its last loaded column
            for t in range(T):
                w, lane = divmod(t, 32)
                b0 = r0 + w
                loaded = {}
                if b0 < r1:
                    for u in range(pre):
                        col = lane + u * 32
                        if col < W:
                            loaded[col] = int(table[b0 * stride + col])
                for b in range(b0, r1, warps):
                    s0, tok, pages = prefix(2, b), prefix(0, b), vals[2][b]
                    end = min(pages, N - s0) if s0 < N else 0
                    col = lane
                    while col < end:
                        if b == b0 and col in loaded:
                            v = loaded[col]
                        else:
                            v = int(table[b * stride + col]) if col < W else -1
                        if col < W and v < 0:
                            flag(t, 2, tok, b)
                        idx[s0 + col] = v if v >= 0 else -1
                        col += 32
        # per-request outputs of thread i in [r0, r1)
        for i in range(r0, r1):
            xq, xp = prefix(0, i), prefix(2, i)
            L, P_ = vals[1][i], vals[2][i]
            if fi:
                indptr[i] = xp
                last[i] = (L - 1) % B + 1 if L > 0 else 0
                if xp <= N < _sat(xp, P_):
                    flag(i, 16, xq, i)
            if rows and P_ > W:
                flag(i, 1, xq, i)
            if varlen:
                cuk[i] = prefix(1, i)
        tp = total(2)
        if k == 0:
            if fi:
                indptr[bsz] = tp
            if varlen:
                cuk[bsz] = total(1)
                mx = _view(P.max_seqlen, 2)
                mx[0], mx[1] = mq, ml
        if fi:
            chunk = -(-N // K)
            lo, hi = min(k * chunk, N), min(min(k * chunk, N) + chunk, N)
            for e in range(max(lo, tp), hi):
                idx[e] = -1
        records += [(first_rec + w, mask[w], key[w] if mask[w] else NO_ERROR_KEY) for w in range(warps)]
    return records
