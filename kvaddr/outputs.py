"""The outputs of one step's addressing (the spec's output table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvaddr.constants import PAD_SLOT_ID as PAD_SLOT_ID  # re-exported: part of the public API

#: ``kv_indices`` entry past its used length (``kv_indptr[g, bsz]``) or for a bad block:
#: "no block", the block tables' own marker of an unallocated block (docs/attention.md).
PAD_PAGE_ID = -1

#: The attention-metadata groups a planner may be asked for (docs/attention.md).
ATTENTION_GROUPS = ("flashinfer", "varlen", "page_table")

OUTPUT_FIELDS = (
    "cu_seqlens_q",
    "num_tokens",
    "batch_id_per_token",
    "position_ids",
    "seq_lens_kv",
    "slot_mapping",
)

#: Fields of :class:`AttentionOutputs`, in order; those of a group not asked for are None.
ATTENTION_FIELDS = (
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "cu_seqlens_k",
    "seqused_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "page_table",
)

#: Which fields each group of :data:`ATTENTION_GROUPS` fills.
ATTENTION_GROUP_FIELDS = {
    "flashinfer": ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"),
    "varlen": ("cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k"),
    "page_table": ("page_table",),
}


@dataclass
class StepOutputs:
    """Every output of the spec for one step (NumPy or CuPy arrays).

    Attributes
    ----------
    cu_seqlens_q : int32 [bsz + 1]
        Prefix sum of the requests' token counts, starting at 0.
    num_tokens : int32 scalar (0-d array)
        ``cu_seqlens_q[bsz]`` capped at the capacity C.
    batch_id_per_token : int32 [C]
        The request of each token; -1 for padding.
    position_ids : int64 [C] (int32 when asked for)
        ``seq_lens_decoder[b] + i``; 0 for padding.
    seq_lens_kv : int32 [bsz]
        ``seq_lens_decoder[b] + seq_lens_this_time[b]``.
    slot_mapping : int64 [num_caches, C]
        ``block_tables[b, pos // B] * B + pos % B``; -1 (PAD_SLOT_ID) for
        padding and for bad tokens.

    The device strategies return views of buffers they own: the next call
    overwrites them. Copy what must outlive the step.
    """

    cu_seqlens_q: Any
    num_tokens: Any
    batch_id_per_token: Any
    position_ids: Any
    seq_lens_kv: Any
    slot_mapping: Any
    #: The attention metadata (:class:`AttentionOutputs`) when the step was asked for it, else None.
    attention: Any = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in OUTPUT_FIELDS}


@dataclass
class AttentionOutputs:
    """Attention-backend metadata of one step (docs/attention.md), NumPy or CuPy arrays.

    ``L_b = seq_lens_kv[b]`` (the request's KV length after the step), ``B_g`` the
    block size of cache g, ``n_bg = ceil(L_b / B_g)`` its pages, G caches, N the
    ``kv_indices`` capacity. A group not asked for leaves its fields None.

    Attributes
    ----------
    qo_indptr : int32 [bsz + 1]
        ``cu_seqlens_q`` (flashinfer).
    kv_indptr : int32 [G, bsz + 1]
        Prefix sum of ``n_bg`` over requests, from 0, saturating at 2**31 - 1
        (the true sums even when they pass N) (flashinfer).
    kv_indices : int32 [G, N]
        Request by request, the first ``n_bg`` block ids of its row;
        ``PAD_PAGE_ID`` (-1) past ``kv_indptr[g, bsz]``, for an entry beyond the
        row (bit 1) and for a negative block id (bit 2); entries at index >= N
        are dropped (bit 16) (flashinfer).
    kv_last_page_len : int32 [G, bsz]
        ``(L_b - 1) % B_g + 1`` for ``L_b > 0``, 0 for ``L_b = 0`` (flashinfer).
    cu_seqlens_k : int32 [bsz + 1]
        Prefix sum of ``L_b``, from 0, saturating at 2**31 - 1 (varlen).
    seqused_k : int32 [bsz]
        ``L_b`` (``seq_lens_kv``; FlashMLA's ``cache_seqlens``) (varlen).
    max_seqlen_q, max_seqlen_k : int32 scalars (0-d arrays)
        Largest ``cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` and largest ``L_b``;
        0 for an empty batch (varlen).
    page_table : tuple of G int32 arrays [bsz, max_blocks_g]
        The batch-order rows of each cache's table: rows ``[0, bsz)`` of the
        table itself (a view, no copy) (page_table).
    """

    qo_indptr: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_last_page_len: Any = None
    cu_seqlens_k: Any = None
    seqused_k: Any = None
    max_seqlen_q: Any = None
    max_seqlen_k: Any = None
    page_table: Any = None

    def as_dict(self) -> dict:
        """The fields that are not None."""
        return {name: getattr(self, name) for name in ATTENTION_FIELDS if getattr(self, name) is not None}
