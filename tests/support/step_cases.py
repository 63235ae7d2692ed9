"""Step inputs for the tests: the spec's worked examples, named edge cases, random
steps, and a naive per-token oracle that the vectorised reference is checked against."""

from __future__ import annotations

import functools

import numpy as np

from kvaddr.errors import NO_ERROR_KEY, error_key

I32 = np.int32
BIG_BLOCK = 2**31 - 1


def _a(x):
    return np.asarray(x, dtype=I32)


# (name, inputs, expected outputs) of SPEC.md's worked examples; B = 4, C = 8.
WORKED_EXAMPLES = [
    (
        "example-1",
        dict(
            seq_lens_decoder=_a([5, 0, 9]),
            seq_lens_this_time=_a([1, 3, 2]),
            block_tables=_a([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]]),
            block_sizes=[4],
            capacity=8,
        ),
        dict(
            cu_seqlens_q=[0, 1, 4, 6],
            num_tokens=6,
            seq_lens_kv=[6, 3, 11],
            position_ids=[5, 0, 1, 2, 9, 10, 0, 0],
            batch_id_per_token=[0, 1, 1, 1, 2, 2, -1, -1],
            slot_mapping=[[9, 16, 17, 18, 33, 34, -1, -1]],
            error_mask=0,
        ),
    ),
    (
        "example-2",
        dict(
            seq_lens_decoder=_a([5, 14, 3]),
            seq_lens_this_time=_a([1, 3, 1]),
            block_tables=_a([[7, 2, -1, -1], [4, 6, 5, 9], [1, -1, -1, -1]]),
            block_sizes=[4],
            capacity=8,
        ),
        dict(position_ids=[5, 14, 15, 16, 3, 0, 0, 0], slot_mapping=[[9, 38, 39, -1, 7, -1, -1, -1]], error_mask=1),
    ),
]


