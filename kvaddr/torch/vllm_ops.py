"""``torch.ops.kvaddr.vllm_step_into``: the vLLM step (docs/vllm.md) as a PyTorch op (CUDA, CPU, fake).

::

    kvaddr::vllm_step_into(Tensor idx_mapping, Tensor query_start_loc, Tensor num_computed_tokens,
                           Tensor[] block_tables, Tensor num_blocks, int num_reqs_padded,
                           Tensor(a!) out, int layout) -> ()

Every output of the step (positions, seq_lens, each group's slot mapping, the gathered block
tables, dcp_local_seq_lens) and the step's error records sit in ONE mutated int64 tensor
``out`` (:attr:`VllmStepBuffers.storage`, each array 256-byte aligned); ``layout``
(:attr:`VllmStepBuffers.layout`) is an int handle naming the packing (the
:class:`~kvaddr.engines.vllm_config.VllmStepConfig`). Eight arguments: torch's dispatcher costs
per argument, so the configuration travels in the handle, not in the schema.

The op **mutates** ``out`` (``Tensor(a!)``) and returns nothing: ``torch.compile``
(functionalization), ``torch.cuda.graph`` and ``opcheck`` see every write.
:func:`vllm_step` calls it and returns views of ``out``.

Kernels:

* CUDA: :class:`~kvaddr.engines.vllm.VllmStepPlanner` (kernel v2) built once per ``out`` tensor
  with ``out=`` aliases of its storage and its error records redirected into ``out``, launched on
  torch's current stream (``compute()``'s memo: the same input tensors skip the checks; no
  allocation, no synchronisation). The planner is remembered per ``out`` object (by ``id``,
  forgotten when that tensor dies).
* CPU: the NumPy reference (:func:`~kvaddr.engines.vllm_reference.vllm_step_reference`) written
  into the views.
* Meta/fake: the argument checks only (shapes, dtypes, devices), so ``torch.compile(fullgraph=True)``
  traces the op without a graph break.

Errors: bad values are recorded in ``out``'s error records (``VllmStepBuffers.records``);
:meth:`VllmStepBuffers.errors` returns ``(error_mask, first_bad_key)`` and
:meth:`VllmStepBuffers.check` raises :class:`~kvaddr.engines.vllm_errors.VllmAddressingError`
(both synchronise), as ``VllmStepPlanner.errors()`` / ``check()`` do. Bad arguments raise
``TypeError`` / ``ValueError`` naming the argument when the op is called (and when it is traced).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_config import INT32, INT64, VllmStepConfig, VllmStepOutputs
from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY, VllmAddressingError
from kvaddr.engines.vllm_reference import vllm_step_reference
from kvaddr.errors import reduce_error_records, reset_error_records
from kvaddr.torch.tensors import check_vector as _vector
from kvaddr.torch.tensors import raw_stream as _raw_stream
from kvaddr.torch.tensors import storage_alias as _alias

SCHEMA = (
    "vllm_step_into(Tensor idx_mapping, Tensor query_start_loc, Tensor num_computed_tokens, "
    "Tensor[] block_tables, Tensor num_blocks, int num_reqs_padded, Tensor(a!) out, int layout) -> ()"
)
#: Byte alignment of each array inside ``VllmStepBuffers.storage`` (cudaMalloc's).
_ALIGN = 256
#: ``out`` tensors whose planner the CUDA kernel remembers before it forgets them all.
CACHE_SIZE = 256
_NO_ERROR_I64 = VLLM_NO_ERROR_KEY - (1 << 64) if VLLM_NO_ERROR_KEY >= 1 << 63 else VLLM_NO_ERROR_KEY


def num_records(config: VllmStepConfig) -> int:
    """Error records (two int64 words each: mask, key) of a step: one per warp of the v2 kernel's
    token and request blocks, ``(ceil(T / 256) + ceil(M / 256)) * 8``
    (:meth:`VllmStepPlanner.error_records_shape <kvaddr.engines.vllm.VllmStepPlanner.error_records_shape>`)."""
    return VllmStepPlanner.error_records_shape(config.max_num_reqs, config.max_num_batched_tokens)[0]


def _slot_torch_dtype(config: VllmStepConfig):
    return torch.int32 if config.slot_dtype == INT32 else torch.int64


class _VllmLayout:
    """Where each output sits inside a packed ``VllmStepBuffers.storage`` (offsets in bytes)."""

    __slots__ = ("config", "offsets", "records", "words")

    def __init__(self, config: VllmStepConfig) -> None:
        M, T, G = config.max_num_reqs, config.max_num_batched_tokens, config.num_groups
        self.config = config
        self.records = num_records(config)
        sizes = [
            ("records", 16 * self.records),
            ("positions", 8 * T),
            ("slot_mappings", config.slot_dtype.itemsize * G * T),
            *((f"input_block_tables[{g}]", 4 * M * config.widths[g]) for g in range(G)),
            ("seq_lens", 4 * M),
            ("dcp_local_seq_lens", 4 * M),
        ]
        off, self.offsets = 0, {}
        for name, size in sizes:
            self.offsets[name] = off
            off = -(-(off + size) // _ALIGN) * _ALIGN
        self.words = off // 8

    def views(self, out: torch.Tensor) -> tuple[VllmStepOutputs, torch.Tensor]:
        """``(VllmStepOutputs of views of out, records int64 [R, 2])`` (fake tensors too)."""
        cfg, o = self.config, self.offsets
        M, T, G = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups
        i32 = out.view(torch.int32)
        slots = out if cfg.slot_dtype == INT64 else i32
        ssz = cfg.slot_dtype.itemsize
        s0 = o["slot_mappings"] // ssz
        tables = []
        for g in range(G):
            a = o[f"input_block_tables[{g}]"] // 4
            tables.append(i32[a : a + M * cfg.widths[g]].view(M, cfg.widths[g]))
        outputs = VllmStepOutputs(
            positions=out[o["positions"] // 8 : o["positions"] // 8 + T],
            seq_lens=i32[o["seq_lens"] // 4 : o["seq_lens"] // 4 + M],
            slot_mappings=slots[s0 : s0 + G * T].view(G, T),
            input_block_tables=tuple(tables),
            dcp_local_seq_lens=i32[o["dcp_local_seq_lens"] // 4 : o["dcp_local_seq_lens"] // 4 + M],
        )
        return outputs, out[: 2 * self.records].view(self.records, 2)


_lock = threading.Lock()
#: Every layout a VllmStepBuffers registered; ``VllmStepBuffers.layout`` indexes it (process-wide).
_layouts: list = []
_layout_ids: dict = {}


def _register_layout(config: VllmStepConfig) -> int:
    with _lock:
        h = _layout_ids.get(config)
        if h is None:
            h = _layout_ids[config] = len(_layouts)
            _layouts.append(_VllmLayout(config))
        return h


def _layout_of(handle) -> _VllmLayout:
    if isinstance(handle, int) and 0 <= handle < len(_layouts):
        return _layouts[handle]
    raise ValueError(f"layout must be a VllmStepBuffers.layout handle (an int in [0, {len(_layouts)})), got {handle!r}")


def _init_storage(lay: _VllmLayout, out: torch.Tensor) -> None:
    outputs, rec = lay.views(out)
    out.zero_()
    outputs.slot_mappings.fill_(-1)
    rec[:, 1] = _NO_ERROR_I64


def records_errors(records: torch.Tensor) -> tuple[int, int]:
    """``(error_mask, first_bad_key)`` of error records (int64 [R, 2]; synchronises): the OR of the
    masks and the smallest key (unsigned), as ``VllmStepPlanner.errors()`` reduces them. Does not
    reset them: the records are sticky (every step since the last reset), so reset them after
    reading (:func:`kvaddr.errors.reset_error_records`; :meth:`VllmStepBuffers.errors` does)."""
    return reduce_error_records(records.detach().cpu().numpy())


class VllmStepBuffers:
    """The vLLM op's outputs and error records, allocated once, packed in one int64 tensor.

    Parameters
    ----------
    max_num_reqs, max_num_batched_tokens, block_sizes, widths
        As :class:`~kvaddr.engines.vllm_config.VllmStepConfig` (M, T, ``B_g``, ``W_g``).
    slot_mapping_enabled, dcp_sharded, sliding_window_reach, cp_size, cp_rank, cp_interleave
        As :class:`~kvaddr.engines.vllm_config.VllmStepConfig`.
    slot_dtype : torch.int64 or torch.int32 (or the NumPy dtype), default int64
    device : torch.device or str, default "cuda"
    config : VllmStepConfig, optional
        Instead of the arguments above (then pass only ``config=`` and ``device=``).

    Attributes
    ----------
    storage : int64 [words]
        Everything below, packed (each array 256-byte aligned): the tensor the op mutates.
    layout : int
        The handle of the packing (the op's ``layout``; equal for equal configurations).
    config : VllmStepConfig
    positions : int64 [T]
    seq_lens : int32 [M]
    slot_mappings : int64 or int32 [G, T]
    input_block_tables : tuple of G int32 [M, W_g]
    dcp_local_seq_lens : int32 [M]
    records : int64 [R, 2]
        The error records (mask, key as int64), R = :func:`num_records`.
    outputs : VllmStepOutputs
        The five outputs above (the same view objects every step).
    planner : VllmStepPlanner or None
        CUDA: the planner writing into ``storage`` (built here); CPU: None.

    Notes
    -----
    The gathered tables are the op's: the CUDA planner remembers, per row, how many entries may be
    non-zero and zeroes only those, so do not write into ``storage`` between steps.
    """

    def __init__(
        self,
        max_num_reqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_sizes=None,
        widths=None,
        *,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        sliding_window_reach=None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_dtype=torch.int64,
        device="cuda",
        config: VllmStepConfig | None = None,
    ) -> None:
        if config is None:
            if slot_dtype in (torch.int64, torch.int32):
                slot_dtype = np.int64 if slot_dtype == torch.int64 else np.int32
            config = VllmStepConfig(
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
        elif not isinstance(config, VllmStepConfig):
            raise TypeError(f"config must be a VllmStepConfig, got {type(config).__name__}")
        self.config = config
        self.layout = _register_layout(config)
        lay = self._layout = _layouts[self.layout]
        dev = torch.device(device)
        self.storage = torch.empty(lay.words, dtype=torch.int64, device=dev)
        _init_storage(lay, self.storage)
        self.outputs, self.records = lay.views(self.storage)
        o = self.outputs
        self.positions, self.seq_lens, self.slot_mappings = o.positions, o.seq_lens, o.slot_mappings
        self.input_block_tables, self.dcp_local_seq_lens = o.input_block_tables, o.dcp_local_seq_lens
        self.planner = None
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # initialised here; the op may run on another stream
            self.planner = _planner_for(self.storage, lay)

    def errors(self) -> tuple[int, int]:
        """Synchronise; every step's ``(error_mask, first_bad_key)`` since the last read
        (``(0, VLLM_NO_ERROR_KEY)``: none), then reset the records (on torch's current stream,
        only when something was set). The records are sticky (docs/vllm.md, "Errors")."""
        mask, key = records_errors(self.records)
        if mask:
            reset_error_records(self.records)
        return mask, key

    def clear_errors(self) -> None:
        """Reset the error records (on torch's current stream), dropping errors not read yet."""
        reset_error_records(self.records)

    def check(self) -> None:
        """Synchronise; raise VllmAddressingError naming the first bad value since the last read."""
        mask, key = self.errors()
        if mask:
            raise VllmAddressingError(mask, key)


# -- checks (metadata only: they run on fake tensors too) --------------------------------


def _check(idx, qsl, nct, tables, nb, padded, out, layout) -> _VllmLayout:
    """Every argument's dtype, shape, layout and device (the planner's and the reference's rules)."""
    lay = _layout_of(layout)
    cfg = lay.config
    M, G = cfg.max_num_reqs, cfg.num_groups
    if out.dtype != torch.int64 or out.dim() != 1 or not out.is_contiguous() or out.shape[0] != lay.words:
        raise ValueError(
            f"out must be the VllmStepBuffers.storage of this layout: a contiguous int64 vector of {lay.words} "
            f"words, got {out.dtype} with shape {tuple(out.shape)}"
        )
    _vector("idx_mapping", idx, (torch.int32, torch.int64), shape_text="(num_reqs,)")
    n = idx.shape[0]
    if n > M:
        raise ValueError(f"idx_mapping must have at most max_num_reqs = {M} entries, got {n}")
    _vector("query_start_loc", qsl, (torch.int32,), length=n + 1, shape_text=f"(num_reqs + 1,) = ({n + 1},)")
    _vector("num_computed_tokens", nct, (torch.int32,), min_length=M, shape_text=f"(rows >= max_num_reqs = {M},)")
    if len(tables) != G:
        raise ValueError(f"block_tables must be a list of {G} tables (one per group), got {len(tables)}")
    for g, t in enumerate(tables):
        name = f"block_tables[{g}]" if G > 1 else "block_tables"
        W = cfg.widths[g]
        what = f"int32 with shape (rows >= {M}, width = {W})"
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be {what}, got dtype {t.dtype}")
        if t.dim() != 2 or t.shape[1] != W or t.shape[0] < M:
            raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
        if W > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got a last-dim stride of {t.stride(1)} elements")
        if t.shape[0] > 1 and t.stride(0) < W:
            raise ValueError(f"{name} must not have overlapping rows, got row stride {t.stride(0)} for {W} columns")
    what = f"int32 with shape ({G}, rows >= {M})" + (f" or (rows >= {M},)" if G == 1 else "")
    if nb.dtype != torch.int32:
        raise TypeError(f"num_blocks must be {what}, got dtype {nb.dtype}")
    if nb.dim() == 1 and G == 1:
        _vector("num_blocks", nb, (torch.int32,), min_length=M, shape_text=f"(rows >= {M},)")
    elif nb.dim() != 2 or nb.shape[0] != G or nb.shape[1] < M:
        raise ValueError(f"num_blocks must be {what}, got shape {tuple(nb.shape)}")
    elif nb.shape[1] > 1 and nb.stride(1) != 1:
        raise ValueError(f"num_blocks must have a contiguous last dim, got stride {nb.stride(1)}")
    if not isinstance(padded, (int, torch.SymInt)) or isinstance(padded, bool) or not n <= padded <= M:
        raise ValueError(f"num_reqs_padded must be an int in [num_reqs = {n}, max_num_reqs = {M}], got {padded!r}")
    dev = out.device
    for name, t in (
        ("idx_mapping", idx),
        ("query_start_loc", qsl),
        ("num_computed_tokens", nct),
        *((f"block_tables[{g}]", t) for g, t in enumerate(tables)),
        ("num_blocks", nb),
    ):
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev} like out, got {t.device}")
    return lay


# -- implementations ----------------------------------------------------------------------


def _fake(idx, qsl, nct, tables, nb, padded, out, layout) -> None:
    _check(idx, qsl, nct, tables, nb, padded, out, layout)


def _cpu(idx, qsl, nct, tables, nb, padded, out, layout) -> None:
    """The NumPy reference into the views of ``out``; its error record into ``out``'s records."""
    lay = _check(idx, qsl, nct, tables, nb, padded, out, layout)
    cfg = lay.config
    nbn = nb.numpy()
    res = vllm_step_reference(
        cfg,
        idx.numpy(),
        qsl.numpy(),
        nct.numpy(),
        [t.numpy() for t in tables],
        [nbn] if nbn.ndim == 1 else [nbn[g] for g in range(cfg.num_groups)],
        num_reqs_padded=padded,
    )
    views, rec = lay.views(out)
    r = res.outputs
    views.positions.copy_(torch.from_numpy(r.positions))
    views.seq_lens.copy_(torch.from_numpy(r.seq_lens))
    views.slot_mappings.copy_(torch.from_numpy(r.slot_mappings))
    for v, g in zip(views.input_block_tables, r.input_block_tables):
        v.copy_(torch.from_numpy(g))
    views.dcp_local_seq_lens.copy_(torch.from_numpy(r.dcp_local_seq_lens))
    if res.error_mask:  # merged into record 0, as a kernel's warp merges (sticky)
        old_mask, old_key = (int(v) & ((1 << 64) - 1) for v in rec[0].tolist())
        key = min(int(res.error_key), old_key)
        rec[0, 0] = old_mask | int(res.error_mask)
        rec[0, 1] = key - (1 << 64) if key >= 1 << 63 else key


#: (layout, id(out)) -> (planner, weak reference to out)
_planners: dict = {}
_state = {"multi_device": None}


def _planner_for(out: torch.Tensor, lay: _VllmLayout):
    """The planner writing into ``out`` (built and remembered on first use)."""
    key = (_layout_ids[lay.config], id(out))
    entry = _planners.get(key)
    if entry is not None and entry[1]() is out:
        return entry[0]
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "vllm_step_into: the first call with this out tensor is inside CUDA graph capture, where its "
            "planner cannot be built (it allocates and synchronises): call the op once on this out before "
            "capturing. (torch.compile's aot_eager backend passes a fresh functional copy of out on every "
            "call; inductor updates out in place.)"
        )
    cfg = lay.config
    views, rec = lay.views(out)
    aliases = {
        "positions": _alias(out, views.positions),
        "seq_lens": _alias(out, views.seq_lens),
        "slot_mappings": _alias(out, views.slot_mappings),
        "input_block_tables": tuple(_alias(out, t) for t in views.input_block_tables),
        "dcp_local_seq_lens": _alias(out, views.dcp_local_seq_lens),
    }
    dev = out.device.index
    planner = VllmStepPlanner(
        cfg.max_num_reqs,
        cfg.max_num_batched_tokens,
        list(cfg.block_sizes),
        list(cfg.widths),
        slot_mapping_enabled=list(cfg.slot_mapping_enabled),
        dcp_sharded=list(cfg.dcp_sharded),
        sliding_window_reach=list(cfg.sliding_window_reach),
        cp_size=cfg.cp_size,
        cp_rank=cfg.cp_rank,
        cp_interleave=cfg.cp_interleave,
        slot_dtype=cfg.slot_dtype,
        out=aliases,
        device=dev,
        # The error records (one per warp, sticky: merged by a warp with an error) live in out too,
        # so the op's every write lands in its one mutated tensor and errors() reads them.
        error_records=_alias(out, rec),
    )

    multi = _state["multi_device"]
    if multi is None:
        multi = _state["multi_device"] = torch.cuda.is_available() and torch.cuda.device_count() > 1

    def forget(_ref, key=key):
        _planners.pop(key, None)

    with _lock:
        if len(_planners) >= CACHE_SIZE:
            _planners.clear()
        # (planner, weak reference to out, several GPUs on the host, out's device)
        _planners[key] = (planner, weakref.ref(out, forget), multi, dev)
    return planner


