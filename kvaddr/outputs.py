"""The outputs of one step's addressing (the spec's output table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvaddr.constants import PAD_SLOT_ID as PAD_SLOT_ID  # re-exported: part of the public API

OUTPUT_FIELDS = (
    "cu_seqlens_q",
    "num_tokens",
    "batch_id_per_token",
    "position_ids",
    "seq_lens_kv",
    "slot_mapping",
)


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

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in OUTPUT_FIELDS}