def naive_reference(seq_lens_decoder, seq_lens_this_time, block_tables, block_sizes, capacity):
    """A per-request, per-token Python loop: an independent oracle for reference.py."""
    dec = [int(x) for x in seq_lens_decoder]
    q = [int(x) for x in seq_lens_this_time]
    tables = block_tables if isinstance(block_tables, (list, tuple)) else [block_tables] * len(block_sizes)
    G = len(block_sizes)
    cu, kv = [0], []
    batch, pos = [-1] * capacity, [0] * capacity
    slots = [[-1] * capacity for _ in range(G)]
    mask, keys = 0, []
    t = 0
    for b in range(len(dec)):
        bad = dec[b] < 0 or q[b] < 0
        n = 0 if bad else q[b]
        start = min(cu[-1], 2**31 - 1)
        if bad:
            mask |= 8
            keys.append(error_key(start, b, 0, 8))
        kv.append(0 if bad else min(dec[b] + q[b], 2**31 - 1))
        for i in range(n):
            if t >= capacity:
                if t == capacity:
                    mask |= 4
                    keys.append(error_key(capacity, b, 0, 4))
                t += 1
                continue
            p = dec[b] + i
            batch[t], pos[t] = b, p
            for g in range(G):
                B = block_sizes[g]
                tab = tables[g]
                if p // B >= tab.shape[1]:
                    mask |= 1
                    keys.append(error_key(t, b, g, 1))
                elif tab[b, p // B] < 0:
                    mask |= 2
                    keys.append(error_key(t, b, g, 2))
                else:
                    slots[g][t] = int(tab[b, p // B]) * B + p % B
            t += 1
        cu.append(cu[-1] + n)
    return dict(
        cu_seqlens_q=[min(c, 2**31 - 1) for c in cu],
        num_tokens=min(cu[-1], capacity),
        seq_lens_kv=kv,
        batch_id_per_token=batch,
        position_ids=pos,
        slot_mapping=slots,
        error_mask=mask,
        error_key=min(keys) if keys else NO_ERROR_KEY,
    )


def random_step(
    rng: np.random.Generator,
    *,
    bsz=None,
    max_bsz=64,
    block_sizes=None,
    num_caches=None,
    shared_table=None,
    errors=False,
    over_capacity=False,
    big_ids=False,
    mix=None,
    uniform=None,
):
    """One random step: decode, speculative, chunked prefill and idle requests mixed.

    ``uniform=n`` makes every request run n tokens (plain decode for 1, uniform
    speculative decoding or equal prefill chunks above): the fused kernel's no-scan
    path, which errors (a negative length, too many tokens) push back to the scan.

    Returns a dict of step_addressing's keyword arguments (NumPy int32 inputs).
    """
    if bsz is None:
        bsz = int(rng.integers(0, max_bsz + 1))
    if num_caches is None:
        num_caches = int(rng.integers(1, 5))
    if block_sizes is None:
        block_sizes = [
            int(rng.choice([1, 2, 3, 16, 64, 96, 256, int(rng.integers(1, 300))])) for _ in range(num_caches)
        ]
    if shared_table is None:
        shared_table = bool(rng.integers(0, 2)) and len(set(block_sizes)) == 1
    mix = mix or ("decode", "spec", "prefill", "idle", "continue")
    kinds = rng.choice(mix, size=bsz)
    dec = np.zeros(bsz, dtype=np.int64)
    q = np.zeros(bsz, dtype=np.int64)
    enc = np.zeros(bsz, dtype=np.int64)
    for b, kind in enumerate(kinds):
        if kind == "decode":
            dec[b], q[b] = rng.integers(0, 5000), 1
        elif kind == "spec":
            dec[b], q[b] = rng.integers(0, 5000), 1 + rng.integers(1, 4)
        elif kind == "prefill":
            dec[b], q[b] = 0, rng.integers(1, 300)
            enc[b] = q[b]
        elif kind == "continue":  # chunked prefill continuation: encoder > 0 and decoder > 0
            dec[b], q[b] = rng.integers(1, 3000), rng.integers(1, 300)
            enc[b] = q[b]
        else:  # idle slot
            dec[b], q[b] = rng.integers(0, 2) * rng.integers(0, 100), 0
    if uniform is not None:
        q[:] = uniform
        enc[:] = 0
    total = int(q.sum())
    if over_capacity and total > 1:
        capacity = int(rng.integers(1, total))
    else:
        capacity = max(1, total + int(rng.integers(0, 40)))
    tables = []
    for g, B in enumerate(block_sizes):
        if shared_table and g > 0:
            tables.append(tables[0])
            continue
        need = (dec + q + B - 1) // B
        width = int(max(1, need.max(initial=1) + rng.integers(0, 3)))
        rows = bsz + int(rng.integers(0, 3))
        hi = BIG_BLOCK if big_ids else 1 << 20
        lo = hi - (1 << 16) if big_ids else 0
        t = rng.integers(lo, hi, size=(rows, width), dtype=np.int64)
        for b in range(bsz):
            t[b, need[b] :] = -1  # unallocated beyond the request's blocks
        if rng.integers(0, 4) == 0 and width > 1:  # a row-strided view: last dim contiguous only
            wide = np.full((rows, width + 3), -7, dtype=np.int64)
            wide[:, :width] = t
            t = wide.astype(I32)[:, :width]
        else:
            t = t.astype(I32)
        tables.append(t)
    if errors and bsz:
        kind = int(rng.integers(0, 4))
        b = int(rng.integers(0, bsz))
        if kind == 0:
            dec[b] = -int(rng.integers(1, 10))
        elif kind == 1:
            q[b] = -int(rng.integers(1, 10))
        elif kind == 2 and q[b] > 0:
            t = tables[0]
            col = int((dec[b] + q[b] - 1) // block_sizes[0])
            if col < t.shape[1]:
                if not t.flags.writeable:
                    t = tables[0] = t.copy()
                t[b, col] = -1
        elif kind == 3 and q[b] > 0:
            dec[b] += tables[0].shape[1] * block_sizes[0]  # beyond the table's width
    if shared_table:
        tables = [tables[0]] * len(block_sizes)
    return dict(
        seq_lens_decoder=dec.astype(I32),
        seq_lens_this_time=q.astype(I32),
        seq_lens_encoder=enc.astype(I32),
        block_tables=tables[0] if shared_table else tables,
        block_sizes=list(block_sizes),
        capacity=capacity,
    )


def edge_cases():
    """Named edge cases of the spec (name -> step kwargs): a fresh copy each call (the cases are built
    once; collection alone asks for them dozens of times)."""
    memo: dict = {}
    return {name: _fresh(case, memo) for name, case in _edge_cases().items()}


def _fresh(value, memo: dict):
    """A copy of ``value`` (dicts, lists and arrays) that keeps each array's strides (a row-strided
    table stays row-strided) and which objects are shared."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        out = {k: _fresh(v, memo) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        out = type(value)(_fresh(v, memo) for v in value)
    elif isinstance(value, np.ndarray):
        base = value.base if isinstance(value.base, np.ndarray) else None
        if base is None or value.flags.c_contiguous:
            out = value.copy()
        else:  # a view into a larger buffer: copy the buffer, view it the same way
            buf = base.copy()
            offset = value.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            out = np.ndarray(value.shape, value.dtype, buffer=buf, offset=offset, strides=value.strides)
    else:
        return value
    memo[id(value)] = out
    return out


@functools.cache
def _edge_cases():
    rng = np.random.default_rng(20261129)
    cases = {}
    cases["empty-batch"] = dict(
        seq_lens_decoder=_a([]),
        seq_lens_this_time=_a([]),
        block_tables=np.zeros((0, 4), I32),
        block_sizes=[16],
        capacity=8,
    )
    cases["all-idle"] = dict(
        seq_lens_decoder=_a([0, 7, 0]),
        seq_lens_this_time=_a([0, 0, 0]),
        block_tables=_a([[1, 2], [3, 4], [5, 6]]),
        block_sizes=[16],
        capacity=4,
    )
    cases["idle-between"] = dict(
        seq_lens_decoder=_a([3, 0, 0, 40, 0]),
        seq_lens_this_time=_a([1, 0, 0, 2, 0]),
        block_tables=_a([[9, -1, -1], [-1, -1, -1], [-1, -1, -1], [1, 2, 3], [-1, -1, -1]]),
        block_sizes=[16],
        capacity=6,
    )
    cases["speculative"] = dict(
        seq_lens_decoder=_a([62, 127]),
        seq_lens_this_time=_a([3, 2]),
        block_tables=_a([[5, 8, -1], [2, 4, 6]]),
        block_sizes=[64],
        capacity=5,
    )
    cases["chunked-prefill-continuation"] = dict(
        seq_lens_decoder=_a([96, 10]),
        seq_lens_this_time=_a([100, 1]),
        seq_lens_encoder=_a([100, 0]),
        block_tables=_a([[3, 1, 4, 1], [5, 9, 2, 6]]),
        block_sizes=[96],
        capacity=101,
    )
    for B in (1, 16, 64, 96, 256):
        cases[f"block-size-{B}"] = random_step(rng, bsz=40, block_sizes=[B, B], shared_table=True)
    cases["two-tables"] = random_step(rng, bsz=33, block_sizes=[64, 16], shared_table=False)
    cases["four-caches"] = random_step(rng, bsz=20, block_sizes=[1, 7, 64, 96], shared_table=False)
    cases["block-ids-near-2^31"] = random_step(rng, bsz=50, block_sizes=[64, 256], big_ids=True)
    cases["block-id-2^31-1-B-64"] = dict(
        seq_lens_decoder=_a([63, 64]),
        seq_lens_this_time=_a([1, 1]),
        block_tables=_a([[BIG_BLOCK, BIG_BLOCK], [BIG_BLOCK - 1, BIG_BLOCK]]),
        block_sizes=[64],
        capacity=2,
    )
    cases["over-capacity"] = random_step(rng, bsz=30, over_capacity=True, mix=("decode", "prefill"))
    cases["1025-decode"] = random_step(rng, bsz=1025, block_sizes=[64, 64], shared_table=True, mix=("decode",))
    cases["5000-mixed"] = random_step(rng, bsz=5000, block_sizes=[64], mix=("decode", "spec", "idle"))
    cases["9000-mixed-errors"] = random_step(
        rng, bsz=9000, block_sizes=[16, 64], errors=True, mix=("decode", "spec", "idle", "prefill")
    )
    cases["16384-decode"] = random_step(rng, bsz=16384, block_sizes=[64, 64], shared_table=True, mix=("decode",))
    cases["256-requests-16k-tokens"] = random_step(rng, bsz=256, block_sizes=[64], mix=("prefill", "continue"))
    # Uniform batches (every request runs the same number of tokens): the no-scan path.
    cases["uniform-decode-4096"] = random_step(rng, bsz=4096, block_sizes=[64, 64], shared_table=True, uniform=1)
    cases["uniform-mtp-2-B96"] = random_step(rng, bsz=700, block_sizes=[96], uniform=2)
    cases["uniform-chunks-64-16k"] = random_step(rng, bsz=256, block_sizes=[64, 16], shared_table=False, uniform=64)
    cases["uniform-7-table-errors"] = random_step(rng, bsz=90, block_sizes=[3, 64], uniform=7, errors=True)
    cases["uniform-idle"] = random_step(rng, bsz=100, block_sizes=[16], uniform=0)
    cases["uniform-over-capacity"] = random_step(rng, bsz=50, block_sizes=[16], uniform=3, over_capacity=True)
    cases["uniform-table-errors"] = dict(
        seq_lens_decoder=_a([5, 20, 40]),
        seq_lens_this_time=_a([1, 1, 1]),
        block_tables=_a([[7, 2], [4, -1], [3, 3]]),
        block_sizes=[16],
        capacity=3,
    )
    cases["uniform-negative-length"] = dict(
        seq_lens_decoder=_a([4, 9]),
        seq_lens_this_time=_a([-3, -3]),
        block_tables=_a([[1], [2]]),
        block_sizes=[16],
        capacity=2,
    )
    cases["uniform-but-one-bad"] = dict(
        seq_lens_decoder=_a([4, -3, 2, 9]),
        seq_lens_this_time=_a([1, 1, 1, 1]),
        block_tables=_a([[1], [2], [3], [4]]),
        block_sizes=[16],
        capacity=4,
    )
    # One case per error bit.
    cases["error-1-block-index"] = WORKED_EXAMPLES[1][1]
    cases["error-2-negative-block"] = dict(
        seq_lens_decoder=_a([5, 20]),
        seq_lens_this_time=_a([1, 1]),
        block_tables=_a([[7, 2], [4, -1]]),
        block_sizes=[16],
        capacity=2,
    )
    cases["error-4-capacity"] = dict(
        seq_lens_decoder=_a([0, 0]),
        seq_lens_this_time=_a([3, 4]),
        block_tables=_a([[1], [2]]),
        block_sizes=[16],
        capacity=5,
    )
    cases["error-8-negative-length"] = dict(
        seq_lens_decoder=_a([4, -3, 2]),
        seq_lens_this_time=_a([1, 1, -1]),
        block_tables=_a([[1], [2], [3]]),
        block_sizes=[16],
        capacity=3,
    )
    return cases


def million_token_step():
    """16 requests carrying 1M tokens of prefill (capacity 2**20)."""
    q = np.full(16, 2**16, dtype=I32)
    dec = np.arange(16, dtype=I32) * 100
    B = 256
    width = int((dec.max() + q.max()) // B + 1)
    rng = np.random.default_rng(7)
    table = rng.permutation(16 * width).astype(I32).reshape(16, width)
    return dict(seq_lens_decoder=dec, seq_lens_this_time=q, block_tables=table, block_sizes=[B], capacity=2**20)
