"""The end-to-end check of the top-k -> slot conversion, shared by the CPU (tests/unit) and GPU
(tests/gpu) tests: a batch of decodes (1 + drafts query tokens each) and prefill chunks, its
history and this step written through the step's slot mapping into a paged MLA cache
(656 bytes per token), a top-k chosen from random scores inside each token's context, and the
rows gathered through the converted slots compared with the contiguous K/V at the chosen
positions."""

from __future__ import annotations

import numpy as np

#: Bytes of one token's MLA cache entry (512 fp8 + 4 fp32 scales + 64 bf16).
MLA_BYTES = 656


def make_batch(rng, *, num_decodes, num_prefills, drafts, block_size, max_context):
    """Host batch: seq_lens, query_lens (decodes first), a block table of distinct random ids,
    and every request's contiguous K/V (uint8 [seq_len, MLA_BYTES])."""
    r = num_decodes + num_prefills
    seq = rng.integers(drafts + 1, max_context + 1, size=r)
    seq[0] = drafts + 5  # a short request: its rows end in -1s
    q = np.empty(r, np.int64)
    q[:num_decodes] = drafts + 1
    q[num_decodes:] = [rng.integers(1, s + 1) for s in seq[num_decodes:]]
    width = -(-max_context // block_size)
    ids = rng.permutation(r * width + 7)[: r * width].reshape(r, width).astype(np.int32)
    kv = [rng.integers(0, 256, size=(int(s), MLA_BYTES), dtype=np.uint8) for s in seq]
    return {
        "seq_lens": seq.astype(np.int32),
        "query_lens": q.astype(np.int32),
        "num_decodes": num_decodes,
        "table": ids,
        "kv": kv,
        "num_blocks": r * width + 7,
    }


def choose_topk(rng, ctx, k):
    """Per token, the k highest of random scores over positions [0, ctx) (all of them, then -1s,
    when ctx <= k), in descending score order: int32 [T, k]."""
    t = len(ctx)
    out = np.full((t, k), -1, np.int32)
    for i, c in enumerate(ctx):
        c = int(c)
        scores = rng.random(c)
        order = np.argsort(-scores, kind="stable")[:k]
        out[i, : len(order)] = order
    return out


def check_gather(batch, cache, req_id, topk, slots, counts, tokens=None):
    """The gathered cache rows of each token (of ``tokens``, default all) equal its request's
    contiguous K/V at the chosen positions, in the chosen order (compacted slots); the rest of
    each row is -1."""
    for t in range(topk.shape[0]) if tokens is None else tokens:
        chosen = topk[t][topk[t] >= 0]
        n = int(counts[t])
        assert n == len(chosen), (t, n, len(chosen))
        assert (slots[t, n:] == -1).all()
        want = batch["kv"][int(req_id[t])][chosen]
        got = cache[slots[t, :n]]
        np.testing.assert_array_equal(got, want, err_msg=f"token {t}")
