"""VllmDraftPlanner: every draft forward's addressing after a verify step, in one launch.

vLLM Model Runner V2's speculator runs k draft forwards after the target model verified a step
with k draft tokens per request. From the verify step's ``idx_mapping``, ``query_start_loc``,
``seq_lens``, ``num_rejected`` and ``num_sampled`` (all on the device) and the persistent block
tables, one launch writes ``last_token_indices``, the first draft forward's slot mappings with
the rejected tokens at -1 (``mask_rejected=True``), and for each draft step j = 1..k-1 its
positions, ``seq_lens``, DCP local lengths, ``query_start_loc``, every group's slot mapping and,
when asked, its FlashInfer / varlen attention metadata: persistent buffers shaped ``[k-1, ...]``
(docs/spec-decode.md; the oracle: :func:`kvaddr.engines.spec_reference.vllm_draft_reference`).
A call allocates nothing and never synchronises, so it may be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvaddr import dispatch, kernel_loader
from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.engines.spec_reference import DraftAddressingError
from kvaddr.engines.vllm import check_batch, check_batch_buffers
from kvaddr.engines.vllm_bound import cupy_batch_check, torch_batch_check
from kvaddr.engines.vllm_config import INT32, INT64, VLLM_MAX_GROUPS, VllmStepConfig, check_matrix, check_vector
from kvaddr.errors import clean_error_records
from kvaddr.host import ErrorRecords, StreamResolver
from kvaddr.validation import INT32_MAX, array_kind, check_int, describe, memo_guard

__all__ = ["BoundVllmDraft", "BoundVllmDraftBatch", "VllmDraftOutputs", "VllmDraftParams", "VllmDraftPlanner"]

#: Threads per block of the draft kernel (VDRAFT_THREADS in kvaddr/kernels/spec.cuh).
THREADS = 256
WARPS = THREADS // 32
#: VLLM_ATTN_* bits of kernels.cu.
ATTN_BITS = {"flashinfer": 1, "varlen": 2}

#: Attention blocks the launch aims at (meta_rows): enough to spread the page copies over the GPU,
#: few enough that each block's scan of every request's length stays cheap.
META_BLOCKS = 512


def request_blocks(max_num_reqs: int, steps: int, num_groups: int) -> int:
    """The launch's request blocks: ``ceil((max_num_reqs + 1) / 256)`` per (draft step, group)
    (``steps * num_groups`` of them; one when ``steps`` is 0), a thread per batch row of each."""
    slices = steps * num_groups if steps > 0 else 1
    return slices * -(-(max_num_reqs + 1) // THREADS)


def meta_rows(max_num_reqs: int, steps: int, num_groups: int) -> int:
    """Batch rows per attention block: the smallest power of two in [8, 256] with at most
    :data:`META_BLOCKS` attention blocks over the ``steps * num_groups`` (step, group) pairs."""
    rows = 8
    while rows < THREADS and max(steps, 1) * num_groups * -(-(max_num_reqs + 1) // rows) > META_BLOCKS:
        rows *= 2
    return rows


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_G = VLLM_MAX_GROUPS

#: The outputs in their order, with dtype and shape (S = k - 1, G groups, M = max_num_reqs,
#: T = max_num_batched_tokens, N = kv_indices_capacity).
OUTPUT_FIELDS = (
    "last_token_indices",
    "first_slot_mappings",
    "positions",
    "seq_lens",
    "dcp_local_seq_lens",
    "query_start_loc",
    "slot_mappings",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "cu_seqlens_k",
    "max_seqlen_k",
)


class VllmDraftParams(ctypes.Structure):
    """Mirror of ``struct VllmDraftParams`` in kernels.cu (same order, same types).

    Filled by field name; ``tests/unit/test_vllm_struct.py`` compiles the C struct and
    compares every offset and the size.
    """

    _fields_ = [
        ("idx_mapping", _P),
        ("query_start_loc", _P),
        ("seq_lens", _P),
        ("num_rejected", _P),
        ("num_sampled", _P),
        ("verify_slots", _P),
        ("block_table", _P * _G),
        ("num_blocks", _P * _G),
        ("table_stride", _I64 * _G),
        ("verify_stride", _I64),
        ("last_token_indices", _P),
        ("first_slots", _P),
        ("positions", _P),
        ("seq_lens_out", _P),
        ("dcp_local_seq_lens", _P),
        ("query_start_loc_out", _P),
        ("slot_mappings", _P),
        ("kv_indptr", _P),
        ("kv_indices", _P),
        ("kv_last_page_len", _P),
        ("cu_seqlens_k", _P),
        ("max_seqlen_k", _P),
        ("errors", _P),
        ("width", _I32 * _G),
        ("block_size", _I32 * _G),
        ("group_flags", _I32 * _G),
        ("num_groups", _I32),
        ("num_reqs", _I32),
        ("max_num_reqs", _I32),
        ("num_rows", _I32),
        ("max_tokens", _I32),
        ("verify_tokens", _I32),
        ("steps", _I32),
        ("max_model_len", _I32),
        ("idx_is_64", _I32),
        ("verify_is_32", _I32),
        ("cp_size", _I32),
        ("cp_rank", _I32),
        ("cp_interleave", _I32),
        ("request_blocks", _I32),
        ("attention_blocks", _I32),
        ("token_blocks", _I32),
        ("attention", _I32),
        ("kv_indices_capacity", _I32),
        ("base_step", _I32),
        ("base_group", _I32),
        ("meta_chunks", _I32),
        ("meta_rows", _I32),
    ]


@dataclass
class VllmDraftOutputs:
    """The draft forwards' addressing (persistent buffers; S = k - 1 draft steps after the first
    forward, G groups, M = max_num_reqs, T = max_num_batched_tokens, N = kv_indices_capacity).

    Attributes
    ----------
    last_token_indices : int64 [M]
        The first draft forward's sampled row ``qs + L_b - 1`` per request; 0 past num_reqs.
    first_slot_mappings : int64 [G, T] or None
        With ``mask_rejected``: the verify step's slot mappings with the rejected tokens at -1
        (-1 past the verify slots' columns). None otherwise (the verify step's are used as they are).
    positions : int64 [S, M]
        Draft step j's query position ``min(P_b + j, max_model_len - 1)`` in row ``j - 1``.
    seq_lens : int32 [S, M]
        ``min(seq_lens_t - num_rejected + j, max_model_len)``; 0 past num_reqs.
    dcp_local_seq_lens : int32 [S, M]
        This DCP rank's share of ``seq_lens`` (equal to it without DCP).
    query_start_loc : int32 [S, M + 1]
        ``min(i, num_reqs)``: one query token per request (FlashInfer's ``qo_indptr``).
    slot_mappings : int64 [S, G, M]
        Each group's slot of each request's draft token; -1 past num_reqs, for dummy and
        skipped requests, disabled groups, another DCP rank's token and bad addresses.
    kv_indptr, kv_indices, kv_last_page_len : int32 [S, G, M + 1], [S, G, N], [S, G, M] or None
        FlashInfer's paged-KV metadata of each draft step (``attention`` with "flashinfer").
    cu_seqlens_k : int32 [S, G, M + 1] or None
    max_seqlen_k : int32 [S, G] or None
        FlashAttention varlen's (``attention`` with "varlen"); its ``seqused_k`` is ``seq_lens``
        (``dcp_local_seq_lens`` for a sharded group), its ``max_seqlen_q`` 1, and the page table
        of every draft step is the verify step's gathered block tables.
    """

    last_token_indices: Any
    first_slot_mappings: Any
    positions: Any
    seq_lens: Any
    dcp_local_seq_lens: Any
    query_start_loc: Any
    slot_mappings: Any
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_last_page_len: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_k: Any = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in OUTPUT_FIELDS}


def _check_lengths(names, arrays, n: int, device: int) -> list:
    """int32 contiguous vectors of at least ``n`` entries on ``device``: their pointers."""
    return [
        check_vector(name, describe(name, a), min_length=n, shape_text=f"(>= {n},)", device=device).ptr
        for name, a in zip(names, arrays)
    ]


class VllmDraftPlanner:
    """The draft forwards' addressing after a verify step (vLLM Model Runner V2) in one launch.

    Parameters
    ----------
    max_num_reqs : int
        The largest batch and the length of every per-request output (``1 <= . < 2**24``).
    max_num_batched_tokens : int
        T: the verify step's token capacity (columns of ``first_slot_mappings``).
    num_speculative_steps : int
        k >= 1: the first draft forward plus k - 1 draft steps.
    block_sizes : sequence of int
        B of each KV-cache group (1 to 4 groups).
    widths : int or sequence of int
        Columns of each group's block table.
    max_model_len : int
        Positions clamp at ``max_model_len - 1``, ``seq_lens`` at ``max_model_len``.
    slot_mapping_enabled, dcp_sharded : bool or sequence of bool, default all True
    cp_size, cp_rank, cp_interleave : int, default 1, 0, 1
        Decode context parallelism (``cp_size = 1``: off), as for the vLLM step.
    mask_rejected : bool, default False
        Write ``first_slot_mappings``: the verify step's slot mappings with the rejected tokens
        at -1 (so the first draft forward writes no K/V for them).
    attention : str or sequence of str, optional
        "flashinfer" and/or "varlen": each draft step's attention metadata in the same launch.
    kv_indices_capacity : int, optional
        N, the entries of each step's and group's ``kv_indices``; required with "flashinfer".
        More entries than N: error bit 512, the entries past N dropped.
    out : VllmDraftOutputs or dict, optional
        Caller-owned persistent outputs (any subset of the fields, C-contiguous, of the shapes
        and dtypes of :class:`VllmDraftOutputs`); the planner allocates the others.
    device : int, optional
        CUDA device ordinal (the current device by default).
    error_records : device array, optional
        Caller-owned memory for the error records: int64 or uint64, C-contiguous, shape
        :meth:`error_records_shape` (cleared here; the planner allocates them by default).

    Examples
    --------
    >>> planner = VllmDraftPlanner(256, 8192, 3, block_sizes=[16], widths=[512], max_model_len=4096)
    >>> out = planner.compute(idx_mapping, query_start_loc, seq_lens, num_rejected, num_sampled,
    ...                       [block_table], [num_blocks], verify_slot_mappings, stream=s)
    >>> planner.check()  # optional: synchronises, raises DraftAddressingError on bad values
    >>> bound = planner.bind(seq_lens, num_rejected, num_sampled, [block_table], [num_blocks])
    >>> out = bound.launch(idx_mapping, query_start_loc, stream=s)  # per verify step
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        num_speculative_steps: int,
        block_sizes,
        widths,
        max_model_len: int,
        *,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        mask_rejected: bool = False,
        attention=None,
        kv_indices_capacity: int | None = None,
        out=None,
        device: int | None = None,
        error_records=None,
    ):
        import cupy

        self.config = cfg = VllmStepConfig(
            max_num_reqs,
            max_num_batched_tokens,
            block_sizes,
            widths,
            slot_mapping_enabled=slot_mapping_enabled,
            dcp_sharded=dcp_sharded,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
        )
        self.num_speculative_steps = k = check_int("num_speculative_steps", num_speculative_steps, lo=1, hi=64)
        self.max_model_len = check_int("max_model_len", max_model_len, lo=1, hi=INT32_MAX)
        if not isinstance(mask_rejected, (bool, np.bool_)):
            raise TypeError(f"mask_rejected must be a bool, got {type(mask_rejected).__name__}")
        self.mask_rejected = bool(mask_rejected)
        self.attention = normalize_attention(attention)
        if "page_table" in self.attention:
            raise ValueError(
                "attention for the draft steps takes 'flashinfer' and 'varlen' "
                "(their page table is the verify step's gathered block tables)"
            )
        self.kv_indices_capacity = N = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        self._attn_bits = sum(ATTN_BITS[a] for a in self.attention)
        self.kernel_name = dispatch.vllm_draft_kernel(bool(self._attn_bits))
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self._stream = StreamResolver()
        M, T, G, S = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups, k - 1
        p = self._params = VllmDraftParams()
        p.num_groups, p.max_num_reqs, p.max_tokens, p.steps = G, M, T, S
        p.max_model_len = self.max_model_len
        p.cp_size, p.cp_rank, p.cp_interleave = cfg.cp_size, cfg.cp_rank, cfg.cp_interleave
        for g in range(_G):
            p.width[g] = cfg.widths[g] if g < G else 1
            p.block_size[g] = cfg.block_sizes[g] if g < G else 1
            if g < G:
                p.group_flags[g] = (1 if cfg.slot_mapping_enabled[g] else 0) | (2 if cfg.sharded(g) else 0)
        p.request_blocks = request_blocks(M, S, G)
        p.meta_rows = meta_rows(M, S, G)
        p.meta_chunks = -(-(M + 1) // p.meta_rows)
        p.attention_blocks = S * G * p.meta_chunks if self._attn_bits else 0
        p.token_blocks = -(-T // THREADS) if self.mask_rejected else 0
        p.attention = self._attn_bits
        p.kv_indices_capacity = N or 0
        self.grid = p.request_blocks + p.attention_blocks + p.token_blocks
        shapes = {
            "last_token_indices": ((M,), INT64),
            "first_slot_mappings": ((G, T), INT64) if self.mask_rejected else None,
            "positions": ((S, M), INT64),
            "seq_lens": ((S, M), INT32),
            "dcp_local_seq_lens": ((S, M), INT32),
            "query_start_loc": ((S, M + 1), INT32),
            "slot_mappings": ((S, G, M), INT64),
            "kv_indptr": ((S, G, M + 1), INT32) if self._attn_bits & 1 else None,
            "kv_indices": ((S, G, N), INT32) if self._attn_bits & 1 else None,
            "kv_last_page_len": ((S, G, M), INT32) if self._attn_bits & 1 else None,
            "cu_seqlens_k": ((S, G, M + 1), INT32) if self._attn_bits & 2 else None,
            "max_seqlen_k": ((S, G), INT32) if self._attn_bits & 2 else None,
        }
        given = out.as_dict() if isinstance(out, VllmDraftOutputs) else dict(out or {})
        for name in given:
            if name not in shapes:
                raise ValueError(f"out has no field {name!r}; fields: {', '.join(OUTPUT_FIELDS)}")
        arrays, ptrs = {}, {}
        records = (p.request_blocks + p.attention_blocks) * WARPS
        with cupy.cuda.Device(self.device):
            fn = kernel_loader.load_kernels((self.kernel_name,), self.device)[self.kernel_name]
            for name, spec in shapes.items():
                x = given.get(name)
                if spec is None:
                    if x is not None:
                        raise ValueError(f"out[{name!r}] given, but this planner does not write {name}")
                    arrays[name], ptrs[name] = None, 0
                    continue
                shape, dtype = spec
                if x is None:
                    x = cupy.zeros(shape, dtype=dtype)
                info = describe(f"out[{name!r}]", x)
                if info.dtype != dtype or tuple(info.shape) != shape:
                    raise ValueError(
                        f"out[{name!r}] must be {dtype} with shape {shape}, got {info.dtype} {tuple(info.shape)}"
                    )
                want = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
                if 0 not in shape and any(st != w for st, w, d in zip(info.strides, want, shape) if d > 1):
                    raise ValueError(f"out[{name!r}] must be C-contiguous, got strides {tuple(info.strides)}")
                if info.device != self.device and info.device != -2:
                    raise ValueError(f"out[{name!r}] must be on CUDA device {self.device}")
                arrays[name], ptrs[name] = x, info.ptr
            rec = clean_error_records(records)
            if error_records is None:
                self._records = cupy.asarray(rec)
            else:
                info = describe("error_records", error_records)
                if info.dtype not in (INT64, np.dtype(np.uint64)) or tuple(info.shape) != rec.shape:
                    raise ValueError(
                        f"error_records must be an int64 or uint64 device array of shape {rec.shape}, "
                        f"got {info.dtype} {tuple(info.shape)}"
                    )
                check_matrix(
                    "error_records",
                    info,
                    dtypes=(info.dtype,),
                    min_rows=rec.shape[0],
                    cols=2,
                    shape_text=str(rec.shape),
                    device=self.device,
                )
                self._records_owner = error_records
                self._records = cupy.asarray(error_records).view(cupy.uint64)
                self._records.set(rec)
            self._errors = ErrorRecords(self._records, rec, self.device, DraftAddressingError)
            cupy.cuda.get_current_stream().synchronize()
        self.outputs = VllmDraftOutputs(**arrays)
        p.last_token_indices = ptrs["last_token_indices"]
        p.first_slots = ptrs["first_slot_mappings"]
        p.positions = ptrs["positions"]
        p.seq_lens_out = ptrs["seq_lens"]
        p.dcp_local_seq_lens = ptrs["dcp_local_seq_lens"]
        p.query_start_loc_out = ptrs["query_start_loc"]
        p.slot_mappings = ptrs["slot_mappings"]
        p.kv_indptr = ptrs["kv_indptr"]
        p.kv_indices = ptrs["kv_indices"]
        p.kv_last_page_len = ptrs["kv_last_page_len"]
        p.cu_seqlens_k = ptrs["cu_seqlens_k"]
        p.max_seqlen_k = ptrs["max_seqlen_k"]
        p.errors = self._records.data.ptr
        self._launcher = kernel_loader.Launcher(fn, p, by_value=True)

    @staticmethod
    def error_records_shape(max_num_reqs: int, num_speculative_steps: int, num_groups: int, attention: bool) -> tuple:
        """``(R, 2)``: one record per warp of the request blocks, ``ceil((max_num_reqs + 1) / 256)``
        per (draft step, group) (:func:`request_blocks`), and, with attention metadata, of the
        ``(k - 1) * num_groups * ceil((max_num_reqs + 1) / meta_rows)`` attention blocks
        (:func:`meta_rows`)."""
        M, S, G = int(max_num_reqs), int(num_speculative_steps) - 1, int(num_groups)
        blocks = request_blocks(M, S, G)
        if attention:
            blocks += S * G * -(-(M + 1) // meta_rows(M, S, G))
        return (blocks * WARPS, 2)

    # -- checks ---------------------------------------------------------------------
    def _check_state(self, lengths, min_len: int, block_tables, num_blocks, verify_slot_mappings) -> dict:
        """The per-request arrays, the tables, num_blocks and the verify slots checked: the fields
        of the parameter block they fill."""
        cfg, dev = self.config, self.device
        G = cfg.num_groups
        f = {}
        f["seq_lens"], f["num_rejected"], f["num_sampled"] = _check_lengths(
            ("seq_lens", "num_rejected", "num_sampled"), lengths, min_len, dev
        )
        tables = _per_group("block_tables", block_tables, G)
        rows = INT32_MAX
        f["block_table"], f["table_stride"] = [], []
        for g, t in enumerate(tables):
            name = f"block_tables[{g}]" if G > 1 else "block_tables"
            info = check_matrix(
                name,
                describe(name, t),
                min_rows=1,
                cols=cfg.widths[g],
                shape_text=f"(rows, width = {cfg.widths[g]})",
                device=dev,
            )
            f["block_table"].append(info.ptr)
            f["table_stride"].append(info.strides[0] if info.shape[0] > 1 else cfg.widths[g])
            rows = min(rows, info.shape[0])
        f["num_blocks"] = [0] * G
        if num_blocks is not None:
            for g, nb in enumerate(_per_group("num_blocks", num_blocks, G)):
                name = f"num_blocks[{g}]" if G > 1 else "num_blocks"
                info = check_vector(name, describe(name, nb), min_length=1, shape_text="(rows,)", device=dev)
                f["num_blocks"][g] = info.ptr
                rows = min(rows, info.shape[0])
        f["num_rows"] = rows
        if verify_slot_mappings is None:
            if self.mask_rejected:
                raise ValueError("verify_slot_mappings is required with mask_rejected=True, got None")
            f["verify_slots"], f["verify_stride"], f["verify_tokens"], f["verify_is_32"] = (
                0,
                0,
                cfg.max_num_batched_tokens,
                0,
            )
        else:
            name = "verify_slot_mappings"
            info = describe(name, verify_slot_mappings)
            if len(info.shape) == 1 and G == 1:
                info = info._replace(shape=(1, info.shape[0]), strides=(info.shape[0], *info.strides))
            T = cfg.max_num_batched_tokens
            cols = info.shape[1] if len(info.shape) == 2 else -1
            if not 0 <= cols <= T:
                raise ValueError(f"{name} must be int64 or int32 with shape ({G}, <= {T}), got shape {info.shape}")
            check_matrix(
                name,
                info,
                dtypes=(INT64, INT32),
                min_rows=G,
                rows=G,
                cols=cols,
                shape_text=f"({G}, <= {T})",
                device=dev,
            )
            f["verify_slots"] = info.ptr
            f["verify_stride"] = info.strides[0] if G > 1 else cols
            f["verify_tokens"] = cols
            f["verify_is_32"] = int(info.dtype == INT32)
        return f

    def _write(self, P, f: dict) -> None:
        for k, v in f.items():
            if isinstance(v, list):
                arr = getattr(P, k)
                for g, x in enumerate(v):
                    arr[g] = x
            else:
                setattr(P, k, v)

    # -- per call -------------------------------------------------------------------
    def compute(
        self,
        idx_mapping,
        query_start_loc,
        seq_lens,
        num_rejected,
        num_sampled,
        block_tables,
        num_blocks=None,
        verify_slot_mappings=None,
        *,
        stream=None,
    ) -> VllmDraftOutputs:
        """Every draft forward's addressing after a verify step, in one launch.

        Parameters
        ----------
        idx_mapping : int32 or int64 [num_reqs], device array
            Batch index -> request-state row; -1 for a dummy request.
        query_start_loc : int32 [num_reqs + 1], device array
            The verify step's.
        seq_lens, num_rejected, num_sampled : int32 [>= num_reqs], device arrays
            The verify step's ``seq_lens_t``; drafts scheduled minus accepted (0 in chunked
            prefill); accepted + 1 (0 in chunked prefill).
        block_tables : sequence of G int32 [rows, width_g] device arrays (one array for one group)
            By row; the last dim contiguous.
        num_blocks : sequence of G int32 [rows], optional
            Allocated blocks per row (a block index at or past it: error bit 16). None: the width.
        verify_slot_mappings : int64 or int32 [G, T_v] (T_v <= max_num_batched_tokens), optional
            The verify step's slot mappings; required with ``mask_rejected``; without it the
            capacity check uses ``max_num_batched_tokens``.
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional

        Returns
        -------
        VllmDraftOutputs
            The persistent output buffers.
        """
        stream = self._stream(stream)
        idx, qsl = check_batch(idx_mapping, query_start_loc, self.config.max_num_reqs, self.device)
        n = idx.shape[0]
        f = self._check_state((seq_lens, num_rejected, num_sampled), n, block_tables, num_blocks, verify_slot_mappings)
        P = self._params
        self._write(P, f)
        P.idx_mapping, P.num_reqs, P.idx_is_64, P.query_start_loc = idx.ptr, n, int(idx.dtype == INT64), qsl.ptr
        self._launcher(self.grid, THREADS, stream)
        return self.outputs

    def bind(
        self,
        seq_lens,
        num_rejected,
        num_sampled,
        block_tables,
        num_blocks=None,
        verify_slot_mappings=None,
        *,
        idx_mapping=None,
        query_start_loc=None,
        stream=None,
    ) -> BoundVllmDraft | BoundVllmDraftBatch:
        """Bind the persistent arrays once; :meth:`BoundVllmDraft.launch` then takes the verify
        step's ``idx_mapping`` and ``query_start_loc`` only.

        ``seq_lens``, ``num_rejected`` and ``num_sampled`` are bound as persistent
        ``[>= max_num_reqs]`` buffers (the engine's, indexed by batch row); the others as for
        :meth:`compute`. They are checked now, and again at a launch where one's signature
        (pointer, device, shape, strides, dtype) or a bound list's items changed.

        With ``idx_mapping`` and ``query_start_loc`` (vLLM's persistent batch buffers, int32 or
        int64 ``[rows]`` and int32 ``[>= rows + 1]``), they are bound too and the result is a
        :class:`BoundVllmDraftBatch`, whose ``launch(num_reqs)`` takes one int.
        """
        if not self._launcher.fast:
            raise TypeError("bind needs CuPy's driver.launchKernel")
        state = (seq_lens, num_rejected, num_sampled, block_tables, num_blocks, verify_slot_mappings)
        if idx_mapping is None and query_start_loc is None:
            return BoundVllmDraft(self, state, stream)
        if idx_mapping is None or query_start_loc is None:
            raise ValueError("bind takes idx_mapping and query_start_loc together (the batch buffers), or neither")
        return BoundVllmDraftBatch(self, state, stream, idx_mapping=idx_mapping, query_start_loc=query_start_loc)

    def errors(self, stream=None) -> tuple[int, int]:
        """Synchronise; ``(error_mask, first_bad_key)`` of every launch since the last read, then
        clear them (sticky records, as the vLLM step's)."""
        return self._errors.read(stream)

    def check(self, stream=None) -> None:
        """Synchronise; raise :class:`~kvaddr.engines.spec_reference.DraftAddressingError` naming
        the first bad value since the last read."""
        self._errors.check(stream)

    def clear_errors(self, stream=None) -> None:
        """Clear the error records on ``stream`` (no synchronisation)."""
        self._errors.clear(stream)


def _per_group(name: str, value, G: int) -> list:
    if hasattr(value, "shape") or hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__"):
        if G == 1:
            return [value]
        raise ValueError(f"{name} must be a sequence of {G} arrays (one per group), got one array")
    if isinstance(value, (list, tuple)):
        if len(value) != G:
            raise ValueError(f"{name} must be a sequence of {G} arrays (one per group), got {len(value)}")
        return list(value)
    raise TypeError(f"{name} must be an array or a sequence of {G} arrays, got {type(value).__name__}")


class BoundVllmDraft:
    """The draft addressing bound to the engine's persistent arrays (:meth:`VllmDraftPlanner.bind`).

    :meth:`launch` checks ``idx_mapping`` and ``query_start_loc`` in full (the checks and
    messages of :meth:`VllmDraftPlanner.compute`), compares the bound arrays' signatures, writes
    four fields and calls ``cuLaunchKernel`` with this binding's own parameter block. It holds a
    reference to every bound array.
    """

    __slots__ = (
        "_args",
        "_args_ptr",
        "_arrays",
        "_checks",
        "_fast",
        "_planner",
        "_resolve",
        "_same",
        "_state",
        "_stream",
        "_written",
        "params",
    )

    def __init__(self, planner: VllmDraftPlanner, state: tuple, stream=None):
        self._planner = planner
        self.params = VllmDraftParams.from_buffer_copy(planner._params)
        self._args = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self._args_ptr = ctypes.addressof(self._args)
        self._state = state
        self._arrays = tuple(x for x in state if x is not None)  # what the guard compares
        self._written = None  # the batch fields last written into the parameter block
        self._fast = planner._launcher.driver[:2]
        self._resolve = StreamResolver()
        self._stream = None if stream is None else self._resolve(stream)
        self._checks: dict = {}
        self._same = None
        self._bind_state()

    def _bind_state(self) -> None:
        self._same = None
        pl = self._planner
        s = self._state
        f = pl._check_state(s[:3], pl.config.max_num_reqs, s[3], s[4], s[5])
        pl._write(self.params, f)
        self._same = memo_guard(self._arrays)

    def launch(self, idx_mapping, query_start_loc, *, stream=None) -> VllmDraftOutputs:
        """The draft addressing of this verify step, in one launch.

        Parameters
        ----------
        idx_mapping : int32 or int64 [num_reqs], device array
        query_start_loc : int32 [num_reqs + 1], device array
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            The stream given to ``bind`` by default, else CuPy's current stream.

        Returns
        -------
        VllmDraftOutputs
        """
        if stream.__class__ is not int:
            stream = self._stream if stream is None and self._stream is not None else self._resolve(stream)
        same = self._same
        if same is None or not same(*self._arrays):
            self._bind_state()
        pl = self._planner
        key = (idx_mapping.__class__, query_start_loc.__class__)
        check = self._checks.get(key, False)
        if check is False:
            check = self._checks[key] = _fast_batch_check(
                idx_mapping, query_start_loc, pl.config.max_num_reqs, pl.device
            )
        batch = None if check is None else check(idx_mapping, query_start_loc)
        if batch is None:
            idx, qsl = check_batch(idx_mapping, query_start_loc, pl.config.max_num_reqs, pl.device)
            batch = (idx.ptr, idx.shape[0], idx.dtype == INT64, qsl.ptr)
        if batch != self._written:  # (vLLM's slices of persistent buffers keep their pointers)
            P = self.params
            P.idx_mapping, P.num_reqs, P.idx_is_64, P.query_start_loc = batch
            self._written = batch
        self._fast[0](self._fast[1], pl.grid, 1, 1, THREADS, 1, 1, 0, stream, self._args_ptr, 0)
        return pl.outputs


class BoundVllmDraftBatch(BoundVllmDraft):
    """The draft addressing bound to the persistent arrays AND the batch buffers: :meth:`launch`
    takes one int.

    vLLM's ``idx_mapping`` and ``query_start_loc`` are slices ``[:num_reqs]`` and
    ``[:num_reqs + 1]`` of persistent buffers. Bound whole (``VllmDraftPlanner.bind(...,
    idx_mapping=buffer, query_start_loc=buffer)``), they are checked once with the other bound
    arrays and their pointers written into this binding's parameter block; a verify step is then
    ``launch(num_reqs)``: the int checked (once per value), the struct's count written when it
    changed, and ``cuLaunchKernel`` called. Nothing is described or compared per launch: an
    in-place change of a bound array is not seen, except by :meth:`check_bound` (bind again
    after a deliberate change). Built by :meth:`VllmDraftPlanner.bind`.

    Attributes
    ----------
    max_num_reqs : int
        The largest ``num_reqs`` :meth:`launch` accepts: the bound ``idx_mapping``'s length,
        ``len(query_start_loc) - 1`` and the planner's ``max_num_reqs``, whichever is least.
    """

    __slots__ = ("_batch", "_counts", "_fn", "_fp", "_grid", "_n", "_outputs", "max_num_reqs")

    def __init__(self, planner: VllmDraftPlanner, state: tuple, stream=None, *, idx_mapping, query_start_loc):
        super().__init__(planner, state, stream)
        self._batch = (idx_mapping, query_start_loc)
        ip, n_idx, is64, qp, n_qsl = check_batch_buffers(idx_mapping, query_start_loc, planner.device)
        P = self.params
        P.idx_mapping = ip  # [rows], int32 or int64: the batch is its first num_reqs entries
        P.idx_is_64 = int(is64)
        P.query_start_loc = qp  # [>= rows + 1], int32: the batch's are its first num_reqs + 1 entries
        P.num_reqs = 0
        self._n = 0  # the count last written
        self.max_num_reqs = min(n_idx, n_qsl - 1, planner.config.max_num_reqs)
        self._counts = frozenset()  # the counts already checked
        self._same = memo_guard(self._arrays + self._batch)
        self._fn, self._fp = self._fast  # cuLaunchKernel and the function (no lookups per launch)
        self._grid, self._outputs = planner.grid, planner.outputs

    def check_bound(self) -> None:
        """Raise ValueError when a bound array (or a bound list's item) changed since ``bind``:
        its pointer, shape, strides, dtype or device."""
        same = self._same
        if same is not None:
            if not same(*self._arrays, *self._batch):
                raise ValueError(
                    "a bound array changed since bind (pointer, shape, strides, dtype or device): bind again"
                )
            return
        pl, s, P = self._planner, self._state, self.params  # no cheap guard: every check again
        f = pl._check_state(s[:3], pl.config.max_num_reqs, s[3], s[4], s[5])
        probe = VllmDraftParams.from_buffer_copy(P)
        pl._write(probe, f)
        ip, n_idx, is64, qp, n_qsl = check_batch_buffers(*self._batch, pl.device)
        if (
            bytes(probe) != bytes(P)
            or (ip, int(is64), qp) != (P.idx_mapping, P.idx_is_64, P.query_start_loc)
            or min(n_idx, n_qsl - 1, pl.config.max_num_reqs) != self.max_num_reqs
        ):
            raise ValueError("a bound array changed since bind (pointer, shape or dtype): bind again")

    def launch(self, num_reqs: int, *, stream=None) -> VllmDraftOutputs:
        """The draft addressing of the verify step over the bound buffers' first ``num_reqs``
        batch entries, in one launch.

        Parameters
        ----------
        num_reqs : int
            Requests of the verify step, ``0 <= num_reqs <=`` :attr:`max_num_reqs`.
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            The stream given to ``bind`` by default, else CuPy's current stream.

        Returns
        -------
        VllmDraftOutputs
            The planner's persistent outputs.

        Raises
        ------
        TypeError, ValueError
            ``num_reqs`` is not an int in ``[0, max_num_reqs]``.
        """
        if num_reqs not in self._counts or num_reqs.__class__ is not int:
            num_reqs = check_int("num_reqs", num_reqs, lo=0, hi=self.max_num_reqs)
            self._counts = self._counts | {num_reqs}
        if stream.__class__ is not int:
            stream = self._stream if stream is None and self._stream is not None else self._resolve(stream)
        if num_reqs != self._n:
            self.params.num_reqs = self._n = num_reqs
        self._fn(self._fp, self._grid, 1, 1, THREADS, 1, 1, 0, stream, self._args_ptr, 0)
        return self._outputs


def _fast_batch_check(idx, qsl, max_num_reqs: int, device: int):
    kind = array_kind(idx)
    if not kind or array_kind(qsl) != kind:
        return None
    if kind == "cupy":
        return cupy_batch_check(max_num_reqs, device)
    import sys

    torch = sys.modules.get("torch")
    return None if torch is None else torch_batch_check(max_num_reqs, device, torch.int32, torch.int64)
