"""``torch.ops.kvaddr.vllm_draft_into``: the draft forwards' addressing (docs/spec-decode.md) as a
PyTorch op (CUDA, CPU, fake).

::

    kvaddr::vllm_draft_into(Tensor idx_mapping, Tensor query_start_loc, Tensor seq_lens,
                            Tensor num_rejected, Tensor num_sampled, Tensor[] block_tables,
                            Tensor num_blocks, Tensor verify_slot_mappings, Tensor(a!) out,
                            int layout) -> ()

Every output (:class:`~kvaddr.engines.vllm_draft.VllmDraftOutputs`) and the error records sit in
ONE mutated int64 tensor ``out`` (:attr:`VllmDraftBuffers.storage`, each array 256-byte aligned);
``layout`` (:attr:`VllmDraftBuffers.layout`) is an int handle naming the packing. The op mutates
``out`` and returns nothing, so ``torch.compile`` (functionalization), ``torch.cuda.graph`` and
``opcheck`` see every write. :func:`vllm_draft` calls it and returns views of ``out``.

Kernels: CUDA: a :class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner` built once per ``out``
tensor, writing into ``out``'s memory, launched on torch's current stream; CPU: the NumPy
reference (:func:`~kvaddr.engines.spec_reference.vllm_draft_reference`) into the views;
Meta/fake: the argument checks only. ``num_blocks`` is int32 ``[G, rows]`` (vLLM's stacked
counts); ``verify_slot_mappings`` int64 ``[G, T_v]`` with ``T_v <= max_num_batched_tokens``.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from kvaddr.engines.spec_reference import DraftAddressingError, vllm_draft_reference
from kvaddr.engines.vllm_draft import VllmDraftPlanner
from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY
from kvaddr.errors import reduce_error_records, reset_error_records
from kvaddr.torch.tensors import check_vector as _vector
from kvaddr.torch.tensors import raw_stream as _raw_stream
from kvaddr.torch.tensors import storage_alias as _alias

SCHEMA = (
    "vllm_draft_into(Tensor idx_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor num_rejected, "
    "Tensor num_sampled, Tensor[] block_tables, Tensor num_blocks, Tensor verify_slot_mappings, "
    "Tensor(a!) out, int layout) -> ()"
)
_ALIGN = 256
_NO_ERROR_I64 = VLLM_NO_ERROR_KEY - (1 << 64) if VLLM_NO_ERROR_KEY >= 1 << 63 else VLLM_NO_ERROR_KEY
# (torch dtype, itemsize) by NumPy dtype: the packing is computed with NumPy dtypes, but views()
# (traced by torch.compile) sees only torch dtypes and python ints.
_T = {np.dtype(np.int64): (torch.int64, 8), np.dtype(np.int32): (torch.int32, 4)}


class _Layout:
    """Where each output sits inside a packed storage (byte offsets), for one set of settings."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        s = settings
        M, T, k = s["max_num_reqs"], s["max_num_batched_tokens"], s["num_speculative_steps"]
        G, S = len(s["block_sizes"]), k - 1
        att = tuple(a.strip() for a in (s["attention"] or "").split(",") if a.strip())
        N = s["kv_indices_capacity"]
        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        self.records = VllmDraftPlanner.error_records_shape(M, k, G, bool(att))[0]
        fields = [
            ("last_token_indices", (M,), i64),
            ("first_slot_mappings", (G, T), i64) if s["mask_rejected"] else None,
            ("positions", (S, M), i64),
            ("seq_lens", (S, M), i32),
            ("dcp_local_seq_lens", (S, M), i32),
            ("query_start_loc", (S, M + 1), i32),
            ("slot_mappings", (S, G, M), i64),
            ("kv_indptr", (S, G, M + 1), i32) if "flashinfer" in att else None,
            ("kv_indices", (S, G, N), i32) if "flashinfer" in att else None,
            ("kv_last_page_len", (S, G, M), i32) if "flashinfer" in att else None,
            ("cu_seqlens_k", (S, G, M + 1), i32) if "varlen" in att else None,
            ("max_seqlen_k", (S, G), i32) if "varlen" in att else None,
        ]
        fields = [f for f in fields if f is not None]
        self.sizes = {name: int(np.prod(shape)) for name, shape, _ in fields}
        off, self.offsets = 16 * self.records, {}
        off = -(-off // _ALIGN) * _ALIGN
        for name, _shape, dt in fields:
            self.offsets[name] = off
            off = -(-(off + dt.itemsize * self.sizes[name]) // _ALIGN) * _ALIGN
        self.words = max(off // 8, 1)
        # (name, shape, torch dtype, first element, element count): python ints and torch dtypes only
        self.fields = tuple(
            (name, tuple(int(x) for x in shape), _T[dt][0], self.offsets[name] // _T[dt][1], self.sizes[name])
            for name, shape, dt in fields
        )

    def views(self, out: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """``({field: view of out}, records int64 [R, 2])`` (fake tensors too)."""
        res = {}
        for name, shape, dt, a, n in self.fields:
            res[name] = out.view(dt)[a : a + n].view(shape)
        return res, out[: 2 * self.records].view(self.records, 2)


_lock = threading.Lock()
_layouts: list = []
_layout_ids: dict = {}


def _register(settings: dict) -> int:
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))
    with _lock:
        h = _layout_ids.get(key)
        if h is None:
            h = _layout_ids[key] = len(_layouts)
            _layouts.append(_Layout(settings))
        return h


def _layout_of(handle) -> _Layout:
    if isinstance(handle, int) and 0 <= handle < len(_layouts):
        return _layouts[handle]
    raise ValueError(
        f"layout must be a VllmDraftBuffers.layout handle (an int in [0, {len(_layouts)})), got {handle!r}"
    )


class VllmDraftBuffers:
    """The draft op's outputs and error records, allocated once, packed in one int64 tensor.

    Parameters
    ----------
    max_num_reqs, max_num_batched_tokens, num_speculative_steps, block_sizes, widths, max_model_len
        As :class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner`.
    slot_mapping_enabled, dcp_sharded, cp_size, cp_rank, cp_interleave, mask_rejected, attention,
    kv_indices_capacity
        As :class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner` (``attention``: a str).
    device : torch.device or str, default "cuda"

    Attributes
    ----------
    storage : int64 [words]
        Everything packed: the tensor the op mutates.
    layout : int
        The handle of the packing (the op's ``layout``).
    outputs : dict
        Views of ``storage`` by field name (those of :class:`~kvaddr.engines.vllm_draft.VllmDraftOutputs`
        this configuration writes).
    records : int64 [R, 2]
        The error records.
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
        slot_mapping_enabled=True,
        dcp_sharded=True,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        mask_rejected: bool = False,
        attention: str | None = None,
        kv_indices_capacity: int | None = None,
        device="cuda",
    ) -> None:
        G = len(block_sizes)
        settings = dict(
            max_num_reqs=int(max_num_reqs),
            max_num_batched_tokens=int(max_num_batched_tokens),
            num_speculative_steps=int(num_speculative_steps),
            block_sizes=[int(b) for b in block_sizes],
            widths=[int(w) for w in (widths if isinstance(widths, (list, tuple)) else [widths] * G)],
            max_model_len=int(max_model_len),
            slot_mapping_enabled=list(slot_mapping_enabled)
            if isinstance(slot_mapping_enabled, (list, tuple))
            else [bool(slot_mapping_enabled)] * G,
            dcp_sharded=list(dcp_sharded) if isinstance(dcp_sharded, (list, tuple)) else [bool(dcp_sharded)] * G,
            cp_size=int(cp_size),
            cp_rank=int(cp_rank),
            cp_interleave=int(cp_interleave),
            mask_rejected=bool(mask_rejected),
            attention=attention if attention else None,
            kv_indices_capacity=None if kv_indices_capacity is None else int(kv_indices_capacity),
        )
        dev = torch.device(device)
        if dev.type == "cuda":  # the planner's own checks of every setting, before anything is packed
            self.layout = _register(settings)
        else:
            vllm_draft_reference(  # the reference's checks of the settings
                np.zeros(0, np.int32),
                np.zeros(1, np.int32),
                np.zeros(0, np.int32),
                np.zeros(0, np.int32),
                np.zeros(0, np.int32),
                [np.zeros((1, w), np.int32) for w in settings["widths"]],
                settings["block_sizes"],
                np.zeros((G, 0), np.int64),
                settings["max_model_len"],
                settings["num_speculative_steps"],
                attention=settings["attention"],
                kv_indices_capacity=settings["kv_indices_capacity"],
            )
            self.layout = _register(settings)
        lay = self._layout = _layouts[self.layout]
        self.storage = torch.zeros(lay.words, dtype=torch.int64, device=dev)
        self.outputs, self.records = lay.views(self.storage)
        self.records[:, 1] = _NO_ERROR_I64
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
            _planner_for(self.storage, lay)

    def errors(self) -> tuple[int, int]:
        """Synchronise; ``(error_mask, first_bad_key)`` since the last read, then reset the records."""
        mask, key = reduce_error_records(self.records.detach().cpu().numpy())
        if mask:
            reset_error_records(self.records)
        return mask, key

    def check(self) -> None:
        """Synchronise; raise DraftAddressingError naming the first bad value since the last read."""
        mask, key = self.errors()
        if mask:
            raise DraftAddressingError(mask, key)


def _check(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout) -> _Layout:
    lay = _layout_of(layout)
    s = lay.settings
    M, T, G = s["max_num_reqs"], s["max_num_batched_tokens"], len(s["block_sizes"])
    if out.dtype != torch.int64 or out.dim() != 1 or not out.is_contiguous() or out.shape[0] != lay.words:
        raise ValueError(
            f"out must be the VllmDraftBuffers.storage of this layout: a contiguous int64 vector of "
            f"{lay.words} words, got {out.dtype} with shape {tuple(out.shape)}"
        )
    _vector("idx_mapping", idx, (torch.int32, torch.int64), shape_text="(num_reqs,)")
    n = idx.shape[0]
    if n > M:
        raise ValueError(f"idx_mapping must have at most max_num_reqs = {M} entries, got {n}")
    _vector("query_start_loc", qsl, (torch.int32,), length=n + 1, shape_text=f"(num_reqs + 1,) = ({n + 1},)")
    for name, t in (("seq_lens", seq), ("num_rejected", rej), ("num_sampled", smp)):
        _vector(name, t, (torch.int32,), min_length=n, shape_text=f"(>= num_reqs = {n},)")
    if len(tables) != G:
        raise ValueError(f"block_tables must be a list of {G} tables (one per group), got {len(tables)}")
    for g, t in enumerate(tables):
        W = s["widths"][g]
        name = f"block_tables[{g}]" if G > 1 else "block_tables"
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 with shape (rows, width = {W}), got dtype {t.dtype}")
        if t.dim() != 2 or t.shape[1] != W or t.shape[0] < 1 or (W > 1 and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be int32 with shape (rows, width = {W}), contiguous last dim, got shape {tuple(t.shape)}"
            )
    if nb.dtype != torch.int32 or nb.dim() != 2 or nb.shape[0] != G or (nb.shape[1] > 1 and nb.stride(1) != 1):
        raise ValueError(f"num_blocks must be int32 with shape ({G}, rows), got {nb.dtype} {tuple(nb.shape)}")
    if (
        vsm.dtype != torch.int64
        or vsm.dim() != 2
        or vsm.shape[0] != G
        or vsm.shape[1] > T
        or (vsm.shape[1] > 1 and vsm.stride(1) != 1)
    ):
        raise ValueError(
            f"verify_slot_mappings must be int64 with shape ({G}, <= {T}), got {vsm.dtype} {tuple(vsm.shape)}"
        )
    for name, t in (
        ("idx_mapping", idx),
        ("query_start_loc", qsl),
        ("seq_lens", seq),
        ("num_rejected", rej),
        ("num_sampled", smp),
        *((f"block_tables[{g}]", t) for g, t in enumerate(tables)),
        ("num_blocks", nb),
        ("verify_slot_mappings", vsm),
    ):
        if t.device != out.device:
            raise ValueError(f"{name} must be on {out.device} like out, got {t.device}")
    return lay


def _fake(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout) -> None:
    _check(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout)


def _cpu(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout) -> None:
    lay = _check(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout)
    s = lay.settings
    rows = min([t.shape[0] for t in tables] + [nb.shape[1]])
    res = vllm_draft_reference(
        idx.numpy(),
        qsl.numpy(),
        seq.numpy(),
        rej.numpy(),
        smp.numpy(),
        [t.numpy()[:rows] for t in tables],
        s["block_sizes"],
        vsm.numpy(),
        s["max_model_len"],
        s["num_speculative_steps"],
        num_blocks=[nb.numpy()[g, :rows] for g in range(nb.shape[0])],
        max_num_reqs=s["max_num_reqs"],
        mask_rejected=s["mask_rejected"],
        slot_mapping_enabled=s["slot_mapping_enabled"],
        dcp_sharded=s["dcp_sharded"],
        cp_size=s["cp_size"],
        cp_rank=s["cp_rank"],
        cp_interleave=s["cp_interleave"],
        attention=s["attention"],
        kv_indices_capacity=s["kv_indices_capacity"],
    )
    views, rec = lay.views(out)
    for name, v in views.items():
        if name == "first_slot_mappings":
            v.fill_(-1)
            v[:, : res.first_slot_mappings.shape[1]].copy_(torch.from_numpy(res.first_slot_mappings))
        else:
            v.copy_(torch.from_numpy(np.ascontiguousarray(getattr(res, name))))
    if res.error_mask:
        old_mask, old_key = (int(x) & ((1 << 64) - 1) for x in rec[0].tolist())
        key = min(int(res.error_key), old_key)
        rec[0, 0] = old_mask | int(res.error_mask)
        rec[0, 1] = key - (1 << 64) if key >= 1 << 63 else key


_planners: dict = {}


def _planner_for(out: torch.Tensor, lay: _Layout) -> VllmDraftPlanner:
    key = (id(lay), id(out))
    entry = _planners.get(key)
    if entry is not None and entry[1]() is out:
        return entry[0]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "vllm_draft_into: the first call with this out tensor is inside CUDA graph capture, where its "
            "planner cannot be built (it allocates and synchronises): call the op once on this out before capturing"
        )
    views, rec = lay.views(out)
    planner = VllmDraftPlanner(
        **lay.settings,
        out={k: _alias(out, v) for k, v in views.items()},
        device=out.device.index,
        error_records=_alias(out, rec),
    )

    def forget(_ref, key=key):
        _planners.pop(key, None)

    with _lock:
        if len(_planners) >= 256:
            _planners.clear()
        _planners[key] = (planner, weakref.ref(out, forget))
    return planner


def _cuda(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout) -> None:
    lay = _check(idx, qsl, seq, rej, smp, tables, nb, vsm, out, layout)
    planner = _planner_for(out, lay)
    dev = out.device.index
    with torch.cuda.device(dev):
        planner.compute(
            idx,
            qsl,
            seq,
            rej,
            smp,
            list(tables),
            [nb[g] for g in range(nb.shape[0])],
            vsm,
            stream=_raw_stream(dev),
        )


def vllm_draft(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_rejected: torch.Tensor,
    num_sampled: torch.Tensor,
    block_tables,
    num_blocks: torch.Tensor,
    verify_slot_mappings: torch.Tensor,
    buffers: VllmDraftBuffers,
) -> dict:
    """The draft forwards' addressing into ``buffers`` (``torch.ops.kvaddr.vllm_draft_into``).

    Parameters
    ----------
    idx_mapping : int32 or int64 [num_reqs]
    query_start_loc : int32 [num_reqs + 1]
    seq_lens, num_rejected, num_sampled : int32 [>= num_reqs]
    block_tables : int32 [rows, W_g], one tensor (one group) or a sequence of G
    num_blocks : int32 [G, rows]
    verify_slot_mappings : int64 [G, <= max_num_batched_tokens]
    buffers : VllmDraftBuffers

    Returns
    -------
    dict
        Views of ``buffers.storage`` by field name (``buffers.outputs`` eagerly).
    """
    tables = [block_tables] if isinstance(block_tables, torch.Tensor) else list(block_tables)
    _op(
        idx_mapping,
        query_start_loc,
        seq_lens,
        num_rejected,
        num_sampled,
        tables,
        num_blocks,
        verify_slot_mappings,
        buffers.storage,
        buffers.layout,
    )
    if torch.compiler.is_compiling():
        return buffers._layout.views(buffers.storage)[0]
    return buffers.outputs


_lib = torch.library.Library("kvaddr", "FRAGMENT")
_lib.define(SCHEMA)
_lib.impl("vllm_draft_into", _cpu, "CPU")
_lib.impl("vllm_draft_into", _cuda, "CUDA")
torch.library.register_fake("kvaddr::vllm_draft_into", _fake, lib=_lib)
_fallthrough = getattr(torch.library, "fallthrough_kernel", None)
if _fallthrough is not None:
    _lib.impl("vllm_draft_into", _fallthrough, "Autograd")
_op = torch.ops.kvaddr.vllm_draft_into.default
