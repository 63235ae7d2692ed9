"""Mixed batches for the attention-metadata tests (docs/attention.md), CPU and GPU.

A case is a dict of ``step_addressing``'s arguments (NumPy arrays) plus ``attention``
and ``kv_indices_capacity``. Requests are drawn from the kinds an engine's step mixes.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

I32 = np.int32
ALL_GROUPS = ("flashinfer", "varlen", "page_table")
KINDS = ("idle", "empty", "decode", "speculative", "prefill", "continuation", "multiple")
BLOCK_SIZES = (1, 2, 3, 4, 5, 16, 64)


def request_lengths(kind: str, rng: np.random.Generator, B: int, max_ctx: int = 200) -> tuple[int, int]:
    """(seq_lens_decoder, seq_lens_this_time) of one request of a kind."""
    if kind == "idle":  # a decode request that runs no token this step
        return int(rng.integers(1, max_ctx)), 0
    if kind == "empty":  # a free slot: L_b = 0
        return 0, 0
    if kind == "decode":
        return int(rng.integers(0, max_ctx)), 1
    if kind == "speculative":  # 1 + k MTP tokens
        return int(rng.integers(0, max_ctx)), 1 + int(rng.integers(1, 5))
    if kind == "prefill":
        return 0, int(rng.integers(1, 40))
    if kind == "continuation":  # a later chunk of a chunked prefill
        return int(rng.integers(1, max_ctx)), int(rng.integers(1, 40))
    if kind == "multiple":  # L_b an exact multiple of B (the last page full)
        L = B * int(rng.integers(1, 6))
        q = int(rng.integers(0, min(L, 3) + 1))
        return L - q, q
    raise ValueError(kind)


def make_case(
    rng: np.random.Generator,
    *,
    bsz: int,
    block_sizes,
    kinds=KINDS,
    bad: str = "none",
    spare_capacity: int | None = 4,
    shared_table: bool = False,
    max_ctx: int = 200,
) -> dict:
    """A mixed batch; ``bad`` among none, negative-length, unallocated, narrow-row;
    ``spare_capacity`` None draws a kv_indices capacity that may overflow."""
    sizes = list(block_sizes)
    dec = np.zeros(bsz, I32)
    q = np.zeros(bsz, I32)
    for b in range(bsz):
        dec[b], q[b] = request_lengths(str(rng.choice(list(kinds))), rng, sizes[0], max_ctx)
    L = dec.astype(np.int64) + q
    tables = []
    for g, B in enumerate(sizes):
        if shared_table and g > 0 and sizes[0] == B:
            tables.append(tables[0])
            continue
        pages = -(-L // B)
        W = int(pages.max(initial=0)) + int(rng.integers(0, 3))
        W = max(W, 1)
        t = np.full((bsz + int(rng.integers(0, 3)), W), -1, I32)
        perm = rng.permutation(max(bsz * W, 1)).astype(I32)
        for b in range(bsz):
            t[b, : pages[b]] = perm[b * W : b * W + pages[b]]
        tables.append(t)
    if bad == "negative-length" and bsz:
        b = int(rng.integers(0, bsz))
        dec[b] = -int(rng.integers(1, 5))
    if bad == "unallocated" and bsz:
        g = int(rng.integers(0, len(sizes)))
        b = int(rng.integers(0, bsz))
        pages = -(-int(L[b]) // sizes[g])
        if pages:
            tables[g][b, int(rng.integers(0, pages))] = -int(rng.integers(1, 3))
    if bad == "narrow-row" and bsz:
        g = int(rng.integers(0, len(sizes)))
        cut = max(int(tables[g].shape[1]) - int(rng.integers(1, 3)), 1)
        tables[g] = np.ascontiguousarray(tables[g][:, :cut])
    total = max(int((-(-np.maximum(L, 0) // B)).sum()) for B in sizes) if sizes else 0
    if spare_capacity is None:
        N = int(rng.integers(1, total + 3))
    else:
        N = total + spare_capacity
    return dict(
        seq_lens_decoder=dec,
        seq_lens_this_time=q,
        block_tables=tables,
        block_sizes=sizes,
        capacity=max(int(np.maximum(q, 0).sum()), 1),
        attention=ALL_GROUPS,
        kv_indices_capacity=max(N, 1),
    )


@st.composite
def mixed_cases(draw, max_bsz: int = 12, bad_inputs: bool = True):
    """Hypothesis: mixed batches over 1-4 caches with different B, some with bad values."""
    seed = draw(st.integers(0, 2**32 - 1))
    G = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.sampled_from(BLOCK_SIZES), min_size=G, max_size=G))
    bad = draw(st.sampled_from(("none", "negative-length", "unallocated", "narrow-row"))) if bad_inputs else "none"
    overflow = draw(st.booleans())
    return make_case(
        np.random.default_rng(seed),
        bsz=draw(st.integers(0, max_bsz)),
        block_sizes=sizes,
        bad=bad,
        spare_capacity=None if overflow else draw(st.integers(0, 5)),
        shared_table=draw(st.booleans()),
    )
