"""The vLLM step's configuration, its outputs and the host-side checks of its inputs.

Shared by the reference (NumPy arrays) and :class:`~kvaddr.engines.vllm.VllmStepPlanner`
(device arrays): both describe an argument as an :class:`~kvaddr.validation.ArrayInfo`
and check it here, so both raise the same message naming the argument.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvaddr.engines.vllm_errors import VLLM_MAX_REQUESTS
from kvaddr.outputs import ATTENTION_FIELDS
from kvaddr.validation import INT32_MAX, ArrayInfo, check_int

INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
#: At most this many KV-cache groups (the kernel's parameter block holds four).
VLLM_MAX_GROUPS = 4

OUTPUT_FIELDS = ("positions", "seq_lens", "slot_mappings", "input_block_tables", "dcp_local_seq_lens")


def _flags(name: str, value, n: int, kind, default) -> tuple:
    if value is None:
        return (default,) * n
    if isinstance(value, (bool, numbers.Integral)) and not isinstance(value, (list, tuple)):
        value = [value] * n
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of {n} values (one per group), got {value!r}")
    if len(value) != n:
        raise ValueError(f"{name} must hold one value per group ({n}), got {len(value)}")
    out = []
    for g, v in enumerate(value):
        if kind is bool:
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{name}[{g}] must be a bool, got {v!r}")
            out.append(bool(v))
        else:
            out.append(check_int(f"{name}[{g}]", v, lo=0, hi=INT32_MAX))
    return tuple(out)


@dataclass(frozen=True)
class VllmStepConfig:
    """What a vLLM step is sized and configured for (fixed at construction).

    Parameters
    ----------
    max_num_reqs : int
        Rows of the request state (``num_computed_tokens``, block tables) and the
        largest batch; every per-request output has this length. ``1 <= . < 2**24``.
    max_num_batched_tokens : int
        T, the token capacity: ``positions`` and each slot-mapping row have T entries.
    block_sizes : sequence of int
        B of each KV-cache group (1 to 4 groups), each >= 1.
    widths : sequence of int
        Columns (``max_blocks_g``) of each group's block table, each >= 1.
    slot_mapping_enabled : bool or sequence of bool, default all True
        False: every slot of the group is -1.
    dcp_sharded : bool or sequence of bool, default all True
        False: the group uses plain addressing on every DCP rank.
    sliding_window_reach : int or sequence of int, default all 0
        R > 0: gathered entries ``j < max(num_computed_tokens - R, 0) // B`` are 0.
        Must be 0 for a sharded group when ``cp_size > 1``.
    cp_size, cp_rank, cp_interleave : int
        Decode context parallelism: ranks, this rank, interleave I (I divides every
        sharded group's B). ``cp_size = 1`` turns DCP off.
    slot_dtype : numpy dtype, default int64
        ``np.int64`` or ``np.int32`` for ``slot_mappings`` (int32: a slot that does
        not fit sets an error bit and is written as -1).
    """

    max_num_reqs: int
    max_num_batched_tokens: int
    block_sizes: tuple
    widths: tuple
    slot_mapping_enabled: Any = None
    dcp_sharded: Any = None
    sliding_window_reach: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    slot_dtype: Any = np.int64
    num_groups: int = field(init=False)

    def __post_init__(self):
        s = object.__setattr__
        s(self, "max_num_reqs", check_int("max_num_reqs", self.max_num_reqs, lo=1, hi=VLLM_MAX_REQUESTS - 1))
        s(
            self,
            "max_num_batched_tokens",
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, lo=1, hi=INT32_MAX - 1),
        )
        bs = self.block_sizes
        if isinstance(bs, numbers.Integral) and not isinstance(bs, bool):
            bs = [bs]
        if not isinstance(bs, Sequence) or isinstance(bs, (str, bytes)):
            raise TypeError(f"block_sizes must be a sequence of ints >= 1 (one per group), got {bs!r}")
        if not 1 <= len(bs) <= VLLM_MAX_GROUPS:
            raise ValueError(f"block_sizes must name 1 to {VLLM_MAX_GROUPS} groups, got {len(bs)}")
        n = len(bs)
        s(self, "num_groups", n)
        s(self, "block_sizes", tuple(check_int(f"block_sizes[{g}]", b, lo=1, hi=INT32_MAX) for g, b in enumerate(bs)))
        w = self.widths
        if isinstance(w, numbers.Integral) and not isinstance(w, bool):
            w = [w] * n
        if not isinstance(w, Sequence) or isinstance(w, (str, bytes)) or len(w) != n:
            raise ValueError(f"widths must hold one int >= 1 per group ({n}), got {w!r}")
        s(self, "widths", tuple(check_int(f"widths[{g}]", x, lo=1, hi=INT32_MAX) for g, x in enumerate(w)))
        s(self, "slot_mapping_enabled", _flags("slot_mapping_enabled", self.slot_mapping_enabled, n, bool, True))
        s(self, "dcp_sharded", _flags("dcp_sharded", self.dcp_sharded, n, bool, True))
        s(self, "sliding_window_reach", _flags("sliding_window_reach", self.sliding_window_reach, n, int, 0))
        s(self, "cp_size", check_int("cp_size", self.cp_size, lo=1, hi=1 << 16))
        s(self, "cp_rank", check_int("cp_rank", self.cp_rank, lo=0, hi=self.cp_size - 1))
        s(self, "cp_interleave", check_int("cp_interleave", self.cp_interleave, lo=1, hi=INT32_MAX))
        dt = np.dtype(self.slot_dtype)
        if dt not in (INT64, INT32):
            raise TypeError(f"slot_dtype must be int64 or int32, got {dt}")
        s(self, "slot_dtype", dt)
        for g in range(n):
            if not self.sharded(g):
                continue
            B = self.block_sizes[g]
            if B % self.cp_interleave:
                raise ValueError(f"cp_interleave must divide block_sizes[{g}] = {B}, got {self.cp_interleave}")
            if B * self.cp_size > INT32_MAX:
                raise ValueError(f"block_sizes[{g}] * cp_size must be < 2**31, got {B} * {self.cp_size}")
            if self.sliding_window_reach[g]:
                raise ValueError(
                    f"sliding_window_reach[{g}] must be 0 for a DCP-sharded group when cp_size > 1, "
                    f"got {self.sliding_window_reach[g]}"
                )

    def sharded(self, g: int) -> bool:
        """Whether group g is split across the DCP ranks."""
        return self.cp_size > 1 and self.dcp_sharded[g]


@dataclass
class VllmStepOutputs:
    """Every output of a vLLM step (NumPy or device arrays).

    Attributes
    ----------
    positions : int64 [max_num_batched_tokens]
        ``num_computed_tokens[r] + i`` for token i of request b (row r); 0 elsewhere.
    seq_lens : int32 [max_num_reqs]
        ``num_computed_tokens[r] + (qsl[b+1] - qsl[b])`` for a real request; 0 elsewhere.
    slot_mappings : int64 (or int32) [G, max_num_batched_tokens]
        Each group's slot of each token; -1 for padding, dummy or skipped
        requests, disabled groups, non-local DCP tokens and bad addresses.
    input_block_tables : tuple of G int32 [max_num_reqs, width_g]
        Batch-order rows: row b holds the first ``num_blocks_g[r]`` block ids of
        row r (sliding-window entries nulled) and zeros after them; rows of
        dummy, skipped and padding requests are all zero.
    dcp_local_seq_lens : int32 [max_num_reqs]
        This rank's share of ``seq_lens`` (equal to it without DCP).

    A planner's outputs are its persistent buffers (or the caller's ``out=``
    tensors): the next call overwrites them.
    """

    positions: Any
    seq_lens: Any
    slot_mappings: Any
    input_block_tables: tuple
    dcp_local_seq_lens: Any
    #: The attention metadata (:class:`VllmAttentionOutputs`) when the planner was built with
    #: ``attention=``; None otherwise. Not an ``out=`` field (the planner owns those buffers).
    attention: Any = None
    #: The DSA outputs (:class:`~kvaddr.outputs.DsaOutputs`, docs/dsa.md) when the planner was
    #: built with ``dsa=True``; None otherwise. Not an ``out=`` field (the planner owns them).
    dsa: Any = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in OUTPUT_FIELDS}


#: Fields of :class:`VllmAttentionOutputs`, in order: the core step's (:data:`kvaddr.outputs.ATTENTION_FIELDS`).
VLLM_ATTENTION_FIELDS = ATTENTION_FIELDS


@dataclass
class VllmAttentionOutputs:
    """The vLLM step's attention metadata (docs/vllm.md, "Attention metadata").

    M = max_num_reqs, G groups, N = kv_indices_capacity; ``L_bg`` = ``seq_lens[b]``, or
    ``dcp_local_seq_lens[b]`` for a DCP-sharded group (``cp_size > 1``); 0 for a dummy,
    skipped or padding request. Fields of a group not asked for are None.

    Attributes
    ----------
    qo_indptr : int32 [M + 1]
        ``query_start_loc[b]`` for b <= num_reqs, ``query_start_loc[num_reqs]`` after
        (flashinfer or varlen; FlashAttention's ``cu_seqlens_q``).
    kv_indptr : int32 [G, M + 1]
        Prefix sums of ``ceil(L_bg / B_g)`` from 0, saturating; constant past num_reqs.
    kv_indices : int32 [G, N]
        Request by request, the first ``ceil(L_bg / B_g)`` entries of the gathered row b;
        -1 from ``kv_indptr[g, M]`` to N and for a bad entry.
    kv_last_page_len : int32 [G, M]
        ``(L_bg - 1) % B_g + 1`` for ``L_bg > 0``, else 0.
    cu_seqlens_k : int32 [G, M + 1]
        Prefix sums of ``L_bg`` from 0, saturating.
    seqused_k : tuple of G int32 [M]
        ``L_bg``: the step's own ``seq_lens`` (or ``dcp_local_seq_lens`` for a sharded
        group), the same buffer, no copy (FlashMLA's ``cache_seqlens``).
    max_seqlen_q : int32 scalar (0-d)
        Max over b < num_reqs of ``max(qsl[b+1] - qsl[b], 0)``.
    max_seqlen_k : int32 [G]
        Max over b of ``L_bg``.
    page_table : tuple of G int32 [M, W_g]
        The gathered block tables (``input_block_tables``), the same buffers.
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
        return {name: getattr(self, name) for name in VLLM_ATTENTION_FIELDS}


# -- argument checks ---------------------------------------------------------------


def _dtype_text(dtypes) -> str:
    return " or ".join(str(d) for d in dtypes)


def _text(shape_text) -> str:
    return shape_text() if callable(shape_text) else shape_text


def check_vector(
    name: str,
    info: ArrayInfo,
    *,
    dtypes=(INT32,),
    length: int | None = None,
    min_length: int | None = None,
    shape_text,
    device: int | None = None,
) -> ArrayInfo:
    """A 1-D contiguous array of one of ``dtypes``; exact or minimum length.

    ``shape_text`` (a str, or a callable returning one) is used only in the message,
    which is built only on failure (this runs on every call of a planner).
    """
    if info.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_text(dtypes)} with shape {_text(shape_text)}, got dtype {info.dtype}")
    shape = info.shape
    if (
        len(shape) != 1
        or (length is not None and shape[0] != length)
        or (min_length is not None and shape[0] < min_length)
    ):
        raise ValueError(f"{name} must be {_dtype_text(dtypes)} with shape {_text(shape_text)}, got shape {shape}")
    n = shape[0]
    if n > 1 and info.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous, got a strided view (stride {info.strides[0]} elements)")
    _check_device(name, info, device)
    return info


