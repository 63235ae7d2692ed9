"""VllmStepPlanner: vLLM Model Runner V2's input preparation in one launch.

One call writes ``positions``, ``seq_lens``, every group's slot mapping, the
batch-order gathered block tables and the DCP local lengths, where vLLM launches
three kernels (docs/vllm.md). Every output is a persistent buffer, the planner's
or the caller's (``out=``), so an engine's captured CUDA graphs keep reading the
same addresses; a call allocates nothing and never synchronises, and is safe
inside ``torch.cuda.graph`` / CuPy stream capture.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from kvaddr import dispatch, kernel_loader
from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.engines.vllm_config import (
    INT32,
    INT64,
    VLLM_MAX_GROUPS,
    VllmAttentionOutputs,
    VllmStepConfig,
    VllmStepOutputs,
    check_matrix,
    check_num_reqs_padded,
    check_vector,
    per_group,
)
from kvaddr.engines.vllm_errors import VllmAddressingError
from kvaddr.errors import clean_error_records
from kvaddr.host import ErrorRecords, Memo, StreamResolver
from kvaddr.outputs import DsaOutputs
from kvaddr.validation import (
    INT32_MAX,
    check_int,
    describe,
    describe_mapped,
    host_memory,
    memo_guard,
    repeats,
    signature_getter,
)

if TYPE_CHECKING:
    from kvaddr.engines.vllm_bound import BoundVllmStep

__all__ = ["VllmStepConfig", "VllmStepOutputs", "VllmStepParams", "VllmStepPlanner"]

#: Threads per block of the vLLM step (VLLM_THREADS in kvaddr/kernels/vllm.cuh).
THREADS = 256
WARPS = THREADS // 32
#: Threads per program of the three-launch baseline (VLLM3_THREADS).
THREADS_3 = 128
#: Lanes per (group, row) pair of the step's block-table gather, by batch size (auto_pair_lanes).
PAIR_LANES = (8, 16, 32)
#: The automatic geometry keeps num_groups * meta_blocks at most this (2 blocks per SM of an
#: H200): every metadata block reads all num_reqs lengths (pass 1), so more blocks cost L2
#: traffic and a second wave (measured: 32 lanes x 16 rows at max_num_reqs 8192 and 2 groups,
#: 1026 blocks, 28.5 us against 17.1 us for 8 x 64, 258 blocks).
META_BLOCKS_CAP = 264


def auto_meta_rows(max_num_reqs: int, num_groups: int) -> int:
    """Batch rows per attention metadata block: the smallest of 16, 32, 64, 128, 256 with
    ``num_groups * ceil((max_num_reqs + 1) / rows) <= META_BLOCKS_CAP`` (256 if none)."""
    return next((r for r in (16, 32, 64, 128, 256) if num_groups * -(-(max_num_reqs + 1) // r) <= META_BLOCKS_CAP), 256)


#: VLLM_ATTN_* bits of kernels.cu.
ATTN_BITS = {"flashinfer": 1, "varlen": 2}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_G = VLLM_MAX_GROUPS
_IDX_DTYPES = (INT32, INT64)


def _state_signature(x) -> tuple | None:
    """``(getter, signature)`` of a remembered request-state array, or None where the
    array has no cheap exact signature (it is then remembered by identity only)."""
    getter = signature_getter((x,))
    return None if getter is None else (getter, getter(x))


def _changed(x, state_sig) -> bool:
    return state_sig is not None and state_sig[0](x) != state_sig[1]


def check_batch(idx_mapping, query_start_loc, max_num_reqs: int, device: int) -> tuple:
    """The per-step arrays checked: ``idx_mapping`` (int32 or int64 ``[num_reqs]``, contiguous,
    ``num_reqs <= max_num_reqs``) and ``query_start_loc`` (int32 ``[num_reqs + 1]``, contiguous),
    both on ``device``; their :class:`~kvaddr.validation.ArrayInfo`. compute()'s checked path and
    :meth:`BoundVllmStep.launch <kvaddr.engines.vllm_bound.BoundVllmStep.launch>` run exactly this."""
    idx = check_vector(
        "idx_mapping",
        describe("idx_mapping", idx_mapping),
        dtypes=_IDX_DTYPES,
        shape_text="(num_reqs,)",
        device=device,
    )
    n = idx.shape[0]
    if n > max_num_reqs:
        raise ValueError(f"idx_mapping must have at most max_num_reqs = {max_num_reqs} entries, got {n}")
    qsl = check_vector(
        "query_start_loc",
        describe("query_start_loc", query_start_loc),
        length=n + 1,
        shape_text=lambda: f"(num_reqs + 1,) = ({n + 1},)",
        device=device,
    )
    return idx, qsl


def check_batch_buffers(idx_mapping, query_start_loc, device: int) -> tuple:
    """The persistent batch buffers a binding takes (:meth:`VllmStepPlanner.bind`), checked once:
    ``idx_mapping`` int32 or int64 ``[rows]`` and ``query_start_loc`` int32 ``[rows' >= 1]``,
    contiguous, on ``device``; ``(idx pointer, its length, idx is int64, qsl pointer, its length)``."""
    idx = check_vector(
        "idx_mapping",
        describe("idx_mapping", idx_mapping),
        dtypes=_IDX_DTYPES,
        shape_text="(rows,) (the persistent buffer; a step uses its first num_reqs entries)",
        device=device,
    )
    qsl = check_vector(
        "query_start_loc",
        describe("query_start_loc", query_start_loc),
        min_length=1,
        shape_text="(rows + 1,) (the persistent buffer; a step uses its first num_reqs + 1 entries)",
        device=device,
    )
    return idx.ptr, idx.shape[0], idx.dtype == INT64, qsl.ptr, qsl.shape[0]


def _ndim(x) -> int:
    """Dimensions of an array-like (its ``shape``, or its ``__cuda_array_interface__``'s); 0 if neither."""
    shape = getattr(x, "shape", None)
    if shape is None:
        cai = getattr(x, "__cuda_array_interface__", None)
        shape = cai.get("shape", ()) if isinstance(cai, dict) else ()
    return len(shape)


def _describe_num_blocks(name: str, x):
    """``num_blocks`` described: a device array as :func:`~kvaddr.validation.describe` does, or
    pinned host memory (a torch ``pin_memory()`` tensor, a ``cupyx.empty_pinned`` array, a
    ``__cuda_array_interface__`` view of pinned host memory), which the kernel reads through UVA
    (:func:`~kvaddr.validation.describe_mapped`: its device pointer); pageable host memory raises
    TypeError naming the argument."""
    try:
        info = describe(name, x)
    except TypeError:
        return describe_mapped(name, x)  # host memory: pinned, or the message naming the argument
    return describe_mapped(name, x) if info.device == -1 else info


class _Items:
    """A bound list's items, equal to another only item by item by identity (never by value)."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = tuple(items)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _Items)
            and len(other.items) == len(self.items)
            and all(a is b for a, b in zip(self.items, other.items))
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"items at {[hex(id(x)) for x in self.items]}"


class VllmStepParams(ctypes.Structure):
    """Mirror of ``struct VllmStepParams`` in kernels.cu (same order, same types).

    Filled by field name, never by position; ``tests/unit/test_vllm_struct.py``
    compiles the C struct and compares every offset and the size.
    """

    _fields_ = [
        ("idx_mapping", _P),
        ("query_start_loc", _P),
        ("num_computed_tokens", _P),
        ("block_table", _P * _G),
        ("num_blocks", _P * _G),
        ("num_blocks_src", _P * _G),
        ("table_stride", _I64 * _G),
        ("positions", _P),
        ("seq_lens", _P),
        ("slot_mappings", _P),
        ("slot_stride", _I64),
        ("gathered", _P * _G),
        ("gathered_stride", _I64 * _G),
        ("dcp_local_seq_lens", _P),
        ("row_fill", _P * _G),
        ("errors", _P),
        ("width", _I32 * _G),
        ("block_size", _I32 * _G),
        ("group_flags", _I32 * _G),
        ("sliding_window_reach", _I32 * _G),
        ("num_groups", _I32),
        ("num_reqs", _I32),
        ("num_reqs_padded", _I32),
        ("max_num_reqs", _I32),
        ("max_tokens", _I32),
        ("idx_is_64", _I32),
        ("slot_is_32", _I32),
        ("cp_size", _I32),
        ("cp_rank", _I32),
        ("cp_interleave", _I32),
        ("token_blocks", _I32),
        ("request_blocks", _I32),
        ("pair_lanes", _I32),
        # attention metadata (vllm_step<true>)
        ("qo_indptr", _P),
        ("kv_indptr", _P),
        ("kv_indices", _P),
        ("kv_last_page_len", _P),
        ("cu_seqlens_k", _P),
        ("max_seqlen", _P),
        ("attention", _I32),
        ("kv_indices_capacity", _I32),
        ("meta_blocks", _I32),
        ("meta_entries", _I32),
        ("meta_rows", _I32),
        # DSA outputs (vllm_step<..., true>; kvaddr/kernels/vllm_dsa.cuh)
        ("dsa_value_offsets", _P),
        ("dsa_scale_offsets", _P),
        ("dsa_ctx", _P),
        ("dsa_ks", _P),
        ("dsa_ke", _P),
        ("dsa_cu_seq_lens", _P),
        ("dsa_req_id", _P),
        ("dsa_group", _I32),
        ("dsa_decode_len", _I32),
        ("dsa_value_bytes", _I32),
        ("dsa_scale_bytes", _I32),
    ]


GROUP_SLOTS = 1
_NO_OBJECT = object()  # matches no num_reqs_padded argument (compute()'s memo, before its first fast call)
GROUP_SHARDED = 2


class VllmStepPlanner:
    """vLLM's step inputs (positions, seq_lens, slot mappings, gathered block tables,
    DCP local lengths) in one kernel launch.

    Parameters
    ----------
    max_num_reqs : int
        Rows of the request state and the largest batch (``1 <= . < 2**24``).
    max_num_batched_tokens : int
        T, the token capacity (the length of ``positions`` and of each slot-mapping row).
    block_sizes : sequence of int
        B of each KV-cache group (1 to 4 groups).
    widths : int or sequence of int
        Columns (``max_blocks_g``) of each group's block table.
    slot_mapping_enabled, dcp_sharded : bool or sequence of bool, default all True
    sliding_window_reach : int or sequence of int, default all 0
    cp_size, cp_rank, cp_interleave : int, default 1, 0, 1
        Decode context parallelism (``cp_size = 1``: off).
    slot_dtype : numpy dtype, default int64
        ``np.int32`` makes int32 slot mappings (a slot that does not fit: error bit, -1).
    out : VllmStepOutputs or dict, optional
        Caller-owned persistent output tensors (CuPy, PyTorch or any CUDA array), any
        subset of the fields; the planner allocates the others. Shapes and dtypes as
        in :class:`VllmStepOutputs` (``input_block_tables``: one array per group).
    device : int, optional
        CUDA device ordinal (the current device by default).
    error_records : device array, optional
        Caller-owned memory for the step's error records (e.g. a view into one
        packed buffer of the caller's): int64 or uint64, C-contiguous, shape
        :meth:`error_records_shape` ``(R, 2)`` of this ``max_num_reqs`` and
        ``max_num_batched_tokens`` (with attention outputs, ``attention_blocks=``
        :attr:`attention_blocks`), on ``device`` (CuPy, PyTorch or any
        ``__cuda_array_interface__`` array). The planner clears every record here
        (``(0, no error)``) at construction; the kernel merges errors into them (sticky:
        only a warp that found one writes); :meth:`errors` / :meth:`check` read them and
        clear them again. If you read them yourself instead, clear them after each read
        (:func:`kvaddr.errors.reset_error_records`). By default the planner allocates them.
    attention : str or sequence of str, optional
        Attention metadata written by the same launch (docs/vllm.md, "Attention metadata"):
        groups among ``"flashinfer"`` (``qo_indptr``, per group ``kv_indptr``, ``kv_indices``,
        ``kv_last_page_len``), ``"varlen"`` (``qo_indptr``, per group ``cu_seqlens_k``,
        ``seqused_k``, ``max_seqlen_k``, and ``max_seqlen_q``) and ``"page_table"`` (the
        gathered tables themselves); a comma-separated str or a sequence. The buffers are the planner's (``outputs.attention``,
        :class:`~kvaddr.engines.vllm_config.VllmAttentionOutputs`).
    kv_indices_capacity : int, optional
        N, the entries of each group's ``kv_indices`` (``[G, N]``); required with
        ``"flashinfer"``. More entries than N: error bit 512, entries past N dropped.
    dsa : bool, default False
        Also write DeepSeek-V3.2 sparse attention's per-step addressing in the same launch
        (docs/dsa.md, "The vLLM step"; ``outputs.dsa``, a :class:`~kvaddr.outputs.DsaOutputs`):
        each token's indexer-cache byte offsets, context length, prefill key range ``ks`` /
        ``ke`` and batch row, and the prefills' ``cu_seq_lens``. False (default) costs nothing.
    dsa_cache : int, optional
        The group whose table, B and slots address the indexer cache; the last group by default.
    dsa_decode_len : int, default 1
        n, the query tokens of a decode (1 + speculative tokens): a request running 1 to n
        tokens is a decode, one running more a prefill.
    dsa_value_bytes, dsa_scale_bytes : int, default 128 and 4
        V and S, the value and scale bytes of one token in the indexer cache, whose blocks
        hold ``[B * V | B * S]``.

    Examples
    --------
    >>> planner = VllmStepPlanner(max_num_reqs=256, max_num_batched_tokens=8192,
    ...                           block_sizes=[16], widths=[512])
    >>> out = planner.compute(idx_mapping, query_start_loc, num_computed_tokens,
    ...                       [block_table], [num_blocks], num_reqs_padded=256, stream=s)
    >>> planner.check()  # optional: synchronises, raises VllmAddressingError on bad values
    >>> bound = planner.bind(num_computed_tokens, [block_table], [num_blocks])  # the state, checked once
    >>> out = bound.launch(idx_mapping, query_start_loc, num_reqs_padded=256, stream=s)  # per step
    """

    #: The kernel this planner launches (kvaddr.dispatch's name for it).
    kernel_name = dispatch.vllm_kernel(False)

    def __init__(
        self,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        block_sizes,
        widths,
        *,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        sliding_window_reach=None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_dtype=np.int64,
        out=None,
        device: int | None = None,
        error_records=None,
        attention=None,
        kv_indices_capacity: int | None = None,
        dsa: bool = False,
        dsa_cache: int | None = None,
        dsa_decode_len: int = 1,
        dsa_value_bytes: int = 128,
        dsa_scale_bytes: int = 4,
    ):
        import cupy

        # Attention metadata (docs/vllm.md, "Attention metadata"): the groups asked for, the
        # kernel's VLLM_ATTN_* bits (0: no metadata blocks) and N.
        self.attention = normalize_attention(attention)
        self.kv_indices_capacity = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        self._attn_bits = sum(ATTN_BITS.get(a, 0) for a in self.attention)
        if self._attn_bits and type(self)._load_functions is not VllmStepPlanner._load_functions:
            raise ValueError(f"attention needs the one-launch step, not {type(self).__name__}")
        # compute()'s memo of the last checked call (see _remember).
        self._memo: Memo | None = None
        self._last_args: tuple | None = None  # the last checked call's arguments (see _remember)
        self._memoize = True
        self._stream = StreamResolver()
        if not isinstance(dsa, (bool, np.bool_)):
            raise TypeError(f"dsa must be a bool, got {dsa!r}")
        #: DSA outputs asked for (docs/dsa.md): the launch's second grid row writes them.
        self.dsa = bool(dsa)
        if self.dsa and type(self)._load_functions is not VllmStepPlanner._load_functions:
            raise ValueError(f"dsa needs the one-launch step, not {type(self).__name__}")
        self._grid_y = 2 if self.dsa else 1
        self._grid_args = (2,) if self.dsa else ()  # the launchers' grid_y (others take none)
        if type(self)._load_functions is VllmStepPlanner._load_functions:
            self.kernel_name = dispatch.vllm_kernel(bool(self._attn_bits), self.dsa)

        self.config = cfg = VllmStepConfig(
            max_num_reqs,
            max_num_batched_tokens,
            block_sizes,
            widths,
            slot_mapping_enabled=slot_mapping_enabled,
            dcp_sharded=dcp_sharded,
            sliding_window_reach=sliding_window_reach,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
            slot_dtype=slot_dtype,
        )
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        M, T, G = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups
        if self.dsa:
            self.dsa_cache = G - 1 if dsa_cache is None else check_int("dsa_cache", dsa_cache, lo=0, hi=G - 1)
            self.dsa_decode_len = check_int("dsa_decode_len", dsa_decode_len, lo=1, hi=INT32_MAX)
            self.dsa_value_bytes = check_int("dsa_value_bytes", dsa_value_bytes, lo=1, hi=1 << 20)
            self.dsa_scale_bytes = check_int("dsa_scale_bytes", dsa_scale_bytes, lo=1, hi=1 << 20)
        self._meta_rows = meta_rows = auto_meta_rows(M, G)
        given = self._out_fields(out)
        p = self._params = VllmStepParams()
        with cupy.cuda.Device(self.device):
            self._fns = self._load_functions()
            self._device_step = self._fns.get("step")
            self._staged_step = None  # the launcher of the staged kernels, made when first needed
            # The device copy of num_blocks that the staged launch reads (num_blocks in pinned host
            # memory: vllm_stage_num_blocks, kvaddr/kernels/vllm.cuh).
            self._num_blocks_copy = cupy.zeros((G, M), dtype=np.int32) if self._one_launch else None
            self.outputs = self._make_outputs(given)
            fill = np.zeros((G, M), dtype=np.int32)
            # Entries of each gathered row that may be non-zero: none in a table the planner
            # allocated (zeros); all of them in a caller's out= table, which the first call
            # therefore zeroes in full once.
            fill[:] = np.asarray(cfg.widths, dtype=np.int32)[:, None]
            fill[[g for g in range(G) if self._own_tables[g]]] = 0
            self._row_fill = cupy.asarray(fill)
            # One record (mask, first-bad key) per warp of the token, request and metadata blocks,
            # sticky: a warp with an error merges into its own; cleared here and by errors().
            # attention: num_groups * meta_blocks more blocks, each owning meta_rows batch rows of [0, M]
            self._meta_blocks = -(-(M + 1) // meta_rows) if self._attn_bits else 0
            self._make_attention_buffers()
            self._make_dsa_buffers()
            rec = clean_error_records(self.error_records_shape(M, T, attention_blocks=G * self._meta_blocks)[0])
            self._clean_records = rec
            if error_records is None:
                self._records = cupy.asarray(rec)
            else:
                self._records = self._caller_records(error_records, rec.shape)
                self._records.set(rec)
            self._errors = ErrorRecords(self._records, rec, self.device, VllmAddressingError)
            # Initialised on CuPy's current stream; compute() may run on any other.
            cupy.cuda.get_current_stream().synchronize()
        o = self._out_info
        p.positions = o["positions"].ptr
        p.seq_lens = o["seq_lens"].ptr
        p.slot_mappings = o["slot_mappings"].ptr
        p.slot_stride = o["slot_mappings"].strides[0] if G > 1 else T
        p.dcp_local_seq_lens = o["dcp_local_seq_lens"].ptr
        for g in range(G):
            info = o["input_block_tables"][g]
            p.gathered[g] = info.ptr
            p.gathered_stride[g] = info.strides[0] if M > 1 else cfg.widths[g]
            p.row_fill[g] = self._row_fill.data.ptr + 4 * M * g
            p.width[g] = cfg.widths[g]
            p.block_size[g] = cfg.block_sizes[g]
            p.group_flags[g] = (GROUP_SLOTS if cfg.slot_mapping_enabled[g] else 0) | (
                GROUP_SHARDED if cfg.sharded(g) else 0
            )
            p.sliding_window_reach[g] = cfg.sliding_window_reach[g]
        for g in range(G, _G):
            p.width[g] = 1
            p.block_size[g] = 1
        p.errors = self._records.data.ptr
        p.num_groups = G
        p.max_num_reqs = M
        p.max_tokens = T
        p.slot_is_32 = int(cfg.slot_dtype == INT32)
        p.cp_size, p.cp_rank, p.cp_interleave = cfg.cp_size, cfg.cp_rank, cfg.cp_interleave
        p.token_blocks = -(-T // THREADS)
        p.request_blocks = -(-M // THREADS)
        self._set_attention_params()
        self._set_dsa_params()
        self._prev_rows = M  # the three-launch baseline's host-side copy of state[0]
        # Per-call constants: the struct's array fields (views sharing its memory), the
        # argument names and the shape texts of the messages.
        self._f_block_table, self._f_table_stride = p.block_table, p.table_stride
        self.forget_inputs()
        self._texts = {
            "rows": f"(rows >= max_num_reqs = {M},)",
            "stacked": f"({G}, rows >= {M})",
            "table_names": [f"block_tables[{g}]" if G > 1 else "block_tables" for g in range(G)],
            "nb_names": [f"num_blocks[{g}]" if G > 1 else "num_blocks" for g in range(G)],
            "tables": [f"(rows >= {M}, width = {cfg.widths[g]})" for g in range(G)],
        }

    # -- construction helpers ---------------------------------------------------------
    @staticmethod
    def error_records_shape(
        max_num_reqs: int, max_num_batched_tokens: int, attention_blocks: int = 0
    ) -> tuple[int, int]:
        """``(R, 2)``: the step's error records, one ``(mask, first-bad key)`` pair of
        64-bit words per warp of its token, request and attention metadata blocks,
        ``R = (ceil(max_num_batched_tokens / 256) + ceil(max_num_reqs / 256) + attention_blocks) * 8``
        (the shape an ``error_records=`` array must have). ``attention_blocks``: 0 without
        attention outputs, else ``num_groups * ceil((max_num_reqs + 1) / meta_rows)``
        (a planner's :attr:`attention_blocks`)."""
        blocks = -(-int(max_num_batched_tokens) // THREADS) + -(-int(max_num_reqs) // THREADS) + int(attention_blocks)
        return (blocks * WARPS, 2)

    @property
    def attention_blocks(self) -> int:
        """The attention metadata blocks of this planner's launch (0 without attention outputs)."""
        return len(self.config.block_sizes) * self._meta_blocks

    def _caller_records(self, x, shape: tuple[int, int]):
        """``error_records=``, checked; a CuPy uint64 view of it (the caller's memory)."""
        import cupy

        if not self._one_launch:
            raise ValueError(
                f"error_records is only taken by the one-launch step (its kernel's per-warp records), "
                f"not by {type(self).__name__}"
            )
        want = f"error_records must be a C-contiguous int64 or uint64 device array of shape {shape}"
        info = describe("error_records", x)
        if info.dtype not in (INT64, np.dtype(np.uint64)):
            raise TypeError(f"{want}, got dtype {info.dtype}")
        if tuple(info.shape) != shape:
            raise ValueError(f"{want}, got shape {tuple(info.shape)}")
        if tuple(info.strides) != (2, 1):
            raise ValueError(f"{want}, got strides {tuple(info.strides)} (in elements)")
        check_matrix(  # its device (dtype, shape and strides checked above)
            "error_records", info, dtypes=(info.dtype,), min_rows=shape[0], cols=2, shape_text="", device=self.device
        )
        self._records_owner = x  # the planner writes into x's memory: keep it alive
        return cupy.asarray(x).view(cupy.uint64)

    @property
    def _one_launch(self) -> bool:
        """The one-launch kernel runs (not a baseline subclass's own launches)."""
        return type(self)._load_functions is VllmStepPlanner._load_functions

    def _load_functions(self) -> dict:
        """The launchers of this planner's kernels (the dispatch table's, compiled now)."""
        (name,) = dispatch.vllm_kernels(bool(self._attn_bits), self.dsa)
        fn = kernel_loader.load_kernels((name,), self.device)[name]
        return {"step": kernel_loader.Launcher(fn, self._params, by_value=True)}

    def _make_attention_buffers(self) -> None:
        """The attention metadata's buffers (planner-owned, persistent; docs/vllm.md)."""
        import cupy

        cfg, groups = self.config, self.attention
        M, G = cfg.max_num_reqs, cfg.num_groups
        self.attention_outputs = None
        if not groups:
            return
        a = VllmAttentionOutputs()
        if "page_table" in groups:
            a.page_table = self.outputs.input_block_tables  # the gathered tables, no copy
        if self._attn_bits:
            # Zero-filled: qo_indptr, kv_indptr and cu_seqlens_k start as an empty batch.
            a.qo_indptr = cupy.zeros(M + 1, dtype=np.int32)
        if "flashinfer" in groups:
            a.kv_indptr = cupy.zeros((G, M + 1), dtype=np.int32)
            a.kv_indices = cupy.full((G, self.kv_indices_capacity), -1, dtype=np.int32)
            a.kv_last_page_len = cupy.zeros((G, M), dtype=np.int32)
        if "varlen" in groups:
            a.cu_seqlens_k = cupy.zeros((G, M + 1), dtype=np.int32)
            self._max_seqlen = cupy.zeros(1 + G, dtype=np.int32)
            a.max_seqlen_q = self._max_seqlen[0]
            a.max_seqlen_k = self._max_seqlen[1:]
            o = self.outputs
            a.seqused_k = tuple(o.dcp_local_seq_lens if cfg.sharded(g) else o.seq_lens for g in range(G))
        self.attention_outputs = self.outputs.attention = a

    def _set_attention_params(self) -> None:
        p, a = self._params, self.attention_outputs
        p.attention = self._attn_bits
        p.meta_blocks = self._meta_blocks
        p.meta_rows = self._meta_rows
        if not self._attn_bits:
            return
        p.qo_indptr = a.qo_indptr.data.ptr
        if a.kv_indptr is not None:
            N = self.kv_indices_capacity
            p.kv_indptr = a.kv_indptr.data.ptr
            p.kv_indices = a.kv_indices.data.ptr
            p.kv_last_page_len = a.kv_last_page_len.data.ptr
            p.kv_indices_capacity = N
            p.meta_entries = -(-N // self._meta_blocks)
        if a.cu_seqlens_k is not None:
            p.cu_seqlens_k = a.cu_seqlens_k.data.ptr
            p.max_seqlen = self._max_seqlen.data.ptr

    def _make_dsa_buffers(self) -> None:
        """The DSA outputs' buffers (planner-owned, persistent; docs/dsa.md)."""
        import cupy

        if not self.dsa:
            return
        M, T = self.config.max_num_reqs, self.config.max_num_batched_tokens
        self.outputs.dsa = DsaOutputs(
            value_offsets=cupy.full(T, -1, dtype=np.int64),
            scale_offsets=cupy.full(T, -1, dtype=np.int64),
            ks=cupy.zeros(T, dtype=np.int32),
            ke=cupy.zeros(T, dtype=np.int32),
            ctx=cupy.zeros(T, dtype=np.int32),
            cu_seq_lens=cupy.zeros(M + 1, dtype=np.int32),
            req_id_per_token=cupy.full(T, -1, dtype=np.int32),
        )

    def _set_dsa_params(self) -> None:
        """The DSA fields of the parameter struct (fixed at construction; null without dsa)."""
        if not self.dsa:
            return
        p, d = self._params, self.outputs.dsa
        p.dsa_value_offsets = d.value_offsets.data.ptr  # [T], int64
        p.dsa_scale_offsets = d.scale_offsets.data.ptr  # [T], int64
        p.dsa_ctx = d.ctx.data.ptr  # [T], int32
        p.dsa_ks = d.ks.data.ptr  # [T], int32
        p.dsa_ke = d.ke.data.ptr  # [T], int32
        p.dsa_cu_seq_lens = d.cu_seq_lens.data.ptr  # [M + 1], int32
        p.dsa_req_id = d.req_id_per_token.data.ptr  # [T], int32
        p.dsa_group = self.dsa_cache
        p.dsa_decode_len = self.dsa_decode_len
        p.dsa_value_bytes = self.dsa_value_bytes
        p.dsa_scale_bytes = self.dsa_scale_bytes

    @property
    def meta_rows(self) -> int:
        """Batch rows per attention metadata block (fixed at construction: it sizes the grid)."""
        return self._meta_rows

    @staticmethod
    def _out_fields(out) -> dict:
        if out is None:
            return {}
        if isinstance(out, VllmStepOutputs):
            out = out.as_dict()
        if not isinstance(out, dict):
            raise TypeError(f"out must be a VllmStepOutputs or a dict of output arrays, got {type(out).__name__}")
        unknown = set(out) - (set(VllmStepOutputs.__dataclass_fields__) - {"attention", "dsa"})
        if unknown:
            raise ValueError(f"out has unknown fields {sorted(unknown)}")
        return {k: v for k, v in out.items() if v is not None}

    def _make_outputs(self, given: dict) -> VllmStepOutputs:
        import cupy

        cfg, dev = self.config, self.device
        M, T, G = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups
        sd = cfg.slot_dtype
        info: dict = {}

        def vec(name, dtype, n, fillv):
            x = given.get(name)
            if x is None:
                x = cupy.full(n, fillv, dtype=dtype)
            info[name] = check_vector(
                f"out.{name}", describe(f"out.{name}", x), dtypes=(dtype,), length=n, shape_text=f"({n},)", device=dev
            )
            return x

        positions = vec("positions", INT64, T, 0)
        seq_lens = vec("seq_lens", INT32, M, 0)
        dcp = vec("dcp_local_seq_lens", INT32, M, 0)
        slots = given.get("slot_mappings")
        if slots is None:
            slots = cupy.full((G, T), -1, dtype=sd)
        info["slot_mappings"] = check_matrix(
            "out.slot_mappings",
            describe("out.slot_mappings", slots),
            dtypes=(sd,),
            min_rows=G,
            rows=G,
            cols=T,
            shape_text=f"({G}, {T})",
            device=dev,
        )
        tables = given.get("input_block_tables")
        if tables is None:
            tables = [None] * G
        tables = per_group("out.input_block_tables", tables, G, allow_stacked=False)
        made, infos = [], []
        self._own_tables = [t is None for t in tables]
        for g, t in enumerate(tables):
            W = cfg.widths[g]
            if t is None:
                t = cupy.zeros((M, W), dtype=np.int32)
            name = f"out.input_block_tables[{g}]"
            infos.append(
                check_matrix(name, describe(name, t), min_rows=M, rows=M, cols=W, shape_text=f"({M}, {W})", device=dev)
            )
            made.append(t)
        info["input_block_tables"] = infos
        self._out_info = info
        return VllmStepOutputs(positions, seq_lens, slots, tuple(made), dcp)

    # -- per call -------------------------------------------------------------------
    def _prepare(self, idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, num_reqs_padded):
        """Check the inputs and write them into the parameter block; returns (num_reqs, padded)."""
        self._memo = None  # the parameter block is being rewritten: forget the last call first
        cfg, p = self.config, self._params
        M, G = cfg.max_num_reqs, cfg.num_groups
        idx, qsl = check_batch(idx_mapping, query_start_loc, M, self.device)
        n = idx.shape[0]
        # The request state (num_computed_tokens, block tables, num_blocks) is the engine's
        # persistent buffers: each object is checked the first time it is seen and then
        # remembered by identity (a reference is held) with its exact signature (pointer,
        # device, shape, strides, dtype; objects without a cheap one, such as
        # __cuda_array_interface__ wrappers, by identity only), so a step re-checks only
        # idx_mapping and query_start_loc, and a remembered array changed in place (torch's
        # resize_(), set_(), CuPy's shape setter) is checked again.
        seen = self._seen_nct
        if seen is None or num_computed_tokens is not seen[0] or _changed(num_computed_tokens, seen[1]):
            self._seen_nct = None
            p.num_computed_tokens = self._check_num_computed_tokens(num_computed_tokens)
            self._seen_nct = (num_computed_tokens, _state_signature(num_computed_tokens))
        seen = self._seen_tables
        tables = block_tables if type(block_tables) in (list, tuple) and len(block_tables) == G else None
        if tables is None:
            tables = per_group("block_tables", block_tables, G, allow_stacked=False)
        for g in range(G):
            t = tables[g]
            s = seen[g]
            if s is not None and t is s[0] and not _changed(t, s[1]):
                continue
            seen[g] = None
            self._f_block_table[g], self._f_table_stride[g] = self._check_table(g, t)
            seen[g] = (t, _state_signature(t))
        seen = self._seen_nb
        if (
            seen is None
            or num_blocks is not seen[0]
            or (
                type(num_blocks) in (list, tuple)  # the same list: its elements may have been replaced
                and (len(num_blocks) != len(seen[1]) or any(a is not b for a, b in zip(num_blocks, seen[1])))
            )
            or any(_changed(a, sig) for a, sig in zip(seen[2], seen[3]))
        ):
            self._set_num_blocks(num_blocks)
        padded = n if num_reqs_padded is None else check_num_reqs_padded(num_reqs_padded, n, M)
        p.idx_mapping = idx.ptr
        p.idx_is_64 = idx.dtype == INT64
        p.query_start_loc = qsl.ptr
        p.num_reqs = n
        p.num_reqs_padded = padded
        return n, padded

    def _check_num_computed_tokens(self, x) -> int:
        """``num_computed_tokens`` checked (int32 ``[rows >= M]``, contiguous, on the device); its pointer."""
        return check_vector(
            "num_computed_tokens",
            describe("num_computed_tokens", x),
            min_length=self.config.max_num_reqs,
            shape_text=self._texts["rows"],
            device=self.device,
        ).ptr

    def _check_table(self, g: int, t) -> tuple[int, int]:
        """Group g's block table checked (int32 ``[rows >= M, W_g]``, contiguous last dim, rows not
        overlapping, on the device); ``(pointer, row stride in elements)``."""
        tx, W = self._texts, self.config.widths[g]
        name = tx["table_names"][g]
        info = check_matrix(
            name,
            describe(name, t),
            min_rows=self.config.max_num_reqs,
            cols=W,
            shape_text=tx["tables"][g],
            device=self.device,
        )
        return info.ptr, (info.strides[0] if info.shape[0] > 1 else W)

    def _set_num_blocks(self, num_blocks) -> None:
        p = self._params
        self._seen_nb = None  # until every check passed
        nbs, ptrs = self._check_num_blocks(num_blocks)
        fields, sources, step = self._num_blocks_fields(ptrs)
        for g in range(len(ptrs)):
            p.num_blocks[g], p.num_blocks_src[g] = fields[g], sources[g]
        self._fns["step"] = step
        items = tuple(num_blocks) if type(num_blocks) in (list, tuple) else ()
        self._seen_nb = (num_blocks, items, tuple(nbs), tuple(_state_signature(a) for a in nbs))

    def _check_num_blocks(self, num_blocks) -> tuple[list, list]:
        """``num_blocks`` checked (G int32 ``[rows >= M]`` or one ``[G, rows >= M]``); ``(the
        per-group arrays, one pointer per group)``."""
        cfg, dev, tx = self.config, self.device, self._texts
        M, G = cfg.max_num_reqs, cfg.num_groups
        nbs = per_group("num_blocks", num_blocks, G, allow_stacked=True)
        if len(nbs) == 1 and (G > 1 or _ndim(nbs[0]) == 2):
            info = _describe_num_blocks("num_blocks", nbs[0])
            if info.dtype != INT32 or len(info.shape) != 2 or info.shape[0] != G or info.shape[1] < M:
                raise ValueError(
                    f"num_blocks must be int32 with shape ({G}, rows >= {M}) or a sequence of {G} arrays, "
                    f"got dtype {info.dtype} shape {info.shape}"
                )
            if info.shape[1] > 1 and info.strides[1] != 1:
                raise ValueError(f"num_blocks must have a contiguous last dim, got stride {info.strides[1]}")
            check_vector(
                "num_blocks",
                info._replace(shape=(info.shape[1],), strides=(1,)),
                min_length=M,
                shape_text=tx["stacked"],
                device=dev,
            )
            ptrs = [info.ptr + 4 * g * info.strides[0] for g in range(G)]
        else:
            ptrs = []
            for g, nb in enumerate(nbs):
                name = tx["nb_names"][g]
                info = _describe_num_blocks(name, nb)
                ptrs.append(check_vector(name, info, min_length=M, shape_text=tx["rows"], device=dev).ptr)
        return nbs, ptrs

    def _num_blocks_fields(self, ptrs: list) -> tuple:
        """For num_blocks at ``ptrs`` (one per group): ``(the num_blocks fields, the num_blocks_src
        fields, the step's launcher)``. num_blocks in pinned host memory (vLLM's layout) is staged
        when the one-launch step runs: the kernel reads the planner's device copy, which
        vllm_stage_num_blocks fills right before it, each PCIe line read once (see
        kvaddr/kernels/vllm.cuh); the fields then hold the copy's rows and the given pointers."""
        if not self._one_launch or not any(host_memory(ptr) for ptr in ptrs):
            return list(ptrs), [0] * len(ptrs), self._device_step
        copy = self._num_blocks_copy
        rows = [copy.data.ptr + 4 * g * copy.shape[1] for g in range(len(ptrs))]
        return rows, list(ptrs), self._staged_launcher()

    def _staged_launcher(self):
        """The launcher of the staged kernels (dispatch.vllm_staged_kernels), loaded when first needed:
        the copy, then the step as its programmatic dependent where the device allows it."""
        if self._staged_step is None:
            names = dispatch.vllm_staged_kernels(bool(self._attn_bits), self.dsa, self.config.num_groups)
            fns = kernel_loader.load_kernels(names, self.device)
            first = kernel_loader.DependentLaunch(
                int(fns[names[0]].ptr),
                -(-self.config.max_num_reqs // THREADS),
                THREADS,
                programmatic=kernel_loader.programmatic_launch_supported(self.device),
            )
            self._staged_step = kernel_loader.Launcher(fns[names[1]], self._params, by_value=True, launch_kernel=first)
        return self._staged_step

    @property
    def staged(self) -> bool:
        """Whether the last checked call's num_blocks is staged (in pinned host memory: two launches,
        the copy and the step; see :meth:`compute`)."""
        return self._fns.get("step") is not self._device_step

    def _check_state(self, num_computed_tokens, block_tables, num_blocks) -> tuple:
        """The request state checked as compute() checks it: ``(num_computed_tokens' pointer,
        [(table pointer, row stride)] per group, (num_blocks fields, num_blocks_src fields,
        (launch_kernel, function) of the step that reads them))`` (see ``_num_blocks_fields``)."""
        nct = self._check_num_computed_tokens(num_computed_tokens)
        tables = per_group("block_tables", block_tables, self.config.num_groups, allow_stacked=False)
        checked = [self._check_table(g, t) for g, t in enumerate(tables)]
        fields, sources, step = self._num_blocks_fields(self._check_num_blocks(num_blocks)[1])
        return nct, checked, (fields, sources, step.driver[:2])

    def bind(
        self,
        num_computed_tokens,
        block_tables,
        num_blocks,
        *,
        idx_mapping=None,
        query_start_loc=None,
        stream=None,
        debug: bool = False,
    ) -> BoundVllmStep:
        """Bind vLLM's persistent request state once (and, optionally, its batch buffers).

        Two forms:

        * ``bound = planner.bind(nct, tables, num_blocks)``: a
          :class:`~kvaddr.engines.vllm_bound.BoundVllmStep`; each step then passes its batch,
          ``bound.launch(idx_mapping, query_start_loc, num_reqs_padded, stream=s)`` (fresh slices
          welcome: checked in full at every launch, cheaply);
        * ``bound = planner.bind(nct, tables, num_blocks, idx_mapping=idx_buf,
          query_start_loc=qsl_buf)``: a :class:`~kvaddr.engines.vllm_bound.BoundVllmBatch` over
          the whole persistent batch buffers too; each step then passes two ints and a stream,
          ``bound.launch(num_reqs, num_reqs_padded, s)``, and the kernel reads
          ``idx_buf[:num_reqs]`` and ``qsl_buf[:num_reqs + 1]``. Only the two ints are checked per
          launch (ranges); ``debug=True`` or :meth:`BoundVllmBatch.check_bound
          <kvaddr.engines.vllm_bound.BoundVllmStep.check_bound>` compares every bound array with
          what was bound.

        Parameters
        ----------
        num_computed_tokens : int32 [rows >= max_num_reqs], device array, by row
        block_tables : sequence of G int32 [rows >= max_num_reqs, width_g] device arrays
            (one array for one group); the last dim contiguous.
        num_blocks : sequence of G int32 [rows >= max_num_reqs], or one int32 [G, rows]
            The same arrays, checked the same way, as :meth:`compute` takes (``num_blocks`` may be
            pinned host memory read through UVA, as vLLM keeps it: a torch ``pin_memory()`` tensor,
            a ``cupyx.empty_pinned`` array or a ``__cuda_array_interface__`` view of pinned host
            memory). With the first form they are checked again at a launch where one's signature
            (pointer, device, shape, strides, dtype) or an item of a list given here changed since
            (a ``resize_``, ``set_``, a CuPy ``shape`` setter, a list item replaced).
        idx_mapping : int32 or int64 [rows] device array, optional
            vLLM's persistent ``idx_mapping`` buffer, whole (contiguous); with ``query_start_loc``.
        query_start_loc : int32 [rows' >= 1] device array, optional
            vLLM's persistent ``query_start_loc`` buffer, whole (contiguous); with ``idx_mapping``.
            A launch accepts ``num_reqs`` up to ``min(rows, rows' - 1, max_num_reqs)``.
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            The launches' default stream (CuPy's current stream at each launch if None).
        debug : bool, default False
            Every launch first describes every bound array again and raises ValueError naming one
            whose pointer, shape, strides, dtype or device changed since ``bind`` (or a bound
            list's item replaced): :meth:`~kvaddr.engines.vllm_bound.BoundVllmStep.check_bound`.

        Returns
        -------
        BoundVllmStep or BoundVllmBatch
            Holds references to the bound arrays (and the lists given); writes this planner's
            outputs (the same buffers as :meth:`compute`, ``out=`` tensors where given) with
            its own copy of the kernel's parameter block. Bind again when the engine replaces a
            bound array by a new object.

        Raises
        ------
        TypeError, ValueError
            A bound array fails a check (the message names it, as compute()'s does); only one of
            ``idx_mapping`` and ``query_start_loc`` given; the planner is not a one-launch one
            (``VllmThreeLaunch``).
        """
        from kvaddr.engines.vllm_bound import BoundVllmBatch

        step = self._fns.get("step")
        if not self._one_launch or type(step) is not kernel_loader.Launcher or step.driver is None:
            raise TypeError(f"bind needs a one-launch VllmStepPlanner, got {type(self).__name__}")
        if (idx_mapping is None) != (query_start_loc is None):
            missing = "query_start_loc" if query_start_loc is None else "idx_mapping"
            raise TypeError(f"bind takes idx_mapping and query_start_loc together; {missing} is missing")
        state = (num_computed_tokens, block_tables, num_blocks)
        if idx_mapping is None:
            return self._make_binding(state, stream=stream, debug=debug)
        return self._make_binding(
            state,
            stream=stream,
            debug=debug,
            cls=BoundVllmBatch,
            idx_mapping=idx_mapping,
            query_start_loc=query_start_loc,
            check_batch_buffers=lambda i, q: check_batch_buffers(i, q, self.device),
        )

    def _make_binding(self, state, *, stream, debug, check_state=None, cls=None, **extra):
        """A binding of ``state`` (``BoundVllmStep`` or ``cls``) with its own copy of the parameter block."""
        from kvaddr.engines.vllm_bound import BoundVllmStep

        return (cls or BoundVllmStep)(
            planner=self,
            params=VllmStepParams.from_buffer_copy(self._params),
            threads=THREADS,
            max_num_reqs=self.config.max_num_reqs,
            device=self.device,
            outputs=self.outputs,
            check_state=check_state or self._check_state,
            check_batch=check_batch,
            plan=self._plan,
            num_computed_tokens=state[0],
            block_tables=state[1],
            num_blocks=state[2],
            stream=stream,
            describe_bound=self._describe_bound,
            debug=debug,
            **extra,
        )

    def _describe_bound(
        self, num_computed_tokens, block_tables, num_blocks, idx_mapping=None, query_start_loc=None
    ) -> dict:
        """Every bound array's signature ``(pointer, shape, strides, dtype, device)`` by argument name
        (``block_tables[g]``, ``num_blocks[g]``), and each bound list's items by identity (a
        binding's :meth:`check_bound <kvaddr.engines.vllm_bound.BoundVllmStep.check_bound>`)."""
        out: dict = {}

        def add(name, x, mapped=False):
            # CuPy arrays and torch tensors: the memo's signature read (validation.signature_getter);
            # other objects: described (as the checks describe them)
            getter = signature_getter((x,))
            if getter is not None:
                ptr, dev, shape, strides, dtype = getter(x)
                out[name] = (ptr, tuple(shape), tuple(strides), dtype, dev)
                return
            info = (_describe_num_blocks if mapped else describe)(name, x)
            out[name] = (info.ptr, tuple(info.shape), tuple(info.strides), info.dtype, info.device)

        add("num_computed_tokens", num_computed_tokens)
        for label, value, mapped in (("block_tables", block_tables, False), ("num_blocks", num_blocks, True)):
            if isinstance(value, (list, tuple)):
                out[f"{label} (the list's items)"] = _Items(value)
                for g, v in enumerate(value):
                    add(f"{label}[{g}]" if len(value) > 1 else label, v, mapped)
            else:
                add(label, value, mapped)
        if idx_mapping is not None:
            add("idx_mapping", idx_mapping)
            add("query_start_loc", query_start_loc)
        return out

    def forget_inputs(self) -> None:
        """Drop the remembered inputs (the next call checks every array again)."""
        self._memo = self._last_args = None
        self._state_bound = self._last_state = None  # compute()'s binding of the request state
        self._last_idx = None  # the idx_mapping object of the last call
        self._seen_nct = self._seen_nb = None
        self._seen_tables = [None] * self.config.num_groups

    @property
    def memoize_checks(self) -> bool:
        """Let compute() skip the checks for the same inputs with unchanged signatures (see
        ``_remember``; default True); False checks every call (the path before the memo)."""
        return self._memoize

    @memoize_checks.setter
    def memoize_checks(self, on: bool) -> None:
        self._memoize = bool(on)
        self._memo = self._last_args = None
        self._state_bound = self._last_state = self._last_idx = None

    @staticmethod
    def auto_pair_lanes(pairs: int) -> int:
        """The default lanes per (group, row) pair of the gather for ``pairs`` pairs: a warp per pair
        (more entries in flight per row) while that is at most 64 blocks, then 16, then 8."""
        if pairs * 32 <= 64 * THREADS:
            return 32
        if pairs * 16 <= 256 * THREADS:
            return 16
        return 8

    def grid(self, num_reqs_padded: int, num_reqs: int | None = None) -> int:
        """Blocks of the one launch for a batch of ``num_reqs`` requests (default: the
        padded size) padded to ``num_reqs_padded`` rows (also writes the gather's lanes per
        pair into the parameter block). With ``dsa=True`` the launch has two grid rows of
        this many blocks: ``(grid, 2)``."""
        grid, lanes = self._plan(num_reqs_padded, num_reqs)
        p = self._params
        if lanes and p.pair_lanes != lanes:
            p.pair_lanes = lanes
            self._memo = None  # the memo's grid was for the lanes in the struct
        return grid

    def _plan(self, num_reqs_padded: int, num_reqs: int | None) -> tuple:
        """``(blocks, lanes per pair)`` of the launch (see :meth:`grid`; writes nothing)."""
        p = self._params
        G = self.config.num_groups
        n = num_reqs_padded if num_reqs is None else num_reqs
        pairs = G * n
        lanes = 32 if pairs <= 512 else (16 if pairs <= 4096 else 8)  # auto_pair_lanes
        # a warp per (group, chunk of 32 // lanes rows): the kernel's gather loop (one pass each)
        gather_warps = G * -(-n // (32 // lanes))
        return p.token_blocks + p.request_blocks + -(-gather_warps // (THREADS // 32)) + G * p.meta_blocks, lanes

    @property
    def launches_per_step(self) -> int:
        return 2 if self.staged else 1

    def compute(
        self,
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        block_tables,
        num_blocks,
        num_reqs_padded: int | None = None,
        *,
        stream=None,
    ) -> VllmStepOutputs:
        """One step's inputs for vLLM in one kernel launch.

        Parameters
        ----------
        idx_mapping : int32 or int64 [num_reqs], device array
            Batch index b -> request-state row r; -1 marks a dummy (padding) request.
        query_start_loc : int32 [num_reqs + 1], device array
            Request b's tokens are ``[qsl[b], qsl[b+1])``.
        num_computed_tokens : int32 [rows >= max_num_reqs], device array, by row
        block_tables : sequence of G int32 [rows >= max_num_reqs, width_g] device arrays
            (one array for one group); the last dim contiguous.
        num_blocks : sequence of G int32 [rows >= max_num_reqs], or one int32 [G, rows]
            Device memory, or pinned host memory (vLLM's layout), which is staged: a first
            kernel copies its rows into the planner's device copy and the step, launched right
            behind it, reads that copy (docs/vllm.md; :attr:`staged`).
        num_reqs_padded : int, optional
            The batch's graph size, ``num_reqs <= . <= max_num_reqs`` (default num_reqs):
            gathered rows up to it (and those the previous call filled) are zeroed.
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            Where to launch (CuPy's current stream by default).

        Returns
        -------
        VllmStepOutputs
            The persistent output buffers (``out=`` tensors where given).

        Notes
        -----
        The checks run in full on a call with new argument objects (a list of tables or of
        num_blocks counts by its items); once two checked calls in a row had the same objects,
        later calls with those objects, each array with an unchanged pointer, device, shape,
        strides and dtype, skip them (they would pass again) and launch from the parameter block as it is, with only
        ``num_reqs_padded`` and the stream taken per call. Once two checked calls in a row had
        the same request state (``num_computed_tokens``, ``block_tables``, ``num_blocks``),
        later calls with that state unchanged and new batch objects (vLLM's fresh slices
        ``idx_mapping[:num_reqs]``, ``query_start_loc[:num_reqs + 1]``) check the batch alone,
        as :meth:`BoundVllmStep.launch <kvaddr.engines.vllm_bound.BoundVllmStep.launch>` does
        (CuPy arrays and torch tensors read straight from their attributes). The planner keeps
        a reference to the last inputs. ``memoize_checks = False`` checks every call.
        """
        stream = self._stream(stream)
        # Fast path: the same argument objects as the last checked call, each array's signature
        # unchanged, so every check passes as it did and the parameter block already holds them;
        # only num_reqs_padded (checked here as check_num_reqs_padded does) and the stream vary.
        # num_reqs_padded: the same object as the last launch's (m.extra[0]) is in the struct already
        # (ints are immutable; only _prepare, which drops the memo first, and this path write it).
        m = self._memo
        if (
            m is not None
            and m.same(idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks)
            and (
                num_reqs_padded is (last := m.extra)[0]
                or num_reqs_padded is None
                or (num_reqs_padded.__class__ is int and m.size <= num_reqs_padded <= self.config.max_num_reqs)
            )
        ):
            if num_reqs_padded is not last[0]:
                last[1] = self._params.num_reqs_padded = m.size if num_reqs_padded is None else num_reqs_padded
                last[0] = num_reqs_padded
            if m.launch_kernel is None:
                m.launcher(m.blocks, m.threads, stream, *self._grid_args)
            else:  # cuLaunchKernel straight (Launcher.__call__'s fast branch, inlined)
                m.launch_kernel(m.function, m.blocks, self._grid_y, 1, m.threads, 1, 1, 0, stream, m.params_ptr, 0)
            return self.outputs
        # New batch objects over the request state of the calls before (vLLM's fresh slices of its
        # batch buffers every step): a private binding of that state (its own parameter block, see
        # _bind_compute_state) checks and launches the batch as BoundVllmStep.launch does.
        # (The batch object of the call before, passed again, takes the checked path, which makes
        # the memo above when the objects repeat.)
        sb = self._state_bound
        if (
            sb is not None
            and idx_mapping is not self._last_idx
            and sb._same(num_computed_tokens, block_tables, num_blocks)
        ):
            self._last_idx = idx_mapping
            if m is not None:  # (a memo that missed: its batch objects are not these)
                self._memo = self._last_args = None
            return sb._launch_slices(idx_mapping, query_start_loc, num_reqs_padded, stream)
        self._last_idx = idx_mapping
        try:
            n, padded = self._prepare(
                idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, num_reqs_padded
            )
        except Exception:  # a failed check leaves nothing remembered (the binding of the state included)
            self._state_bound = self._last_state = None
            raise
        grid = self.grid(padded, n)
        self._fns["step"](grid, THREADS, stream, *self._grid_args)
        self._remember(idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, n, grid)
        if self._memo is not None and (num_reqs_padded is None or num_reqs_padded.__class__ is int):
            self._memo.extra[:] = (
                num_reqs_padded,
                padded,
            )  # (another kind, e.g. a NumPy int: checked on the next call)
        self._bind_compute_state(num_computed_tokens, block_tables, num_blocks)
        return self.outputs

    def _bind_compute_state(self, num_computed_tokens, block_tables, num_blocks) -> None:
        """After a checked call: when its request state repeats the checked call before's objects
        (``validation.repeats``), bind it (:meth:`bind`, checked again once) for compute()'s path of
        new batch objects. The binding's guard holds the state's objects and signatures; it launches
        from its own parameter block, so the planner's (compute()'s checked path and memo) and the
        binding's never hold each other's batch. Not with ``memoize_checks = False``, nor for state
        without a cheap signature (the binding's guard is None: every call is checked)."""
        state, last = (num_computed_tokens, block_tables, num_blocks), self._last_state
        self._last_state = state
        if not self._memoize or not repeats(state, last):
            return
        step = self._fns.get("step")
        if type(step) is not kernel_loader.Launcher or step.driver is None:
            return  # (a launcher without the fast launch: every call is checked)
        # The state was checked by this call (_prepare) and its pointers are in the planner's block:
        # the binding takes them as they are the first time (its later re-checks are its own).
        p, G = self._params, self.config.num_groups
        nb = (list(p.num_blocks[:G]), list(p.num_blocks_src[:G]), step.driver[:2])
        checked = [(p.num_computed_tokens, [(p.block_table[g], p.table_stride[g]) for g in range(G)], nb)]
        sb = self._make_binding(
            state, stream=None, debug=False, check_state=lambda *a: checked.pop() if checked else self._check_state(*a)
        )
        self._state_bound = sb if sb._same is not None else None

    def _remember(self, idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, n, grid) -> None:
        """Memoise the inputs just checked and launched, for compute()'s fast path, when they
        are the objects of the checked call before (``validation.repeats``; a list by its items):
        the second checked call with the same objects makes the memo, and a call with new objects
        costs the checks alone.

        The memo's guard (``validation.memo_guard``, shared with ``StepPlanner``) holds the
        argument objects themselves (so their ids stay theirs), the items of a sequence of
        tables or of num_blocks (a list may be changed in place), and each distinct array's
        exact signature (pointer, device, shape, strides, dtype: everything the checks and the
        parameter block depend on, see ``validation.signature_getter``), read once per object
        (one table passed for two groups is read once) into one tuple. compute() skips the
        checks only when the same objects come back with equal signatures; anything else runs
        the full checks again. Arrays without a cheap signature (``__cuda_array_interface__``,
        DLPack, mixed CuPy and torch) and list/tuple subclasses are never memoised, and neither
        is anything while ``memoize_checks`` is False.
        """
        if not self._memoize:
            return
        # The guard is built only when this call repeats the last checked call's objects (see
        # validation.repeats): new idx_mapping / query_start_loc objects every step (vLLM's fresh
        # slices) never hit a memo, so they pay the checks alone.
        args, last = (idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks), self._last_args
        self._last_args = args
        if not repeats(args, last):
            return
        # (every argument object, sequences by their items, is a checked array)
        same = memo_guard(args)
        if same is None:  # no cheap signature, or a list/tuple subclass
            return
        step = self._fns["step"]
        fast = type(step) is kernel_loader.Launcher
        self._memo = Memo(
            same=same,  # the same objects (sequences by their items), signatures unchanged
            size=n,  # num_reqs (idx_mapping's length, part of its signature): num_reqs_padded's lower bound
            blocks=grid,  # lanes by num_reqs, not num_reqs_padded
            threads=THREADS,
            launch_kernel=step.driver[0] if fast else None,  # None: another launcher, called as is
            function=step.driver[1] if fast else 0,
            params_ptr=step.driver[2] if fast else 0,
            launcher=step,
            extra=[_NO_OBJECT, 0],  # [the last launch's num_reqs_padded object, the value written]: see compute()
        )

    def errors(self, stream=None) -> tuple[int, int]:
        """Synchronise; every step's errors since the last read, then clear them.

        The error records are sticky (docs/vllm.md, "Errors"): a launch only adds to them, so
        this returns the OR of the bits and the smallest key over every launch since the last
        :meth:`errors`, :meth:`check` or :meth:`clear_errors` (with one launch in between, that
        step's ``(error_mask, first_bad_key)``), and resets the records (caller-owned
        ``error_records=`` memory included) when something was set: a clean read launches
        nothing. Read on the stream the steps run on.

        Returns
        -------
        (int, int)
            ``(error_mask, first_bad_key)``; ``(0, VLLM_NO_ERROR_KEY)`` when clean.
        """
        return self._errors.read(stream)

    def check(self, stream=None) -> None:
        """Synchronise; raise VllmAddressingError naming the first bad value since the last
        read (:meth:`errors`: the records are then clear)."""
        self._errors.check(stream)

    def clear_errors(self, stream=None) -> None:
        """Clear the error records on ``stream`` (CuPy's current one by default), dropping
        errors not read yet; no synchronisation (:meth:`errors` and :meth:`check` clear after
        reading already)."""
        self._errors.clear(stream)