def _cuda(idx, qsl, nct, tables, nb, padded, out, layout) -> None:
    # The hot path: the planner of this out object (its memo skips the checks of the same input
    # tensors), launched on torch's current stream of out's device.
    entry = _planners.get((layout, id(out)))
    if entry is None or entry[1]() is not out or entry[2]:
        _cuda_checked(entry, idx, qsl, nct, tables, nb, padded, out, layout)
        return
    entry[0].compute(idx, qsl, nct, tables, nb, padded, stream=_raw_stream(entry[3]))


def _cuda_checked(entry, idx, qsl, nct, tables, nb, padded, out, layout) -> None:
    """A new out (its planner built after the checks), or a host with several GPUs."""
    if entry is None or entry[1]() is not out:
        _planner_for(out, _check(idx, qsl, nct, tables, nb, padded, out, layout))
        entry = _planners[(layout, id(out))]
    planner, dev = entry[0], entry[3]
    if entry[2] and torch.cuda.current_device() != dev:
        with torch.cuda.device(dev):
            planner.compute(idx, qsl, nct, tables, nb, padded, stream=_raw_stream(dev))
        return
    planner.compute(idx, qsl, nct, tables, nb, padded, stream=_raw_stream(dev))


def clear_cache() -> None:
    """Forget every remembered planner (the next CUDA call on an ``out`` builds one again)."""
    with _lock:
        _planners.clear()


