"""A step-by-step Python model of the DSA outputs of the core step (kvaddr/kernels/dsa_step.cuh).

It reads the launch's ``KvStepParams`` (kernel_loader.StepParams) as the kernels do, from host
memory the pointers address (fake device arrays that are NumPy buffers), with the launch geometry
``(blocks, threads)`` the planner chose:

* ``run_dsa_token_writes``: what the step's token blocks add with DSA (kv_dsa_store_slot,
  kv_dsa_store_pad): each token's value and scale offsets and ctx from its request, position and
  slot in the dsa cache, padding -1, -1, 0;
* ``run_dsa_blocks``: the grid's second row, ``blocks`` DSA blocks; block k owns the tokens
  ``[k * per, min((k + 1) * per, C))`` with ``per = ceil(C / blocks)``. A vote over the whole
  batch (the first tile's requests on both lengths, the rest on seq_lens_this_time alone: n >
  dsa_decode_len): without a prefill every block writes ks = ke = 0 over its tokens and the last block
  cu_seq_lens = 0. Otherwise it walks the requests ``threads * r`` at a time (``r = max(1, min(4,
  1024 // threads))``), carrying three saturating prefixes (tokens, the prefills' seq_lens, the
  prefills' count) from tile to tile; it stages each request's token end, seq_lens_decoder and ks
  (-1: not a prefill), finds the request of each of its tokens the tile holds by a binary search
  of the staged ends and writes ks and ke; a block other than the last stops after the tile that
  reaches its last token; then the block writes 0 and 0 past the total; the last block writes
  ``cu_seq_lens``. Returns how many times each token was written (every token exactly once over
  the blocks).
"""

from __future__ import annotations

import numpy as np

from tests.support.meta_kernel_model import _sat, _view

#: Requests a thread holds per tile and requests per tile at most (dsa_step.cuh's KV_DSA_R, KV_DSA_TILE).
KV_DSA_R = 4
KV_DSA_TILE = 1024


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


def run_dsa_token_writes(P, batch_id, positions) -> None:
    """The step's token writes of the DSA value and scale offsets and ctx: token t of request
    ``batch_id[t]`` (-1: padding) at ``positions[t]``."""
    C, g = P.capacity, P.dsa_cache
    width, B = int(P.max_blocks[g]), int(P.block_size[g])
    V, S = P.dsa_value_bytes, P.dsa_scale_bytes
    value = _view(P.dsa_value_offsets, C, np.int64)
    scale = _view(P.dsa_scale_offsets, C, np.int64)
    ctx = _view(P.dsa_ctx, C)
    for t in range(C):
        b, pos = int(batch_id[t]), int(positions[t])
        if b < 0:
            value[t] = scale[t] = -1
            ctx[t] = 0
            continue
        idx, off = divmod(pos, B)
        slot = -1
        if idx < width:
            blk = _table_entry(P, g, b, idx)
            slot = blk * B + off if blk >= 0 else -1
        value[t] = (slot - off) * (V + S) + off * V if slot >= 0 else -1
        scale[t] = (slot - off) * (V + S) + B * V + off * S if slot >= 0 else -1
        ctx[t] = min(pos + 1, 2**31 - 1)


def run_dsa_blocks(P, blocks: int, threads: int) -> np.ndarray:
    """Run the ``blocks`` DSA blocks of a launch with ``threads`` threads per block; returns the
    write count of each token (ks and ke)."""
    assert P.dsa == 1 and threads % 32 == 0 and 32 <= threads <= 1024, (P.dsa, threads)
    bsz, C, n_dec = P.bsz, P.capacity, P.dsa_decode_len
    dec = _view(P.seq_lens_decoder, bsz)
    q = _view(P.seq_lens_this_time, bsz)
    ks_out = _view(P.dsa_ks, C)
    ke_out = _view(P.dsa_ke, C)
    cu_out = _view(P.dsa_cu_seq_lens, P.dsa_cu_len)
    r = max(1, min(KV_DSA_R, KV_DSA_TILE // threads))
    tile = threads * r
    per = -(-C // blocks)
    writes = np.zeros(C, np.int64)
    # the vote: the first tile's requests on both lengths, past it seq_lens_this_time alone (a bad
    # request past the tile with n > dsa_decode_len takes the prefill path: same outputs)
    any_prefill = any(int(a) >= 0 and int(c) > n_dec for a, c in zip(dec[:tile], q[:tile]))
    any_prefill |= any(int(c) > n_dec for c in q[tile:])
    for k in range(blocks):
        lo = min(k * per, C)
        hi = min(lo + per, C)
        if not any_prefill:  # a decode step: zeros, no scan
            writes[lo:hi] += 1
            ks_out[lo:hi] = ke_out[lo:hi] = 0
            if k == blocks - 1:
                cu_out[:] = 0
            continue
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
            staged_ks = [ks[j] if pre[j] else -1 for j in range(count)]
            ordinal = carry_cnt
            for j in range(count):
                if k == blocks - 1 and pre[j] and ordinal < P.dsa_cu_len:
                    cu_out[ordinal] = ks[j]
                ordinal += 1 if pre[j] else 0
            for t in range(max(lo, carry_tok), min(hi, tile_end)):
                a, z = 0, count - 1  # binary search: the first staged end past t
                while a < z:
                    m = (a + z) >> 1
                    if ends[m] > t:
                        z = m
                    else:
                        a = m + 1
                writes[t] += 1
                kr = staged_ks[a]
                if kr >= 0:
                    st = ends[a - 1] if a > 0 else carry_tok
                    ks_out[t] = kr
                    ke_out[t] = _sat(kr, _sat(d[a], t - st + 1))
                else:
                    ks_out[t] = ke_out[t] = 0
            carry_tok, carry_pre, carry_cnt = tile_end, pre_end, ordinal
        for t in range(max(lo, min(carry_tok, C)), hi):
            writes[t] += 1
            ks_out[t] = ke_out[t] = 0
        if k == blocks - 1:
            cu_out[carry_cnt:] = carry_pre
    return writes