def check_matrix(
    name: str,
    info: ArrayInfo,
    *,
    dtypes=(INT32,),
    min_rows: int,
    rows: int | None = None,
    cols: int,
    shape_text,
    device: int | None = None,
) -> ArrayInfo:
    """A 2-D array with a contiguous last dim, non-overlapping rows, given columns."""
    if info.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_text(dtypes)} with shape {_text(shape_text)}, got dtype {info.dtype}")
    shape = info.shape
    if len(shape) != 2 or shape[1] != cols or shape[0] < min_rows or (rows is not None and shape[0] != rows):
        raise ValueError(f"{name} must be {_dtype_text(dtypes)} with shape {_text(shape_text)}, got shape {shape}")
    r, c = shape
    if c > 1 and info.strides[1] != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim, got a last-dim stride of {info.strides[1]} elements "
            f"(a transposed or strided view)"
        )
    if r > 1 and info.strides[0] < c:
        raise ValueError(f"{name} must not have overlapping rows, got row stride {info.strides[0]} for {c} columns")
    _check_device(name, info, device)
    return info


def _check_device(name: str, info: ArrayInfo, device: int | None) -> None:
    if device is not None and info.device != device and info.device != -2:
        where = "host memory" if info.device < 0 else f"device {info.device}"
        raise ValueError(f"{name} must be on CUDA device {device}, got an array in {where}")


def _is_array(x) -> bool:
    return hasattr(x, "shape") or hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")


def per_group(name: str, value, num_groups: int, *, allow_stacked: bool) -> list:
    """One array per group: a sequence of ``num_groups`` arrays, or one array.

    With ``allow_stacked`` a single 2-D array ``[G, rows]`` stands for G rows (vLLM
    keeps ``num_blocks`` that way); the caller splits it. Without it a single array
    is accepted only for one group.
    """
    if _is_array(value):
        if allow_stacked or num_groups == 1:
            return [value]
        raise ValueError(f"{name} must be a sequence of {num_groups} arrays (one per group), got one array")
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"{name} must be a sequence of {num_groups} arrays (one per group), got {len(value)}")
        return list(value)
    raise TypeError(
        f"{name} must be an array or a sequence of {num_groups} arrays, got "
        f"{type(value).__module__}.{type(value).__qualname__}"
    )


def check_num_reqs_padded(num_reqs_padded, num_reqs: int, max_num_reqs: int) -> int:
    if num_reqs_padded is None:
        return num_reqs
    return check_int("num_reqs_padded", num_reqs_padded, lo=num_reqs, hi=max_num_reqs)
