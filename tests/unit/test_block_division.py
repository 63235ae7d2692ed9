"""The arithmetic kernels.cu's small-batch and wide kernels use for pos // B and the row bound
(kv1_div_init, kv1_load_blocks_x), checked exhaustively on edge values and on random ones.

* m = floor((2**32 - 1) / B) is made once per launch; q = umulhi(p, m), plus one when
  p - q * B >= B, is p // B for every 0 <= p < 2**32 and 1 <= B < 2**31.
* lim = min(max_blocks * B, 2**32 - 1): p < lim iff p // B < max_blocks, for 0 <= p <= 2**32 - 2
  (the largest position a token can have: seq_lens_decoder <= INT_MAX plus fewer than
  C <= INT_MAX tokens).

The GPU tests compare the kernels themselves with the NumPy reference, positions near 2**31
included; this shows the identities the kernels rely on hold on the whole range, not only on
the positions those tests draw.
"""

from __future__ import annotations

import numpy as np

U32 = (1 << 32) - 1
INT_MAX = (1 << 31) - 1


def _edges(hi: int) -> np.ndarray:
    base = [0, 1, 2, 3, 7, 15, 16, 17, 63, 64, 65, 96, 127, 128, 1000, 4095, 4096, 65535, 65536]
    base += [(1 << k) + d for k in range(17, 33) for d in (-2, -1, 0, 1)]
    return np.array(sorted({x for x in base if 0 <= x <= hi}), dtype=np.uint64)


def _quotient(p: np.ndarray, b: np.ndarray) -> np.ndarray:
    m = np.uint64(U32) // b
    q = (p * m) >> np.uint64(32)  # umulhi: p, m < 2**32, so p * m < 2**64
    return q + ((p - q * b) >= b).astype(np.uint64)


def _lim(max_blocks: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.minimum(max_blocks * b, np.uint64(U32))


def test_quotient_is_exact_on_edges_and_random_values():
    rng = np.random.default_rng(20261202)
    ps = np.concatenate([_edges(U32), rng.integers(0, 1 << 32, 20000, dtype=np.uint64)])
    bs = np.concatenate([_edges(INT_MAX)[1:], rng.integers(1, 1 << 31, 300, dtype=np.uint64)])
    p, b = np.meshgrid(ps, bs, indexing="ij")
    assert (_quotient(p, b) == p // b).all()


def test_bound_matches_the_block_index_test():
    rng = np.random.default_rng(7)
    ps = np.concatenate([_edges(U32 - 1), rng.integers(0, U32, 3000, dtype=np.uint64)])
    bs = np.concatenate([_edges(INT_MAX)[1:], rng.integers(1, 1 << 31, 60, dtype=np.uint64)])
    widths = np.concatenate([_edges(INT_MAX), rng.integers(0, 1 << 31, 20, dtype=np.uint64)])
    for w in widths:
        p, b = np.meshgrid(ps, bs, indexing="ij")
        assert ((p < _lim(np.uint64(w), b)) == (p // b < w)).all(), int(w)


def test_positions_stay_inside_the_32_bit_path():
    # the largest position: the owner's seq_lens_decoder (<= INT_MAX) plus its last token's
    # offset (< C <= INT_MAX); one below the value the bound calls out of range for every width
    assert INT_MAX + (INT_MAX - 1) <= U32 - 1
