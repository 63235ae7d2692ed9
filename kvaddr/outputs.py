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
    #: DeepSeek-V3.2 sparse attention's addressing (:class:`DsaOutputs`) when asked for, else None.
    dsa: Any = None

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


#: Fields of :class:`DsaOutputs`, in order.
DSA_FIELDS = ("value_offsets", "scale_offsets", "ks", "ke", "ctx", "cu_seq_lens", "req_id_per_token")


@dataclass
class DsaOutputs:
    """DeepSeek-V3.2 sparse attention's per-step addressing (docs/dsa.md), NumPy or CuPy arrays.

    Token ``t`` of request ``b`` at position ``p`` (``seq_lens_decoder[b] + i``), slot ``s``
    in the indexer cache (block size ``B``, ``blk = s // B``, ``off = s % B``), ``V`` value
    and ``S`` scale bytes per token. A request running ``1 <= q <= n`` tokens is a decode,
    one running more a prefill; C is the capacity.

    Attributes
    ----------
    value_offsets : int64 [C]
        ``blk * B * (V + S) + off * V``: where the token's indexer-key values start in its
        layer's indexer cache; -1 for padding and bad tokens.
    scale_offsets : int64 [C]
        ``blk * B * (V + S) + B * V + off * S``; -1 for padding and bad tokens.
    ks : int32 [C]
        A prefill token's first key: ``cu_seq_lens[i]`` of its prefill ``i``; 0 for decode
        tokens and padding.
    ke : int32 [C]
        ``ks + p + 1`` (exclusive) for a prefill token; 0 for decode tokens and padding.
    ctx : int32 [C]
        ``p + 1``, the token's context length (a decode's ``ctx[b, j]``); 0 for padding.
    cu_seq_lens : int32 [max_requests + 1]
        ``[0, cumsum(seq_len)]`` over the P prefills in batch order
        (``seq_len = seq_lens_decoder + seq_lens_this_time``); entries past P repeat the total.
    req_id_per_token : int32 [C]
        Each token's batch row (``batch_id_per_token``, the same buffer); -1 for padding.
    """

    value_offsets: Any = None
    scale_offsets: Any = None
    ks: Any = None
    ke: Any = None
    ctx: Any = None
    cu_seq_lens: Any = None
    req_id_per_token: Any = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in DSA_FIELDS}
