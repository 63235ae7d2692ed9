"""Mrv2Addressing: a drop-in for vLLM Model Runner V2's block tables and input preparation.

vLLM's Model Runner V2 (MRV2) prepares each step's addressing in three calls, in this order
(docs/integrations/vllm.md)::

    prepare_pos_seq_lens(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens)
    block_tables.gather_block_tables(idx_mapping, num_reqs_padded, ...)
    block_tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, ...)

each a kernel launch of its own. :class:`Mrv2Addressing` takes the place of MRV2's
``BlockTables`` object and offers the same three methods with the same arguments: the first,
``prepare_pos_seq_lens``, runs kvaddr's one launch
(:meth:`BoundVllmStep.launch <kvaddr.engines.vllm_bound.BoundVllmStep.launch>`), which writes
every buffer of the step into MRV2's own persistent buffers (positions, ``seq_lens``, the
slot mappings, the gathered ``input_block_tables``, and optionally the DCP local lengths and
FlashInfer's attention metadata); ``gather_block_tables`` and ``compute_slot_mappings`` then
return the slices of those buffers vLLM returns, launching nothing.

A later call is served from the launch only when its ``idx_mapping`` is the very object the
launch used and it writes into MRV2's own buffers (``out=None``); anything else (the
speculator's own calls, ``out=`` buffers of another owner, a call with no launch before it in
the step) runs vLLM's own method, per call, on the wrapped ``BlockTables``. With ``debug=True``
a later call whose arguments differ from the launch's (another ``idx_mapping`` or
``query_start_loc``, other contents, a ``num_reqs_padded`` out of range, positions that are not
MRV2's buffer) raises :class:`Mrv2ArgumentError` naming the argument, and the step's device
error records are read (synchronising) after ``compute_slot_mappings``.

Everything else MRV2 uses of its ``BlockTables`` (``append_block_ids``,
``apply_staged_writes``, ``num_blocks``, ``input_block_tables``, ``slot_mappings``,
``get_dummy_block_tables``, ...) is the wrapped object's, reached through attribute lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvaddr.engines.vllm_config import VllmStepOutputs
from kvaddr.validation import array_kind, describe

__all__ = ["Mrv2Addressing", "Mrv2ArgumentError", "mrv2_planner"]

#: Slices of the output buffers remembered per size (``gather_block_tables`` by ``num_reqs_padded``,
#: ``compute_slot_mappings`` by ``num_tokens_padded``) before the memory of them is dropped.
_SLICE_CACHE = 256


class Mrv2ArgumentError(ValueError):
    """A later call of a step does not match the launch that served it (``debug=True``)."""


def _ptr(x) -> int:
    """The address of an array's first element (torch, CuPy, NumPy, or any device array)."""
    if array_kind(x) == "torch":
        return x.data_ptr()
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    data = getattr(x, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr.__class__ is int:
        return ptr
    return describe("array", x).ptr


def _length(x) -> int:
    return int(x.shape[0])


def _zero(x) -> None:
    if hasattr(x, "zero_"):
        x.zero_()
    else:
        x.fill(0)


def _copy(x):
    """A snapshot of an array's contents on its device (torch ``clone``, CuPy ``copy``)."""
    return x.clone() if hasattr(x, "clone") else x.copy()


def _same_contents(a, b) -> bool:
    """Whether two arrays of one kind hold equal values (synchronises)."""
    if array_kind(a) == "torch":
        import torch

        return bool(torch.equal(a, b))
    get = (lambda v: v.get()) if hasattr(a, "get") else np.asarray
    return bool(np.array_equal(get(a), get(b)))


def mrv2_planner(
    tables,
    positions,
    seq_lens,
    *,
    dcp_local_seq_lens=None,
    slot_mapping_enabled=None,
    dcp_sharded=None,
    sliding_window_reach=None,
    attention=None,
    kv_indices_capacity: int | None = None,
    device: int | None = None,
):
    """A :class:`~kvaddr.engines.vllm.VllmStepPlanner` writing into MRV2's own buffers.

    Parameters
    ----------
    tables : vLLM's ``BlockTables``
        Read for its configuration and buffers: ``block_sizes``, ``max_num_reqs``,
        ``max_num_batched_tokens``, ``cp_size`` / ``cp_rank`` / ``cp_interleave`` (1 / 0 / 1
        when absent), ``block_tables[g].gpu`` (int32 ``[M, W_g]``: the widths),
        ``input_block_tables`` (G int32 ``[M, W_g]``) and ``slot_mappings`` (int64 ``[G, T]``).
    positions : int64 [>= T], device array
        MRV2's persistent positions buffer (``input_buffers.positions``); its first T entries.
    seq_lens : int32 [>= M], device array
        MRV2's persistent ``input_buffers.seq_lens``; its first M entries.
    dcp_local_seq_lens : int32 [>= M], device array, optional
        MRV2's ``input_buffers.dcp_local_seq_lens`` under DCP (the planner's own buffer if None).
    slot_mapping_enabled, dcp_sharded, sliding_window_reach
        Per group, as :class:`~kvaddr.engines.vllm_config.VllmStepConfig` takes them.
    attention, kv_indices_capacity
        Attention metadata from the same launch (``"flashinfer"``, ``"varlen"``,
        ``"page_table"``), as :class:`~kvaddr.engines.vllm.VllmStepPlanner` takes them.
    device : int, optional
        CUDA device ordinal (the current device by default).

    Returns
    -------
    VllmStepPlanner
    """
    from kvaddr.engines.vllm import VllmStepPlanner

    M, T = int(tables.max_num_reqs), int(tables.max_num_batched_tokens)
    out = {
        "positions": positions[:T],
        "seq_lens": seq_lens[:M],
        "slot_mappings": tables.slot_mappings,
        "input_block_tables": tuple(tables.input_block_tables),
    }
    if dcp_local_seq_lens is not None:
        out["dcp_local_seq_lens"] = dcp_local_seq_lens[:M]
    return VllmStepPlanner(
        max_num_reqs=M,
        max_num_batched_tokens=T,
        block_sizes=list(tables.block_sizes),
        widths=[int(t.gpu.shape[1]) for t in tables.block_tables],
        slot_mapping_enabled=slot_mapping_enabled,
        dcp_sharded=dcp_sharded,
        sliding_window_reach=sliding_window_reach,
        cp_size=int(getattr(tables, "cp_size", 1)),
        cp_rank=int(getattr(tables, "cp_rank", 0)),
        cp_interleave=int(getattr(tables, "cp_interleave", 1)),
        out=out,
        device=device,
        attention=attention,
        kv_indices_capacity=kv_indices_capacity,
    )


class Mrv2Addressing:
    """MRV2's block tables and input preparation, served by kvaddr's one launch per step.

    Put it where MRV2 keeps its ``BlockTables`` (``self.block_tables``), wrapping that object,
    and call its :meth:`prepare_pos_seq_lens` where MRV2 calls the free function of that name;
    ``gather_block_tables`` and ``compute_slot_mappings`` keep their call sites.

    Parameters
    ----------
    tables : vLLM's ``BlockTables``
        The object it stands for: its request state (``block_tables[g].gpu``,
        ``num_blocks.gpu``, the staged writes) stays its own, every attribute this class does
        not define is its attribute, and its ``gather_block_tables`` / ``compute_slot_mappings``
        serve every call the launch does not (see the module's docstring).
    num_computed_tokens : int32 [>= M], device array
        MRV2's ``req_states.num_computed_tokens.gpu`` (bound once, by identity).
    positions : int64 [>= T], device array
        MRV2's ``input_buffers.positions`` (the ``pos`` argument of ``prepare_pos_seq_lens``).
    seq_lens : int32 [>= M], device array
        MRV2's ``input_buffers.seq_lens``.
    dcp_local_seq_lens : int32 [>= M], device array, optional
        MRV2's ``input_buffers.dcp_local_seq_lens`` under DCP: written by the same launch.
    slot_mapping_enabled, dcp_sharded, sliding_window_reach, attention, kv_indices_capacity
        As :func:`mrv2_planner` takes them (``attention="flashinfer"`` with a
        ``kv_indices_capacity``: FlashInfer's paged-KV arrays from the same launch,
        :attr:`attention_outputs`).
    prepare_pos_seq_lens : callable, optional
        vLLM's own ``prepare_pos_seq_lens`` function: what :meth:`prepare_pos_seq_lens` runs
        when the adapter is switched off, or for a call that is not the step's (other
        ``num_computed_tokens``, ``pos`` or ``seq_lens``). Without it such a call raises.
    enabled : bool, default True
        False: every call runs vLLM's own code (the same results, three launches); the
        :attr:`enabled` property switches at any time.
    debug : bool, default False
        Check every later call of a step against its launch (raising :class:`Mrv2ArgumentError`)
        and read the step's device error records after ``compute_slot_mappings``
        (synchronises; raises :class:`~kvaddr.engines.vllm_errors.VllmAddressingError`).
    step : BoundVllmStep, optional
        The bound launch to run (default: :func:`mrv2_planner`'s planner bound to ``tables``'
        request state). Anything with its ``launch(idx_mapping, query_start_loc,
        num_reqs_padded=None, *, stream=None)`` serves; its ``planner`` (if any) gives
        :meth:`check` and :attr:`attention_outputs`.

    Notes
    -----
    The launch runs on torch's current stream (CuPy's for other arrays), where MRV2 runs its
    own kernels. ``num_reqs_padded`` does not change what the launch writes (every gathered row
    past ``num_reqs`` is zero), so ``prepare_pos_seq_lens``, which does not know it, launches
    for the batch as it is. kvaddr writes 0 to positions past the step's tokens and -1 to every
    slot past them, where vLLM leaves them or pads up to ``num_tokens_padded``.
    """

    def __init__(
        self,
        tables,
        num_computed_tokens,
        positions,
        seq_lens,
        *,
        dcp_local_seq_lens=None,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        sliding_window_reach=None,
        attention=None,
        kv_indices_capacity: int | None = None,
        prepare_pos_seq_lens: Callable | None = None,
        enabled: bool = True,
        debug: bool = False,
        step=None,
    ):
        self.tables = tables
        self.debug = bool(debug)
        self._vllm_prepare = prepare_pos_seq_lens
        self._nct, self._pos, self._seq_lens = num_computed_tokens, positions, seq_lens
        self._pos_ptr, self._seq_ptr = _ptr(positions), _ptr(seq_lens)
        self._M, self._T = int(tables.max_num_reqs), int(tables.max_num_batched_tokens)
        self._out_tables = tuple(tables.input_block_tables)
        self._out_slots = tables.slot_mappings
        self._planner_options = dict(
            dcp_local_seq_lens=dcp_local_seq_lens,
            slot_mapping_enabled=slot_mapping_enabled,
            dcp_sharded=dcp_sharded,
            sliding_window_reach=sliding_window_reach,
            attention=attention,
            kv_indices_capacity=kv_indices_capacity,
        )
        # torch tensors on a GPU: launch on torch's current stream, read at each launch.
        self._torch_cuda = array_kind(positions) == "torch" and bool(positions.is_cuda)
        self._step = step
        self._enabled = False
        self._dirty = False  # something other than the launch wrote into the gathered tables
        self._table_slices: dict = {}
        self._slot_slices: dict = {}
        self._forget_step()
        self.enabled = enabled

    # -- switch ----------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether the one launch serves the step (False: vLLM's own three calls)."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        on = bool(on)
        if on and self._step is None:
            self._step = self._bind()
        if not on and self._vllm_prepare is None:
            raise TypeError(
                "switching Mrv2Addressing off needs vLLM's own prepare_pos_seq_lens function: "
                "pass prepare_pos_seq_lens=<vllm's function> when building it (or keep vLLM's "
                "BlockTables and its prepare_pos_seq_lens call sites instead of the adapter)"
            )
        if on and not self._enabled:
            self._dirty = True  # vLLM's gathers may have filled rows the launch does not know of
        self._enabled = on
        self._forget_step()

    def _bind(self):
        """The one-launch step over the wrapped tables' request state (the one place that
        builds and binds the planner)."""
        t = self.tables
        planner = mrv2_planner(t, self._pos, self._seq_lens, **self._planner_options)
        return planner.bind(self._nct, [b.gpu for b in t.block_tables], t.num_blocks.gpu)

    def _stream_now(self):
        """Where MRV2 runs its kernels now: torch's current stream (a raw handle) for torch
        tensors on a GPU, else None (CuPy's current stream)."""
        if not self._torch_cuda:
            return None
        import torch

        return torch.cuda.current_stream(self._pos.device).cuda_stream

    def _launch(self, idx_mapping, query_start_loc) -> None:
        """kvaddr's one launch for this batch (the one place that launches)."""
        self._step.launch(idx_mapping, query_start_loc, None, stream=self._stream_now())

    def _forget_step(self) -> None:
        # The launch's idx_mapping and query_start_loc (the objects), and whether the step's
        # gather and slot mapping are still to be served from it.
        self._idx = self._qsl = None
        self._snapshot = None
        self._gather_pending = self._slots_pending = False

    # -- the three calls ---------------------------------------------------------------
    def prepare_pos_seq_lens(self, idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens) -> None:
        """vLLM's ``prepare_pos_seq_lens``: runs the step's one launch.

        Writes every buffer of the step (``pos`` and ``seq_lens`` as vLLM does, and the slot
        mappings and gathered block tables that the next two calls return).

        Parameters
        ----------
        idx_mapping : int32 or int64 [num_reqs], device array
            Batch row b -> request-state row; -1 marks a dummy (padding) request.
        query_start_loc : int32 [num_reqs + 1] (or longer: its first num_reqs + 1), device array
        num_computed_tokens, pos, seq_lens
            MRV2's persistent buffers, the ones the adapter was built with. Other arrays (a
            call that is not the step's) go to vLLM's own function.
        """
        self._forget_step()
        if not (
            self._enabled
            and (num_computed_tokens is self._nct or _ptr(num_computed_tokens) == _ptr(self._nct))
            and (pos is self._pos or (_ptr(pos) == self._pos_ptr and _length(pos) >= self._T))
            and (seq_lens is self._seq_lens or (_ptr(seq_lens) == self._seq_ptr and _length(seq_lens) >= self._M))
        ):
            if self._vllm_prepare is None:
                raise ValueError(
                    "prepare_pos_seq_lens got num_computed_tokens, pos or seq_lens other than the buffers "
                    "Mrv2Addressing was built with; pass prepare_pos_seq_lens=<vllm's function> to run such "
                    "calls through vLLM"
                )
            self._vllm_prepare(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens)
            return
        qsl = query_start_loc
        n = _length(idx_mapping)
        if _length(qsl) != n + 1:
            qsl = qsl[: n + 1]  # (a longer slice: the launch reads num_reqs + 1 entries)
        if self._dirty:
            for t in self._out_tables:
                _zero(t)
            self._dirty = False
        self._launch(idx_mapping, qsl)
        self._idx, self._qsl = idx_mapping, query_start_loc
        if self.debug:
            self._snapshot = (_copy(idx_mapping), _copy(qsl))
        self._gather_pending = self._slots_pending = True

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded: int, out=None, out_ptrs=None, num_computed_tokens=None
    ) -> tuple:
        """vLLM's ``BlockTables.gather_block_tables``: ``input_block_tables[g][:num_reqs_padded]``.

        Served from the step's launch when ``idx_mapping`` is the launch's and ``out`` is None
        (or the tables' own ``input_block_tables``); otherwise vLLM's own gather runs.
        """
        if self._gather_pending and idx_mapping is self._idx and (out is None or self._own_tables(out)):
            self._gather_pending = False
            if self.debug:
                self._check_gather(num_reqs_padded, num_computed_tokens)
            got = self._table_slices.get(num_reqs_padded)
            if got is None:
                if len(self._table_slices) >= _SLICE_CACHE:
                    self._table_slices.clear()
                got = self._table_slices[num_reqs_padded] = tuple(t[:num_reqs_padded] for t in self._out_tables)
            return got
        if self.debug and self._gather_pending and (out is None or self._own_tables(out)):
            self._mismatch("gather_block_tables", "idx_mapping", idx_mapping, self._idx)
        kwargs: dict[str, Any] = {}
        if out is not None:
            kwargs["out"], kwargs["out_ptrs"] = out, out_ptrs
        if num_computed_tokens is not None:
            kwargs["num_computed_tokens"] = num_computed_tokens
        res = self.tables.gather_block_tables(idx_mapping, num_reqs_padded, **kwargs)
        if out is None or self._own_tables(out):
            self._dirty = True  # rows the launch's zeroing does not know of
        return res

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded: int, out=None):
        """vLLM's ``BlockTables.compute_slot_mappings``: ``slot_mappings[:, :num_tokens_padded]``.

        Served from the step's launch when ``idx_mapping`` is the launch's and ``out`` is None
        (or the tables' own ``slot_mappings``); otherwise vLLM's own kernel runs.
        """
        if self._slots_pending and idx_mapping is self._idx and (out is None or out is self._out_slots):
            self._slots_pending = False
            if self.debug:
                self._check_slots(query_start_loc, positions, num_tokens_padded)
            got = self._slot_slices.get(num_tokens_padded)
            if got is None:
                if len(self._slot_slices) >= _SLICE_CACHE:
                    self._slot_slices.clear()
                got = self._slot_slices[num_tokens_padded] = self._out_slots[:, :num_tokens_padded]
            if self.debug:
                self.check()
            return got
        if self.debug and self._slots_pending and (out is None or out is self._out_slots):
            self._mismatch("compute_slot_mappings", "idx_mapping", idx_mapping, self._idx)
        if out is None:
            return self.tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded)
        return self.tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, out=out)

    # -- what else an engine may need --------------------------------------------------
    def mark_tables_written(self) -> None:
        """Say that something other than the launch wrote into ``input_block_tables`` (the
        adapter's own fallbacks say it themselves): the next launch zeroes the tables first."""
        self._dirty = True

    @property
    def step(self):
        """The bound one-launch step (None while switched off and never switched on)."""
        return self._step

    @property
    def planner(self):
        """The :class:`~kvaddr.engines.vllm.VllmStepPlanner` behind the launch, or None."""
        return getattr(self._step, "planner", None)

    @property
    def outputs(self) -> VllmStepOutputs | None:
        """The launch's outputs (MRV2's buffers, and the DCP local lengths), or None."""
        p = self.planner
        return None if p is None else p.outputs

    @property
    def attention_outputs(self):
        """The attention metadata the launch writes
        (:class:`~kvaddr.engines.vllm_config.VllmAttentionOutputs`; FlashInfer's ``qo_indptr``,
        ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), or None without ``attention=``."""
        p = self.planner
        return None if p is None else p.attention_outputs

    def check(self, stream=None) -> None:
        """Synchronise on ``stream`` (default: where the launches run); raise
        :class:`~kvaddr.engines.vllm_errors.VllmAddressingError` naming the first bad value of
        the steps since the last read, and clear the records (nothing without a planner)."""
        p = self.planner
        if p is not None:
            p.check(self._stream_now() if stream is None else stream)

    def __getattr__(self, name: str):
        # Called only for names this class does not define: the wrapped BlockTables' attribute.
        if name == "tables":  # (during construction, before tables is set)
            raise AttributeError(name)
        return getattr(self.tables, name)

    # -- debug checks --------------------------------------------------------------------
    def _own_tables(self, out) -> bool:
        return len(out) == len(self._out_tables) and all(
            a is b or _ptr(a) == _ptr(b) for a, b in zip(out, self._out_tables)
        )

    @staticmethod
    def _mismatch(call: str, name: str, got, want) -> None:
        raise Mrv2ArgumentError(
            f"{call}: {name} is not the array prepare_pos_seq_lens launched with this step "
            f"(got {type(got).__name__} at {_ptr(got):#x}, the launch used {_ptr(want):#x}); "
            f"the adapter serves a step's calls from one launch, so they must share its batch"
        )

    def _check_contents(self, call: str) -> None:
        idx0, qsl0 = self._snapshot
        n = _length(idx0)
        if not _same_contents(self._idx, idx0):
            raise Mrv2ArgumentError(f"{call}: idx_mapping's contents changed since prepare_pos_seq_lens launched")
        if not _same_contents(self._qsl[: n + 1], qsl0):
            raise Mrv2ArgumentError(f"{call}: query_start_loc's contents changed since prepare_pos_seq_lens launched")

    def _check_gather(self, num_reqs_padded, num_computed_tokens) -> None:
        n, M = _length(self._idx), self._M
        if not isinstance(num_reqs_padded, (int, np.integer)) or not n <= num_reqs_padded <= M:
            raise Mrv2ArgumentError(
                f"gather_block_tables: num_reqs_padded must be an int in [num_reqs, max_num_reqs] = "
                f"[{n}, {M}], got {num_reqs_padded!r}"
            )
        if num_computed_tokens is not None and _ptr(num_computed_tokens) != _ptr(self._nct):
            raise Mrv2ArgumentError(
                "gather_block_tables: num_computed_tokens is not the array the launch read "
                "(the one Mrv2Addressing was built with)"
            )
        self._check_contents("gather_block_tables")

    def _check_slots(self, query_start_loc, positions, num_tokens_padded) -> None:
        n, T = _length(self._idx), self._T
        if query_start_loc is not self._qsl and (
            _ptr(query_start_loc) != _ptr(self._qsl) or _length(query_start_loc) < n + 1
        ):
            self._mismatch("compute_slot_mappings", "query_start_loc", query_start_loc, self._qsl)
        # (an empty torch slice has no address: only its length is checked)
        if _length(positions) > T or (_length(positions) and _ptr(positions) != self._pos_ptr):
            raise Mrv2ArgumentError(
                f"compute_slot_mappings: positions must be a slice [:num_tokens] of the positions buffer the "
                f"launch wrote (at {self._pos_ptr:#x}, {T} entries), got {_length(positions)} entries at "
                f"{_ptr(positions):#x}"
            )
        if not isinstance(num_tokens_padded, (int, np.integer)) or not _length(positions) <= num_tokens_padded <= T:
            raise Mrv2ArgumentError(
                f"compute_slot_mappings: num_tokens_padded must be an int in [len(positions), "
                f"max_num_batched_tokens] = [{_length(positions)}, {T}], got {num_tokens_padded!r}"
            )
        self._check_contents("compute_slot_mappings")
