"""Steps for the DSA outputs' tests (CPU model and GPU): decodes first, then prefill chunks."""

from __future__ import annotations

import numpy as np


def dsa_case(rng, bsz, *, n=1, decodes=None, width=64, max_pos=3000, idle=0.0, bad=0.0, neg_block=0.0, chunk=40):
    """``(seq_lens_decoder, seq_lens_this_time, table)``: ``decodes`` requests of ``n`` tokens
    (random count by default), then prefill chunks of ``n + 1 .. n + chunk - 1`` tokens; a
    fraction ``idle`` runs 0 tokens, ``bad`` has a negative length, ``neg_block`` of the table's
    entries are -1."""
    nd = int(rng.integers(0, bsz + 1)) if decodes is None else decodes
    q = np.concatenate([np.full(nd, n), rng.integers(n + 1, n + chunk, bsz - nd)]).astype(np.int32)
    dec = rng.integers(0, max_pos, bsz).astype(np.int32)
    if idle:
        q[rng.random(bsz) < idle] = 0
    if bad:
        dec[rng.random(bsz) < bad] = -3
    table = rng.integers(0, 1 << 20, (max(bsz, 1), width)).astype(np.int32)
    if neg_block:
        table[rng.random(table.shape) < neg_block] = -1
    return dec, q, table