# -- the convenience function ---------------------------------------------------------------


def vllm_step(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    block_tables,
    num_blocks,
    buffers: VllmStepBuffers,
    num_reqs_padded: int | None = None,
) -> VllmStepOutputs:
    """One vLLM step into ``buffers`` (``torch.ops.kvaddr.vllm_step_into``); return its output views.

    Parameters
    ----------
    idx_mapping : int32 or int64 [num_reqs]
        Batch b -> request-state row; -1 marks a dummy (padding) request.
    query_start_loc : int32 [num_reqs + 1]
    num_computed_tokens : int32 [rows >= max_num_reqs]
    block_tables : int32 [rows >= max_num_reqs, W_g], one tensor (one group) or a sequence of G
    num_blocks : int32 [G, rows >= max_num_reqs], or a sequence of G int32 [rows >= max_num_reqs]
        (stacked into one tensor per call when a sequence: pass the stacked tensor to avoid that)
    buffers : VllmStepBuffers
    num_reqs_padded : int, optional
        ``num_reqs <= . <= max_num_reqs`` (default num_reqs).

    Returns
    -------
    VllmStepOutputs
        ``buffers.outputs`` eagerly (the same view objects every step); under ``torch.compile``,
        views of the mutated ``buffers.storage`` taken in the graph.
    """
    tables = [block_tables] if isinstance(block_tables, torch.Tensor) else list(block_tables)
    if not isinstance(num_blocks, torch.Tensor):
        num_blocks = torch.stack(list(num_blocks))
    padded = idx_mapping.shape[0] if num_reqs_padded is None else num_reqs_padded
    _op(idx_mapping, query_start_loc, num_computed_tokens, tables, num_blocks, padded, buffers.storage, buffers.layout)
    if torch.compiler.is_compiling():
        return buffers._layout.views(buffers.storage)[0]
    return buffers.outputs


# -- registration ---------------------------------------------------------------------------

_lib = torch.library.Library("kvaddr", "FRAGMENT")
_lib.define(SCHEMA)
_lib.impl("vllm_step_into", _cpu, "CPU")
_lib.impl("vllm_step_into", _cuda, "CUDA")
torch.library.register_fake("kvaddr::vllm_step_into", _fake, lib=_lib)
_fallthrough = getattr(torch.library, "fallthrough_kernel", None)
if _fallthrough is not None:  # no derivative, int tensors only: skip autograd's generic fallback
    _lib.impl("vllm_step_into", _fallthrough, "Autograd")
_op = torch.ops.kvaddr.vllm_step_into.default
