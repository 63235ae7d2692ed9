"""StepPlanner: the fused step, one kernel launch for a whole step's addressing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from kvaddr import dispatch, kernel_loader
from kvaddr.attention_reference import check_kv_indices_capacity, normalize_attention
from kvaddr.device import require_cuda
from kvaddr.dispatch import attention_meta_geometry
from kvaddr.errors import AddressingError, clean_error_records
from kvaddr.host import ErrorRecords, Memo, StreamResolver
from kvaddr.outputs import PAD_PAGE_ID, AttentionOutputs, DsaOutputs, StepOutputs
from kvaddr.validation import (
    INT32_MAX,
    MAX_REQUESTS,
    check_block_sizes,
    check_info,
    check_int,
    describe,
    memo_guard,
    normalize_tables,
    repeats,
    write_tables,
)

if TYPE_CHECKING:
    from kvaddr.bound_step import BoundStep
    from kvaddr.mtp import BoundDraftSteps, DraftOutputs

__all__ = ["StepPlanner", "attention_meta_geometry"]


class StepPlanner:
    """Owns a step's output buffers and computes its addressing in one launch.

    Sized once, at construction; :meth:`compute` then allocates nothing and never
    synchronises with the host, so a whole step can be captured in a CUDA graph,
    and replaying the graph after the inputs' contents change yields the new
    step's outputs. Bad values are recorded on the device; :meth:`check`
    synchronises and raises :class:`~kvaddr.errors.AddressingError`.

    Parameters
    ----------
    max_requests : int
        The largest batch (bsz) :meth:`compute` accepts (>= 1, < 2**27).
    capacity : int
        C, the most tokens a step may carry (>= 1); every output of length C is
        written on every call.
    block_sizes : int or sequence of int
        B of each cache (1 to 4 caches), each >= 1. An empty sequence makes a
        positions-only planner (no slot mapping), kvaddr's position kernel.
    position_dtype : numpy dtype, default int64
        ``np.int64`` or ``np.int32`` for ``position_ids``.
    device : int, optional
        CUDA device ordinal; the current device by default.
    attention : None, str or sequence of str, optional
        Attention-metadata groups to write in the same launch (docs/attention.md):
        any of ``"flashinfer"``, ``"varlen"``, ``"page_table"`` (a sequence or a
        comma-separated string). None (default) asks for none and costs nothing:
        the launch is the one without attention outputs.
    kv_indices_capacity : int, optional
        N, the entries of each cache's ``kv_indices`` (``[num_caches, N]`` int32,
        fixed here); required with ``"flashinfer"``, ignored otherwise. More
        entries in a step set error bit 16; nothing is written past N.
    draft_steps : int, optional
        k >= 1, the substeps of an MTP draft model (FastDeploy): enables
        :meth:`compute_draft_steps`, which writes all k substeps' outputs (each one
        :meth:`compute`'s) in one launch into buffers with a leading ``[k]``
        dimension (docs/spec-decode.md). None (default) allocates nothing for it.
    dsa : bool, default False
        Also write DeepSeek-V3.2 sparse attention's per-step addressing in the same launch
        (docs/dsa.md): each token's indexer-cache byte offsets (values and scale), its
        context length, the prefill key ranges ``ks`` / ``ke`` and the prefills'
        ``cu_seq_lens`` (``StepOutputs.dsa``). False (default) costs nothing.
    dsa_cache : int, optional
        The indexer cache among ``block_sizes`` (its table and B address the offsets); the
        last cache by default.
    dsa_decode_len : int, default 1
        n, the query tokens of a decode (1 + speculative tokens): a request running
        1 to n tokens is a decode, one running more a prefill.
    dsa_value_bytes, dsa_scale_bytes : int, default 128 and 4
        V and S, the value and scale bytes of one token in the indexer cache, whose blocks
        hold ``[B * V | B * S]``.

    Examples
    --------
    >>> planner = StepPlanner(max_requests=64, capacity=64, block_sizes=[64, 64])
    >>> out = planner.compute(seq_lens_decoder, seq_lens_this_time, block_tables)
    >>> out.slot_mapping.shape
    (2, 64)
    >>> planner.check()  # optional: synchronises, raises on bad values
    >>> p2 = StepPlanner(64, 64, [64], attention="flashinfer,varlen", kv_indices_capacity=64 * 512)
    >>> a = p2.compute(seq_lens_decoder, seq_lens_this_time, block_tables).attention
    >>> a.kv_indices.shape, a.kv_indptr.shape  # [G, N], [G, bsz + 1]
    ((1, 32768), (1, 65))
    """

    def __init__(
        self,
        max_requests: int,
        capacity: int,
        block_sizes: int | Sequence[int],
        *,
        position_dtype: DTypeLike = np.int64,
        device: int | None = None,
        attention: str | Sequence[str] | None = None,
        kv_indices_capacity: int | None = None,
        draft_steps: int | None = None,
        dsa: bool = False,
        dsa_cache: int | None = None,
        dsa_decode_len: int = 1,
        dsa_value_bytes: int = 128,
        dsa_scale_bytes: int = 4,
    ) -> None:
        require_cuda(device)  # NoCudaDevice, one sentence, without CuPy, a driver or a GPU
        import cupy

        consts = kernel_loader.constants()
        self.max_requests = check_int("max_requests", max_requests, lo=1, hi=MAX_REQUESTS - 1)
        self.capacity = check_int("capacity", capacity, lo=1, hi=INT32_MAX - 1)
        self.block_sizes = check_block_sizes(block_sizes, max_caches=consts["KV_MAX_CACHES"], allow_empty=True)
        self.num_caches = len(self.block_sizes)
        self.position_dtype = np.dtype(position_dtype)
        if self.position_dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
            raise TypeError(f"position_dtype must be int64 or int32, got {self.position_dtype}")
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        #: The attention groups asked for, in ATTENTION_GROUPS order (``()``: none).
        self.attention = normalize_attention(attention)
        #: N, entries of each cache's kv_indices (None without "flashinfer").
        self.kv_indices_capacity = check_kv_indices_capacity(self.attention, kv_indices_capacity)
        if ("flashinfer" in self.attention or "page_table" in self.attention) and self.num_caches == 0:
            raise ValueError("attention 'flashinfer' and 'page_table' need at least one cache (block_sizes is empty)")
        if not isinstance(dsa, (bool, np.bool_)):
            raise TypeError(f"dsa must be a bool, got {dsa!r}")
        #: DSA outputs asked for (docs/dsa.md): the launch's second grid row writes them.
        self.dsa = bool(dsa)
        if self.dsa:
            if self.num_caches == 0:
                raise ValueError("dsa needs at least one cache (block_sizes is empty): the indexer cache's")
            last = self.num_caches - 1
            self.dsa_cache = last if dsa_cache is None else check_int("dsa_cache", dsa_cache, lo=0, hi=last)
            self.dsa_decode_len = check_int("dsa_decode_len", dsa_decode_len, lo=1, hi=INT32_MAX)
            self.dsa_value_bytes = check_int("dsa_value_bytes", dsa_value_bytes, lo=1, hi=1 << 20)
            self.dsa_scale_bytes = check_int("dsa_scale_bytes", dsa_scale_bytes, lo=1, hi=1 << 20)
        sms = 132
        if self.attention:
            props = cupy.cuda.runtime.getDeviceProperties(self.device)
            sms = int(props.get("multiProcessorCount", 132) or 132)
        #: What the kernel choice depends on (kvaddr.dispatch: the one table every entry point reads).
        self.config = cfg = dispatch.StepConfig(
            num_caches=self.num_caches,
            position_int64=self.position_dtype == np.int64,
            capacity=self.capacity,
            max_requests=self.max_requests,
            attention=self.attention,
            kv_indices_capacity=self.kv_indices_capacity,
            sms=sms,
            dsa=self.dsa,
        )
        rec = dispatch.step_records(cfg)
        self._num_chunks, self._max_tiles, self._num_meta = rec.chunks, rec.tiles, rec.num_meta
        #: k of :meth:`compute_draft_steps` (None: the planner has no MTP substeps).
        self.draft_steps = None if draft_steps is None else check_int("draft_steps", draft_steps, lo=1, hi=1024)
        if self.draft_steps is not None and self.dsa:
            raise ValueError(
                "draft_steps and dsa=True cannot be combined: the MTP substeps do not write the DSA outputs "
                "(build the draft model's planner without dsa)"
            )
        num_records = rec.records
        kernels = dispatch.step_kernels(cfg)
        if self.draft_steps is not None:
            num_records = max(num_records, dispatch.mtp_records(cfg, self.draft_steps))
            kernels = (*kernels, dispatch.mtp_launch(cfg).kernel)
        C = self.capacity
        with cupy.cuda.Device(self.device):
            # Every kernel the dispatch table may choose for this configuration, compiled now (one
            # module, cached on disk): compute() never compiles, so a first step can be captured.
            self._functions = kernel_loader.load_kernels(kernels, self.device)
            self.cu_seqlens_q = cupy.zeros(self.max_requests + 1, dtype=np.int32)
            self.num_tokens = cupy.zeros((), dtype=np.int32)
            self.batch_id_per_token = cupy.full(C, -1, dtype=np.int32)
            self.position_ids = cupy.zeros(C, dtype=self.position_dtype)
            self.seq_lens_kv = cupy.zeros(self.max_requests, dtype=np.int32)
            self.slot_mapping = cupy.full((self.num_caches, C), -1, dtype=np.int64)
            self._attention_buffers(cupy, consts)
            self._dsa_buffers(cupy)
            # Sticky records, one per warp of the largest launch of any kernel above: cleared
            # here, then only by errors() / check() / clear_errors().
            clean = clean_error_records(num_records).reshape(-1)
            self._records = cupy.asarray(clean)
            self._errors = ErrorRecords(self._records, clean, self.device, AddressingError)
            self._state = cupy.zeros(4, dtype=np.uint32)
            self._tile_status = cupy.zeros(max(self._max_tiles, 1), dtype=np.uint64)
            # The buffers were initialised on CuPy's current stream; compute() may run on
            # any other (a non-blocking or torch stream) with nothing ordering the two, so
            # finish initialising here (construction is off the hot path).
            cupy.cuda.get_current_stream().synchronize()
        # The kernels' one parameter, a KvStepParams struct filled by name: what never
        # changes is set once here; _prepare writes the inputs (and bsz) per call.
        P = self._params = kernel_loader.StepParams()
        P.capacity = C  # int32
        P.num_caches = self.num_caches  # int32
        for g in range(kernel_loader.MAX_CACHES):
            P.max_blocks[g] = 1  # int32: an unused cache's width (set per call for used ones)
            P.block_size[g] = self.block_sizes[g] if g < self.num_caches else 1  # int32
        P.cu_seqlens_q = self.cu_seqlens_q.data.ptr  # [max_requests + 1], int32
        P.num_tokens = self.num_tokens.data.ptr  # [], int32
        P.batch_id_per_token = self.batch_id_per_token.data.ptr  # [C], int32
        P.position_ids = self.position_ids.data.ptr  # [C], int64 / int32 (position_dtype)
        P.seq_lens_kv = self.seq_lens_kv.data.ptr  # [max_requests], int32
        P.slot_mapping = self.slot_mapping.data.ptr  # [num_caches, C], int64
        P.error_records = self._records.data.ptr  # [records, 2], uint64
        P.max_tiles = self._max_tiles  # int32
        P.tile_state = self._state.data.ptr  # [4], uint32
        P.tile_status = self._tile_status.data.ptr  # [max(max_tiles, 1)], uint64
        self._attention_params(P)
        self._dsa_params(P)
        # Views of the per-cache arrays (sharing P's memory): written per call without
        # building a new ctypes array view each time.
        self._p_tables, self._p_strides, self._p_widths = P.block_tables, P.table_stride, P.max_blocks
        self._launchers = {
            name: kernel_loader.Launcher(fn, P, by_value=True)
            for name, fn in self._functions.items()
            if not name.startswith("mtp_")
        }
        self._draft = None
        if self.draft_steps is not None:
            from kvaddr.mtp import DraftPlan

            with cupy.cuda.Device(self.device):
                self._draft = DraftPlan(self, cupy, self.draft_steps, self._functions)
                cupy.cuda.get_current_stream().synchronize()
        self._plans: dict = {}  # bsz -> (launcher, blocks, threads)
        self._views: dict = {}
        # compute()'s memo of the last checked inputs (_prepare sets it, see _remember).
        self._memo: Memo | None = None
        #: Let compute() skip the checks for the same inputs with unchanged signatures (see
        #: ``_remember``); False checks everything on every call.
        self.memoize_checks = True
        self._last_args: tuple | None = None  # the last checked call's arguments (see _remember)
        self._stream = StreamResolver()

    # -- kernel choice (kvaddr.dispatch) ---------------------------------------------------
    def kernel_for(self, bsz: int) -> tuple[str, int, int]:
        """``(kernel, blocks, threads per block)`` :meth:`compute` launches for ``bsz`` requests:
        the dispatch table's choice (:func:`kvaddr.dispatch.step_launch`) for this planner."""
        launch = dispatch.step_launch(self.config, bsz)
        return launch.kernel, launch.blocks, launch.threads

    def grid(self, bsz: int) -> int:
        """Blocks of the launch for a batch of ``bsz`` requests (metadata blocks included)."""
        return self._launch_plan(bsz)[1]

    def _launch_plan(self, bsz: int) -> tuple:
        """``(launcher, blocks, threads)`` of the launch for ``bsz`` requests (see :meth:`kernel_for`)."""
        plan = self._plans.get(bsz)
        if plan is None:
            launch = dispatch.step_launch(self.config, bsz)
            plan = self._plans[bsz] = (self._launchers[launch.kernel], launch.blocks, launch.threads)
        return plan

    def _bound_plan(self, bsz: int) -> tuple[int, int, int]:
        """``(function pointer, blocks, threads)`` of the launch for ``bsz`` (a bound launch's)."""
        launcher, blocks, threads = self._launch_plan(bsz)
        return int(launcher.fn.ptr), blocks, threads

    @property
    def launches_per_step(self) -> int:
        return 1

    # -- DSA outputs (docs/dsa.md) -------------------------------------------
    def _dsa_buffers(self, cupy) -> None:
        """Allocate the DSA outputs when asked for."""
        C = self.capacity
        self._grid_y = 2 if self.dsa else 1
        self.dsa_value_offsets = self.dsa_scale_offsets = None
        self.dsa_ks = self.dsa_ke = self.dsa_ctx = self.dsa_cu_seq_lens = None
        if self.dsa:
            self.dsa_value_offsets = cupy.full(C, -1, dtype=np.int64)
            self.dsa_scale_offsets = cupy.full(C, -1, dtype=np.int64)
            self.dsa_ks = cupy.zeros(C, dtype=np.int32)
            self.dsa_ke = cupy.zeros(C, dtype=np.int32)
            self.dsa_ctx = cupy.zeros(C, dtype=np.int32)
            self.dsa_cu_seq_lens = cupy.zeros(self.max_requests + 1, dtype=np.int32)

    def _dsa_params(self, P) -> None:
        """The DSA fields of the kernel's parameter struct (fixed at construction)."""
        if not self.dsa:
            return  # dsa = 0 and null pointers: one grid row
        P.dsa_value_offsets = self.dsa_value_offsets.data.ptr  # [C], int64
        P.dsa_scale_offsets = self.dsa_scale_offsets.data.ptr  # [C], int64
        P.dsa_ks = self.dsa_ks.data.ptr  # [C], int32
        P.dsa_ke = self.dsa_ke.data.ptr  # [C], int32
        P.dsa_ctx = self.dsa_ctx.data.ptr  # [C], int32
        P.dsa_cu_seq_lens = self.dsa_cu_seq_lens.data.ptr  # [max_requests + 1], int32
        P.dsa = 1  # int32
        P.dsa_cache = self.dsa_cache  # int32
        P.dsa_decode_len = self.dsa_decode_len  # int32: n
        P.dsa_value_bytes = self.dsa_value_bytes  # int32: V
        P.dsa_scale_bytes = self.dsa_scale_bytes  # int32: S
        P.dsa_cu_len = self.max_requests + 1  # int32

    def _dsa_outputs(self):
        """DsaOutputs views (None when off)."""
        if not self.dsa:
            return None
        return DsaOutputs(
            value_offsets=self.dsa_value_offsets,
            scale_offsets=self.dsa_scale_offsets,
            ks=self.dsa_ks,
            ke=self.dsa_ke,
            ctx=self.dsa_ctx,
            cu_seq_lens=self.dsa_cu_seq_lens,
            req_id_per_token=self.batch_id_per_token,  # the same buffer, no copy
        )

    # -- attention outputs (docs/attention.md) ------------------------------
    def _attention_buffers(self, cupy, consts) -> None:
        """Allocate the attention outputs asked for."""
        groups, G = self.attention, self.num_caches
        fi = "flashinfer" in groups
        self._attn_flags = (
            (consts["KV_ATTN_FLASHINFER"] if fi else 0)
            | (consts["KV_ATTN_VARLEN"] if "varlen" in groups else 0)
            | (consts["KV_ATTN_PAGE_TABLE"] if "page_table" in groups else 0)
        )
        self._attn_stride = self.max_requests + 1
        N = self.kv_indices_capacity or 1
        self._meta_entries, self._meta_per_cache, _ = self.config.meta
        self.kv_indptr = self.kv_indices = self.kv_last_page_len = None
        self.cu_seqlens_k = self.max_seqlen = None
        if fi:
            self.kv_indptr = cupy.zeros((G, self._attn_stride), dtype=np.int32)
            self.kv_indices = cupy.full((G, N), PAD_PAGE_ID, dtype=np.int32)
            self.kv_last_page_len = cupy.zeros((G, self._attn_stride), dtype=np.int32)
        if "varlen" in groups:
            self.cu_seqlens_k = cupy.zeros(self.max_requests + 1, dtype=np.int32)
            self.max_seqlen = cupy.zeros(2, dtype=np.int32)
        self._page_table_key = None
        self._page_table = None

    def _attention_params(self, P) -> None:
        """The attention fields of the kernel's parameter struct (fixed at construction)."""
        ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
        P.kv_indptr = ptr(self.kv_indptr)  # [G, attn_stride], int32
        P.kv_indices = ptr(self.kv_indices)  # [G, N], int32
        P.kv_last_page_len = ptr(self.kv_last_page_len)  # [G, attn_stride], int32
        P.cu_seqlens_k = ptr(self.cu_seqlens_k)  # [max_requests + 1], int32
        P.max_seqlen = ptr(self.max_seqlen)  # [2], int32
        P.attention = self._attn_flags  # int32: KV_ATTN_* bits
        P.kv_indices_capacity = self.kv_indices_capacity or 1  # int32: N
        P.attn_stride = self._attn_stride  # int32
        P.meta_per_cache = self._meta_per_cache  # int32
        P.meta_entries = self._meta_entries  # int32: E
        P.num_meta = self._num_meta  # int32

    def _attention_outputs(self, bsz: int):
        """AttentionOutputs views for a batch of bsz (page_table set per call), None when off."""
        groups = self.attention
        if not groups:
            return None
        a = AttentionOutputs()
        if "flashinfer" in groups:
            a.qo_indptr = self.cu_seqlens_q[: bsz + 1]  # the same buffer, no copy
            a.kv_indptr = self.kv_indptr[:, : bsz + 1]
            a.kv_indices = self.kv_indices
            a.kv_last_page_len = self.kv_last_page_len[:, :bsz]
        if "varlen" in groups:
            a.cu_seqlens_k = self.cu_seqlens_k[: bsz + 1]
            a.seqused_k = self.seq_lens_kv[:bsz]  # the same buffer, no copy
            a.max_seqlen_q = self.max_seqlen[0]
            a.max_seqlen_k = self.max_seqlen[1]
        return a

    def _set_page_table(self, tables, bsz: int) -> None:
        """page_table: rows [0, bsz) of each cache's table (views, cached per tables and bsz)."""
        key = (tuple(id(t) for t in tables), bsz)
        if key != self._page_table_key:
            views = []
            for t in tables:
                try:
                    views.append(t[:bsz])
                except TypeError:  # an object with only __cuda_array_interface__
                    import cupy

                    views.append(cupy.asarray(t)[:bsz])
            self._page_table, self._page_table_key = tuple(views), key
            self._page_table_refs = tables  # keeps the ids in the key valid

    def _outputs(self, bsz: int) -> StepOutputs:
        out = self._views.get(bsz)
        if out is None:
            out = self._views[bsz] = StepOutputs(
                cu_seqlens_q=self.cu_seqlens_q[: bsz + 1],
                num_tokens=self.num_tokens,
                batch_id_per_token=self.batch_id_per_token,
                position_ids=self.position_ids,
                seq_lens_kv=self.seq_lens_kv[:bsz],
                slot_mapping=self.slot_mapping,
                attention=self._attention_outputs(bsz),
                dsa=self._dsa_outputs(),
            )
        if self._page_table_key is not None:
            out.attention.page_table = self._page_table
        return out

    def _set_tables(self, block_tables, bsz: int) -> None:
        if self.num_caches == 0:
            return
        tables = write_tables(
            block_tables, self.num_caches, bsz, self.device, self._p_tables, self._p_strides, self._p_widths
        )
        if "page_table" in self.attention:
            self._set_page_table(tables, bsz)

    def _prepare(self, seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder) -> int:
        """Check the inputs and write them into the parameter block; returns bsz."""
        self._memo = None  # the parameter block is being rewritten: forget the last inputs first
        dec = check_info("seq_lens_decoder", describe("seq_lens_decoder", seq_lens_decoder), ndim=1, device=self.device)
        bsz = dec.shape[0]
        q = check_info(
            "seq_lens_this_time", describe("seq_lens_this_time", seq_lens_this_time), ndim=1, device=self.device
        )
        if q.shape[0] != bsz:
            raise ValueError(
                f"seq_lens_this_time must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got {q.shape}"
            )
        if seq_lens_encoder is not None:
            enc = check_info(
                "seq_lens_encoder", describe("seq_lens_encoder", seq_lens_encoder), ndim=1, device=self.device
            )
            if enc.shape[0] != bsz:
                raise ValueError(
                    f"seq_lens_encoder must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got {enc.shape}"
                )
        if bsz > self.max_requests:
            raise ValueError(
                f"seq_lens_decoder must have at most max_requests = {self.max_requests} entries, got {bsz}"
            )
        self._set_tables(block_tables, bsz)
        P = self._params
        P.seq_lens_decoder = dec.ptr  # [bsz], int32
        P.seq_lens_this_time = q.ptr  # [bsz], int32
        P.bsz = bsz  # int32
        self._remember(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder, bsz)
        return bsz

    def _remember(self, dec, q, block_tables, enc, bsz: int) -> None:
        """Memoise the inputs just checked and written, for compute()'s fast path, when they are
        the objects of the checked call before (``validation.repeats``; a list of tables by its
        items): the second checked call with the same objects makes the memo, and a call with new
        objects costs the checks alone.

        The memo's guard (``validation.memo_guard``) holds the argument objects themselves (so
        their ids stay theirs), the table sequence's items (a list may be changed in place), and
        each distinct checked array's exact signature (pointer, device, shape, strides, dtype:
        everything the checks and the parameter block depend on, see
        ``validation.signature_getter``), read once per object. compute() skips the checks only
        when the same objects come back with equal signatures; anything else runs the full
        checks again. Arrays without a cheap signature (``__cuda_array_interface__``, DLPack,
        mixed CuPy and torch) and list/tuple subclasses are never memoised.
        """
        if not self.memoize_checks:
            return
        # The guard is built only when this call repeats the last checked call's objects (see
        # validation.repeats): new objects every step (an engine's fresh slices) never hit a memo.
        args, last = (dec, q, block_tables, enc), self._last_args
        self._last_args = args
        if not repeats(args, last):
            return
        tables = normalize_tables(block_tables, self.num_caches) if self.num_caches else []
        same = memo_guard((dec, q, block_tables, enc), [dec, q, *([] if enc is None else [enc]), *tables])
        if same is None:
            return
        launcher, blocks, threads = self._launch_plan(bsz)
        launch_kernel, function, params_ptr = launcher.driver or (None, 0, 0)
        self._memo = Memo(
            same=same,
            size=bsz,
            blocks=blocks,
            threads=threads,
            launch_kernel=launch_kernel,
            function=function,
            params_ptr=params_ptr,
            launcher=launcher,
            extra=tables if "page_table" in self.attention else None,
        )

    def launch_args(
        self, seq_lens_decoder: Any, seq_lens_this_time: Any, block_tables: Any = None, *, seq_lens_encoder: Any = None
    ) -> tuple[int, tuple]:
        """Check the inputs; return ``(bsz, args)``: the kernel's one argument, this
        planner's KvStepParams struct, as RawKernel arguments (a one-tuple holding a
        ``CPointer`` to the struct, for launching the bare RawKernel as the benchmark
        does). The struct is the planner's own: the next call rewrites it. A planner with
        ``dsa=True`` runs its kernel on a grid of two rows: ``(blocks, 2)``."""
        bsz = self._prepare(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder)
        return bsz, kernel_loader.function_args(self._params, by_value=True)

    def compute(
        self,
        seq_lens_decoder: Any,
        seq_lens_this_time: Any,
        block_tables: Any = None,
        *,
        seq_lens_encoder: Any = None,
        stream: Any = None,
    ) -> StepOutputs:
        """Compute the step's addressing in one kernel launch.

        Parameters
        ----------
        seq_lens_decoder : int32 [bsz], device array
            Tokens already in the KV cache per request (bsz <= max_requests).
        seq_lens_this_time : int32 [bsz], device array
            Tokens each request runs this step (0 for an idle slot).
        block_tables : int32 [rows >= bsz, max_blocks] device array, or a sequence of them
            One table shared by every cache, or one per cache; the last dim must
            be contiguous. Ignored by a positions-only planner.
        seq_lens_encoder : int32 [bsz], optional
            Checked, not needed for addressing.
        stream : cupy Stream, int handle, object with ``cuda_stream`` or ``__cuda_stream__``, optional
            Where to launch; CuPy's current stream by default.

        Returns
        -------
        StepOutputs
            CuPy views of this planner's buffers (overwritten by the next call).

        Notes
        -----
        The checks run in full on a call with new argument objects; once two checked calls
        in a row had the same objects, later calls with those objects, each with an
        unchanged pointer, device, shape, strides and dtype, skip them (they would pass
        again). The planner keeps a reference to the last inputs. ``memoize_checks = False``
        checks every call.
        """
        stream = self._stream(stream)
        # Fast path: the same argument objects as the last checked call, each array's signature
        # unchanged, so every check passes as it did and the parameter block already holds them.
        m = self._memo
        if m is not None and m.same(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder):
            bsz = m.size
            if m.launch_kernel is None:
                if self.dsa:  # the DSA blocks: the grid's second row
                    m.launcher(m.blocks, m.threads, stream, 2)
                else:
                    m.launcher(m.blocks, m.threads, stream)
            else:  # cuLaunchKernel straight (Launcher.__call__'s fast branch, inlined)
                m.launch_kernel(m.function, m.blocks, self._grid_y, 1, m.threads, 1, 1, 0, stream, m.params_ptr, 0)
            if m.extra is not None:  # page_table: rows [0, bsz) of these tables (a binding may have set others)
                self._set_page_table(m.extra, bsz)
            out = self._views.get(bsz)
            return self._outputs(bsz) if out is None or m.extra is not None else out
        bsz = self._prepare(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder)
        launcher, blocks, threads = self._launch_plan(bsz)
        if self.dsa:  # the DSA blocks: the grid's second row
            launcher(blocks, threads, stream, 2)
        else:
            launcher(blocks, threads, stream)
        return self._outputs(bsz)

    def bind(
        self,
        seq_lens_decoder: Any,
        seq_lens_this_time: Any,
        block_tables: Any = None,
        *,
        seq_lens_encoder: Any = None,
        stream: Any = None,
        debug: bool = False,
    ) -> BoundStep:
        """Bind persistent inputs once; the returned :class:`~kvaddr.bound_step.BoundStep`
        then only launches (``bound.launch(bsz)``), with no per-call checks.

        Parameters
        ----------
        seq_lens_decoder, seq_lens_this_time : int32 [rows], device arrays
            The engine's persistent length buffers (rows <= max_requests); each
            launch reads the first ``bsz <= rows`` entries.
        block_tables : int32 [>= rows, max_blocks] device array, or a sequence of them
            As for :meth:`compute`, with at least ``rows`` rows.
        seq_lens_encoder : int32 [rows], optional
            Checked once, not needed for addressing.
        stream : stream or int handle, optional
            The launches' default stream; CuPy's current stream at each launch if None.
        debug : bool, default False
            Re-check the bound arrays (``check_bound``) before every launch.

        Returns
        -------
        BoundStep
            Holds references to the bound arrays; writes this planner's outputs (the
            same buffers as :meth:`compute`). Bind again when a buffer is replaced.
        """
        from kvaddr.bound_step import BoundStep

        outputs = self._outputs
        if "page_table" in self.attention:  # the page table is rows [0, bsz) of the bound tables
            tables = normalize_tables(block_tables, self.num_caches)

            def outputs(bsz: int) -> StepOutputs:
                self._set_page_table(tables, bsz)
                return self._outputs(bsz)

        return BoundStep(
            params=kernel_loader.StepParams.from_buffer_copy(self._params),
            plan=self._bound_plan,
            device=self.device,
            max_requests=self.max_requests,
            num_caches=self.num_caches,
            seq_lens_decoder=seq_lens_decoder,
            seq_lens_this_time=seq_lens_this_time,
            block_tables=block_tables,
            seq_lens_encoder=seq_lens_encoder,
            stream=stream,
            outputs=outputs,
            debug=debug,
            grid_y=self._grid_y,
        )

    # -- MTP substeps (kvaddr/mtp.py, kvaddr/kernels/mtp.cuh) ----------------------------
    def _need_draft(self):
        if self._draft is None:
            raise ValueError("this planner has no MTP substeps: build it with draft_steps=k")
        return self._draft

    def compute_draft_steps(
        self, seq_lens_decoder: Any, accept_num: Any, block_tables: Any = None, *, stream: Any = None
    ) -> DraftOutputs:
        """Every MTP substep's addressing in one kernel launch (planner built with ``draft_steps=k``).

        Substep 0 runs ``accept_num[b]`` tokens over ``seq_lens_decoder[b]``; substep
        j >= 1 runs one token for each request with ``accept_num[b] > 0`` over
        ``seq_lens_decoder[b] + accept_num[b] + j - 1`` and none for the others
        (:func:`kvaddr.spec_reference.mtp_substep_lengths`). Substep j's outputs equal
        :meth:`compute`'s for those lengths, attention metadata included; errors go to
        the same records (:meth:`errors` gives the OR of every substep's bits and the
        smallest key of all).

        Parameters
        ----------
        seq_lens_decoder : int32 [bsz], device array
            Tokens in the draft model's cache, already rolled back by the rejected drafts.
        accept_num : int32 [bsz], device array
            Tokens each request accepted in the verify step (0 for an idle slot or a
            request still in chunked prefill).
        block_tables : int32 [rows >= bsz, max_blocks] device array, or a sequence of them
            As for :meth:`compute`.
        stream : stream, optional
            Where to launch; CuPy's current stream by default.

        Returns
        -------
        DraftOutputs
            Views of this planner's ``[k, ...]`` buffers (overwritten by the next call);
            ``.substep(j)`` is substep j's :class:`~kvaddr.outputs.StepOutputs`.
        """
        from kvaddr.mtp import prepare

        plan = self._need_draft()
        stream = self._stream(stream)
        bsz, page_table = prepare(self, plan, plan.params, seq_lens_decoder, accept_num, block_tables)
        plan.last_args = (seq_lens_decoder, accept_num, block_tables)  # alive while the launch reads them
        plan.launcher(plan.blocks, plan.threads, stream, plan.k)
        return plan.outputs(bsz, page_table)

    def bind_draft_steps(
        self, seq_lens_decoder: Any, accept_num: Any, block_tables: Any = None, *, stream: Any = None
    ) -> BoundDraftSteps:
        """Bind persistent MTP inputs once (checked as :meth:`compute_draft_steps` checks them);
        the returned :class:`~kvaddr.mtp.BoundDraftSteps` then only launches
        (``bound.launch()``), over all ``len(seq_lens_decoder)`` requests."""
        from kvaddr.mtp import BoundDraftSteps, prepare

        plan = self._need_draft()
        P = kernel_loader.MtpParams.from_buffer_copy(plan.params)
        bsz, page_table = prepare(self, plan, P, seq_lens_decoder, accept_num, block_tables)
        refs = (seq_lens_decoder, accept_num, block_tables)
        return BoundDraftSteps(plan, P, bsz, plan.outputs(bsz, page_table), refs, stream)

    def errors(self, stream: Any = None) -> tuple[int, int]:
        """Synchronise; every step's errors since the last read, then clear them.

        The error records are sticky (docs/spec.md, "Errors"): a launch only adds to them
        (a warp with an error merges its bits and first-bad key), so this returns the OR of
        the bits and the smallest key over every launch since the last :meth:`errors`,
        :meth:`check` or :meth:`clear_errors` (with one launch in between, that step's
        ``(error_mask, first_bad_key)``), and resets the records when something was set
        (a clean read launches nothing). Read on the stream the steps run on.

        Returns
        -------
        (int, int)
            ``(error_mask, first_bad_key)``; ``(0, NO_ERROR_KEY)`` when clean.
        """
        return self._errors.read(stream)

    def check(self, stream: Any = None) -> None:
        """Synchronise; raise AddressingError naming the request, token and reason of the first
        bad record since the last read (:meth:`errors`: the records are then clear)."""
        self._errors.check(stream)

    def clear_errors(self, stream: Any = None) -> None:
        """Clear the error records (mask 0, key all ones) on ``stream`` (CuPy's current one by
        default), dropping errors not read yet; no synchronisation. :meth:`errors` and
        :meth:`check` clear after reading already; this is for a fresh start (e.g. after
        a run whose errors were expected)."""
        self._errors.clear(stream)
