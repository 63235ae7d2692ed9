"""A step-by-step Python model of the DSA blocks of the core step (kvaddr/kernels/dsa_step.cuh).

It reads the launch's ``KvStepParams`` (kernel_loader.StepParams) as ``kv_dsa_block`` does, from
host memory the pointers address (fake device arrays that are NumPy buffers), with the launch
geometry ``(blocks, threads)`` the planner chose, and writes the DSA outputs there: the grid's
second row is ``blocks`` DSA blocks; block k owns the tokens ``[k * per, min((k + 1) * per, C))``
with ``per = ceil(C / blocks)``; it walks the requests ``threads * r`` at a time (``r = min(8,
2048 // threads)``), carrying three saturating prefixes (tokens, the prefills' seq_lens, the
prefills' count) from tile to tile; it stages each tile's token ends and each thread's prefill prefix,
finds the request of each of its tokens the tile holds by a binary search of the staged ends, and
that request's ks from its loading thread's staged prefix and requests; a
block other than the last stops after the tile that reaches its last token; then the block pads its
tokens past the total; the last block writes ``cu_seq_lens``. Returns how many
times each token was written (every token exactly once over the blocks).
"""

from __future__ import annotations

import numpy as np

from tests.support.meta_kernel_model import _sat, _view

#: Requests a thread loads per tile and requests per tile at most (dsa_step.cuh's KV_DSA_R, KV_DSA_TILE).
KV_DSA_R = 8
KV_DSA_TILE = 2048


def _excl_sat(vals, carry):
    """Exclusive saturating prefixes of ``vals`` after ``carry`` and the saturating total."""
    out = []
    run = carry
    for v in vals:
        out.append(run)
        run = _sat(run, int(v))
    return out, run


def _table_entry(P, g, b, idx):
    ptr = int(P.block_tables[g]) + (b * int(P.table_stride[g]) + idx) * 4
    return int(_view(ptr, 1)[0])


def run_dsa_blocks(P, blocks: int, threads: int) -> np.ndarray:
    """Run the ``blocks`` DSA blocks of a launch with ``threads`` threads per block; returns the
    write count of each token."""
    assert P.dsa == 1 and threads % 32 == 0 and 32 <= threads <= 1024, (P.dsa, threads)
    bsz, C, n_dec = P.bsz, P.capacity, P.dsa_decode_len
    g = P.dsa_cache
    width, B = int(P.max_blocks[g]), int(P.block_size[g])
    V, S = P.dsa_value_bytes, P.dsa_scale_bytes
    dec = _view(P.seq_lens_decoder, bsz)
    q = _view(P.seq_lens_this_time, bsz)
    value = _view(P.dsa_value_offsets, C, np.int64)
    scale = _view(P.dsa_scale_offsets, C, np.int64)
    ks_out = _view(P.dsa_ks, C)
    ke_out = _view(P.dsa_ke, C)
    ctx_out = _view(P.dsa_ctx, C)
    cu_out = _view(P.dsa_cu_seq_lens, P.dsa_cu_len)
    r = min(KV_DSA_R, KV_DSA_TILE // threads)
    tile = threads * r
    per = -(-C // blocks)
    writes = np.zeros(C, np.int64)
    for k in range(blocks):
        lo = min(k * per, C)
        hi = min(lo + per, C)
        carry_tok = carry_pre = carry_cnt = 0
        for base in range(0, bsz, tile):
            if k != blocks - 1 and (carry_tok >= hi or lo >= hi):
                break  # the block stops once its tokens are placed (the last scans all for cu_seq_lens)
            count = min(tile, bsz - base)
            d = [int(x) for x in dec[base : base + count]]
            n = [int(x) for x in q[base : base + count]]
            bad = [(a < 0) or (c < 0) for a, c in zip(d, n)]
            ne = [0 if bd else c for bd, c in zip(bad, n)]
            pre = [(not bd) and c > n_dec for bd, c in zip(bad, n)]
            lens = [_sat(a, c) if p else 0 for a, c, p in zip(d, n, pre)]
            start, tile_end = _excl_sat(ne, carry_tok)
            ends = start[1:] + [tile_end]  # the staged token ends
            ks, pre_end = _excl_sat(lens, carry_pre)
            staged_ks = ks[::r]  # each thread's prefix before its requests
            unit = all(c == 1 and a >= 0 for a, c in zip(d, n))
            ordinal = carry_cnt
            for j in range(count):
                if k == blocks - 1 and pre[j] and ordinal < P.dsa_cu_len:
                    cu_out[ordinal] = ks[j]
                ordinal += 1 if pre[j] else 0
            for t in range(max(lo, carry_tok), min(hi, tile_end)):
                # binary search: the first staged end past t (direct when every request runs one token)
                a = t - carry_tok if unit else 0
                z = a if unit else count - 1
                while a < z:
                    m = (a + z) >> 1
                    if ends[m] > t:
                        z = m
                    else:
                        a = m + 1
                st = ends[a - 1] if a > 0 else carry_tok
                i = a // r  # request a's loading thread: its requests again, up to a
                kr = staged_ks[i]
                for j in range(i * r, a):
                    kr = _sat(kr, lens[j]) if pre[j] else kr
                _token(P, t, base + a, d[a], st, kr if pre[a] else -1, writes, g, width, B, V, S)
            carry_tok, carry_pre, carry_cnt = tile_end, pre_end, ordinal
        for t in range(max(lo, min(carry_tok, C)), hi):
            writes[t] += 1
            value[t] = scale[t] = -1
            ctx_out[t] = ks_out[t] = ke_out[t] = 0
        if k == blocks - 1:
            cu_out[carry_cnt:] = carry_pre
    return writes


def _token(P, t, b, d, start, ks, writes, g, width, B, V, S):
    """kv_dsa_token: token t of request b (ks -1: a decode)."""
    C = P.capacity
    writes[t] += 1
    pos = d + (t - start)
    ctx = _sat(d, t - start + 1)
    idx, off = divmod(pos, B)
    v = s = -1
    if idx < width:
        blk = _table_entry(P, g, b, idx)
        if blk >= 0:
            v = blk * B * (V + S) + off * V
            s = blk * B * (V + S) + B * V + off * S
    _view(P.dsa_value_offsets, C, np.int64)[t] = v
    _view(P.dsa_scale_offsets, C, np.int64)[t] = s
    _view(P.dsa_ctx, C)[t] = ctx
    _view(P.dsa_ks, C)[t] = ks if ks >= 0 else 0
    _view(P.dsa_ke, C)[t] = _sat(ks, ctx) if ks >= 0 else 0
