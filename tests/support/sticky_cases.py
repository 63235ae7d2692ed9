"""Steps of one shape for the sticky error-record tests (docs/spec.md, "Errors"): one planner
runs all of them, so a record left by one step is seen (or not) by the next read.

``good`` has no error; ``bad_a`` a negative block id (bit 2) at request 5's token (the last
request's in a smaller batch); ``bad_b`` a position past its row (bit 1) at request 3's token
(the one before ``bad_a``'s: a smaller key) and, with more than 30 requests, a negative length
(bit 8) at request 30. Decode batches (every request one token) unless
``mixed``: then request 0 runs 3 tokens (the scan path of every kernel).
"""

from __future__ import annotations

import numpy as np

I32 = np.int32


def sticky_cases(
    *, bsz: int = 40, num_caches: int = 2, block_size: int = 16, width: int = 8, mixed=False, spare: int = 24
) -> dict:
    """``{"good": case, "bad_a": case, "bad_b": case}`` (step_addressing's keyword arguments,
    NumPy inputs), one capacity (the tokens plus ``spare``: more than 256 spreads the small-batch
    kernels over several blocks), one set of block sizes, tables of one shape; ``bsz >= 2``."""
    assert bsz >= 2, bsz
    ia = min(5, bsz - 1)
    ib = min(3, ia - 1)
    rng = np.random.default_rng(1606 + bsz + 7 * num_caches + int(mixed))
    q = np.ones(bsz, dtype=I32)
    if mixed:
        q[0] = 3
    dec = (np.arange(bsz, dtype=np.int64) * 3 % (width * block_size - 3)).astype(I32)
    tables = [rng.integers(0, 1 << 20, size=(bsz + 2, width)).astype(I32) for _ in range(num_caches)]
    base = dict(block_sizes=[block_size] * num_caches, capacity=int(q.sum()) + spare)
    good = dict(base, seq_lens_decoder=dec, seq_lens_this_time=q, block_tables=tables)
    # bad_a: request ia's block (in every cache) is -1
    ta = [t.copy() for t in tables]
    for t in ta:
        t[ia, int(dec[ia]) // block_size] = -1
    bad_a = dict(base, seq_lens_decoder=dec, seq_lens_this_time=q, block_tables=ta)
    # bad_b: request ib past its row, request 30 a negative length (when the batch has one)
    db = dec.copy()
    db[ib] = width * block_size + 5
    qb = q.copy()
    if bsz > 30:
        qb[30] = -2
    bad_b = dict(base, seq_lens_decoder=db, seq_lens_this_time=qb, block_tables=tables)
    return {"good": good, "bad_a": bad_a, "bad_b": bad_b}
