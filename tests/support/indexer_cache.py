"""End to end through the indexer's K cache (docs/dsa.md): random indexer keys (fp8 value bytes
and fp32 scales) written through a step's DSA offsets into a ``[blocks, B * (V + S)]`` byte cache,
then read back the way the indexer's scorer reads a block (its ``B * V`` value bytes first, then
its ``B`` scales), through the block table at each token's position. NumPy and torch (CPU or
GPU) versions of the same steps, so that the CPU twin checks what the GPU test runs.
"""

from __future__ import annotations

import numpy as np

V, S = 128, 4


def step_inputs(rng, bsz: int, B: int, *, n: int = 1, width: int = 24):
    """Lengths (decodes of n tokens first, then prefill chunks) and a table whose rows hold
    distinct blocks (no two tokens share a slot); returns (dec, q, table, num_blocks)."""
    nd = int(rng.integers(0, bsz + 1))
    q = np.concatenate([np.full(nd, n), rng.integers(n + 1, n + 30, bsz - nd)]).astype(np.int32)
    dec = rng.integers(0, B * width - 40 - n, bsz).astype(np.int32)
    num_blocks = bsz * width + 3
    table = rng.permutation(num_blocks)[: bsz * width].reshape(bsz, width).astype(np.int32)
    return dec, q, table, num_blocks


def keys(rng, C: int):
    """Random indexer keys of C tokens: fp8 value bytes [C, V] uint8 and fp32 scales [C]."""
    values = rng.integers(0, 256, (C, V), dtype=np.uint8)
    scales = rng.standard_normal(C).astype(np.float32)
    return values, scales


def expected_cache(num_blocks, B, table, req, pos, values, scales):
    """The cache the writes must give (NumPy), built from the layout itself: token t's values at
    block ``table[req, pos // B]``, bytes ``[off * V, (off + 1) * V)``, its scale at
    ``B * V + off * S`` (``off = pos % B``); every other byte 0."""
    cache = np.zeros((num_blocks, B * (V + S)), np.uint8)
    sb = scales.view(np.uint8).reshape(-1, S)
    for t in np.flatnonzero(req >= 0):
        blk, off = table[req[t], pos[t] // B], pos[t] % B
        cache[blk, off * V : (off + 1) * V] = values[t]
        cache[blk, B * V + off * S : B * V + (off + 1) * S] = sb[t]
    return cache


# ---- NumPy ----


def write_numpy(cache, value_offsets, scale_offsets, values, scales):
    """Scatter each token's V value bytes and S scale bytes at its offsets (-1: skip)."""
    flat = cache.reshape(-1)
    real = np.flatnonzero(value_offsets >= 0)
    flat[value_offsets[real, None] + np.arange(V)] = values[real]
    flat[scale_offsets[real, None] + np.arange(S)] = scales.view(np.uint8).reshape(-1, S)[real]


def read_numpy(cache, B, table, req, pos):
    """The scorer's read of token t's key: block ``table[req, pos // B]``, its values as
    ``[B, V]`` then its scales as ``[B]`` fp32, row ``pos % B``; (values [T, V], scales [T])."""
    blocks = cache[table[req, pos // B]]
    off = pos % B
    vals = blocks[:, : B * V].reshape(-1, B, V)[np.arange(len(req)), off]
    sc = np.ascontiguousarray(blocks[:, B * V :]).view(np.float32).reshape(-1, B)[np.arange(len(req)), off]
    return vals, sc


# ---- torch (the same steps) ----


def write_torch(cache, value_offsets, scale_offsets, values, scales):
    import torch

    flat = cache.view(-1)
    real = torch.nonzero(value_offsets >= 0).flatten()
    dev = cache.device
    flat[value_offsets[real, None] + torch.arange(V, device=dev)] = values[real]
    sb = scales.view(torch.uint8).view(-1, S)
    flat[scale_offsets[real, None] + torch.arange(S, device=dev)] = sb[real]


def read_torch(cache, B, table, req, pos):
    import torch

    blocks = cache[table[req, pos // B]]
    off = pos % B
    rows = torch.arange(req.numel(), device=cache.device)
    vals = blocks[:, : B * V].reshape(-1, B, V)[rows, off]
    sc = blocks[:, B * V :].contiguous().view(torch.float32).reshape(-1, B)[rows, off]
    return vals, sc
