"""StepPlanner: the fused step, one kernel launch for a whole step's addressing."""

from __future__ import annotations

import numpy as np

from kvaddr import kernel_loader
from kvaddr.device import require_cuda
from kvaddr.errors import NO_ERROR_KEY, AddressingError
from kvaddr.outputs import StepOutputs
from kvaddr.validation import (
    INT32_MAX,
    MAX_REQUESTS,
    check_block_sizes,
    check_info,
    check_int,
    cupy_stream,
    describe,
    normalize_tables,
    stream_handle,
)


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

    Examples
    --------
    >>> planner = StepPlanner(max_requests=64, capacity=64, block_sizes=[64, 64])
    >>> out = planner.compute(seq_lens_decoder, seq_lens_this_time, block_tables)
    >>> out.slot_mapping.shape
    (2, 64)
    >>> planner.check()  # optional: synchronises, raises on bad values
    """

    def __init__(
        self, max_requests: int, capacity: int, block_sizes, *, position_dtype=np.int64, device: int | None = None
    ):
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

        tile, tokens = consts["KV_TILE"], consts["KV_TOKENS"]
        self._threads = consts["KV_THREADS"]
        self._tile = tile
        self._num_chunks = -(-self.capacity // tokens)
        self._max_tiles = -(-self.max_requests // tile) if self.max_requests > tile else 0
        C = self.capacity
        with cupy.cuda.Device(self.device):
            self._fn = kernel_loader.get_function(
                "kvaddr_step_i64" if self.position_dtype == np.int64 else "kvaddr_step_i32", self.device
            )
            self.cu_seqlens_q = cupy.zeros(self.max_requests + 1, dtype=np.int32)
            self.num_tokens = cupy.zeros((), dtype=np.int32)
            self.batch_id_per_token = cupy.full(C, -1, dtype=np.int32)
            self.position_ids = cupy.zeros(C, dtype=self.position_dtype)
            self.seq_lens_kv = cupy.zeros(self.max_requests, dtype=np.int32)
            self.slot_mapping = cupy.full((self.num_caches, C), -1, dtype=np.int64)
            n_rec = (self._num_chunks + self._max_tiles) * consts["KV_WARPS"]  # one per warp
            rec = np.empty(2 * n_rec, dtype=np.uint64)
            rec[0::2] = 0
            rec[1::2] = NO_ERROR_KEY
            self._records = cupy.asarray(rec)
            self._state = cupy.zeros(4, dtype=np.uint32)
            self._tile_status = cupy.zeros(max(self._max_tiles, 1), dtype=np.uint64)
            # The buffers were initialised on CuPy's current stream; compute() may run on
            # any other (a non-blocking or torch stream) with nothing ordering the two, so
            # finish initialising here (construction is off the hot path).
            cupy.cuda.get_current_stream().synchronize()
        # The kernel's one parameter, a KvStepParams struct filled by name: what never
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
        P.error_records = self._records.data.ptr  # [n_rec, 2], uint64
        P.max_tiles = self._max_tiles  # int32
        P.tile_state = self._state.data.ptr  # [4], uint32
        P.tile_status = self._tile_status.data.ptr  # [max(max_tiles, 1)], uint64
        # Views of the per-cache arrays (sharing P's memory): written per call without
        # building a new ctypes array view each time.
        self._p_tables, self._p_strides, self._p_widths = P.block_tables, P.table_stride, P.max_blocks
        self._launcher = kernel_loader.Launcher(self._fn, P, by_value=True)
        self._views: dict = {}

    # -- launch geometry -------------------------------------------------
    def grid(self, bsz: int) -> int:
        """Blocks of the launch for a batch of ``bsz`` requests."""
        if bsz <= self._tile:
            return self._num_chunks
        return self._num_chunks + -(-bsz // self._tile)

    @property
    def launches_per_step(self) -> int:
        return 1

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
            )
        return out

    def _set_tables(self, block_tables, bsz: int) -> None:
        if self.num_caches == 0:
            return
        tables = normalize_tables(block_tables, self.num_caches)
        many = self.num_caches > 1 and tables[0] is not tables[1]
        tables_p, strides_p, widths_p = self._p_tables, self._p_strides, self._p_widths
        info, last = None, None
        for g, t in enumerate(tables):
            if t is not last:
                info = check_info(
                    f"block_tables[{g}]" if many else "block_tables",
                    describe("block_tables", t),
                    ndim=2,
                    min_rows=bsz,
                    device=self.device,
                )
                if info.shape[1] > INT32_MAX:
                    raise ValueError("block_tables must have fewer than 2**31 columns")
                last = t
            tables_p[g] = info.ptr  # block_tables[g]: [rows >= bsz, max_blocks], int32
            strides_p[g] = info.strides[0]  # table_stride[g]: int64, elements
            widths_p[g] = info.shape[1]  # max_blocks[g]: int32

    def _prepare(self, seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder) -> int:
        """Check the inputs and write them into the parameter block; returns bsz."""
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
        return bsz

    def launch_args(self, seq_lens_decoder, seq_lens_this_time, block_tables=None, *, seq_lens_encoder=None):
        """Check the inputs; return ``(bsz, args)``: the kernel's one argument, this
        planner's KvStepParams struct, as RawKernel arguments (a one-tuple holding a
        ``CPointer`` to the struct, for launching the bare RawKernel as the benchmark
        does). The struct is the planner's own: the next call rewrites it."""
        bsz = self._prepare(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder)
        return bsz, kernel_loader.function_args(self._params, by_value=True)

    def compute(
        self, seq_lens_decoder, seq_lens_this_time, block_tables=None, *, seq_lens_encoder=None, stream=None
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
        """
        bsz = self._prepare(seq_lens_decoder, seq_lens_this_time, block_tables, seq_lens_encoder)
        self._launcher(self.grid(bsz), self._threads, stream_handle(stream))
        return self._outputs(bsz)

    def bind(
        self,
        seq_lens_decoder,
        seq_lens_this_time,
        block_tables=None,
        *,
        seq_lens_encoder=None,
        stream=None,
        debug: bool = False,
    ):
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

        return BoundStep(
            params=kernel_loader.StepParams.from_buffer_copy(self._params),
            fptr=int(self._fn.ptr),
            device=self.device,
            max_requests=self.max_requests,
            num_caches=self.num_caches,
            num_chunks=self._num_chunks,
            tile=self._tile,
            threads=self._threads,
            seq_lens_decoder=seq_lens_decoder,
            seq_lens_this_time=seq_lens_this_time,
            block_tables=block_tables,
            seq_lens_encoder=seq_lens_encoder,
            stream=stream,
            outputs=self._outputs,
            debug=debug,
        )

    def errors(self, stream=None) -> tuple[int, int]:
        """Synchronise and return the last step's ``(error_mask, first_bad_key)``."""
        import cupy

        handle = stream_handle(stream)
        rec = np.empty(self._records.size, dtype=np.uint64)
        with cupy.cuda.Device(self.device):
            s = cupy_stream(handle)
            self._records.get(stream=s, out=rec)
            s.synchronize()
        mask = int(np.bitwise_or.reduce(rec[0::2])) if rec.size else 0
        key = int(rec[1::2].min()) if rec.size else NO_ERROR_KEY
        return mask, key

    def check(self, stream=None) -> None:
        """Synchronise; raise AddressingError naming the request, token and reason."""
        mask, key = self.errors(stream)
        if mask:
            raise AddressingError(mask, key)
