"""Shared by the torch-op attention tests (CPU and GPU): run ``kvaddr.torch.step`` with attention
outputs on a step case and compare with the reference (docs/attention.md)."""

from __future__ import annotations

import itertools

import numpy as np

from kvaddr.outputs import ATTENTION_FIELDS, ATTENTION_GROUPS, AttentionOutputs
from kvaddr.reference import step_addressing

#: Every non-empty subset of the attention groups.
GROUP_SETS = [c for n in range(1, 4) for c in itertools.combinations(ATTENTION_GROUPS, n)]


def reference(case, attention, kv_indices_capacity, position_dtype=np.int64):
    """The reference step (addressing and attention) of a case."""
    return step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
        position_dtype=position_dtype,
        attention=attention,
        kv_indices_capacity=kv_indices_capacity,
    )


def total_pages(case) -> int:
    """The largest kv_indptr[g, bsz] of a case (the kv_indices entries its caches need)."""
    dec = np.maximum(np.asarray(case["seq_lens_decoder"], np.int64), 0)
    q = np.asarray(case["seq_lens_this_time"], np.int64)
    L = np.where((np.asarray(case["seq_lens_decoder"]) < 0) | (q < 0), 0, dec + np.maximum(q, 0))
    return max([int((-(-L // b)).sum()) for b in case["block_sizes"]], default=0)


def host_attention(a) -> AttentionOutputs:
    """An AttentionOutputs of torch tensors (any device) as NumPy arrays (page_table: a tuple)."""
    out = AttentionOutputs()
    for f in ATTENTION_FIELDS:
        v = getattr(a, f)
        if v is None:
            continue
        if f == "page_table":
            v = tuple(t.cpu().numpy() for t in v)
        else:
            v = v.cpu().numpy()
        setattr(out, f, v)
    return out


def poison(buffers) -> None:
    """Garbage in every output of a StepBuffers (the op must rewrite what it promises)."""
    for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping"):
        getattr(buffers, name).fill_(0x5A5A5A5A)
    buffers.num_tokens.fill_(-77)
    for name in ("kv_indptr", "kv_last_page_len", "kv_indices", "cu_seqlens_k", "max_seqlen"):
        t = getattr(buffers, name)
        if t is not None:
            t.fill_(0x3C3C3C3C)


#: Every attention group.
ALL = ("flashinfer", "varlen", "page_table")


def _a(x):
    return np.asarray(x, dtype=np.int32)


#: docs/attention.md's worked examples, as step cases (the CPU and GPU op tests share them).
EXAMPLE_1 = dict(
    seq_lens_decoder=_a([5, 0, 9]),
    seq_lens_this_time=_a([1, 3, 2]),
    block_tables=_a([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]]),
    block_sizes=[4],
    capacity=8,
)
EXAMPLE_2 = dict(
    seq_lens_decoder=_a([8, 0, 3, 0]),
    seq_lens_this_time=_a([0, 4, 2, 0]),
    block_tables=[
        _a([[5, 6, -1], [9, -1, -1], [2, 0, -1], [-1, -1, -1]]),
        _a([[10, 11, 12, 13], [14, 15, -1, -1], [16, 17, 18, -1], [-1, -1, -1, -1]]),
    ],
    block_sizes=[4, 2],
    capacity=8,
)
EXAMPLE_3 = dict(
    seq_lens_decoder=_a([5, 12]),
    seq_lens_this_time=_a([0, 1]),
    block_tables=_a([[3, -1, -1], [1, 2, 4]]),
    block_sizes=[4],
    capacity=4,
)
