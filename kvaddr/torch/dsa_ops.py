"""``torch.ops.kvaddr.dsa_topk_to_slots``: the top-k -> slot conversion (docs/dsa.md) as a PyTorch op.

::

    kvaddr::dsa_topk_to_slots(Tensor topk, Tensor req_id, Tensor block_table, Tensor ctx,
                              int block_size, bool compact, int cp_size, int cp_rank,
                              int cp_interleave, Tensor(a!) out, Tensor(b!) counts,
                              Tensor(c!) errors) -> ()

The op **mutates** ``out`` (int32, ``topk``'s shape), ``counts`` (int32, ``topk.shape[:-1]``) and
``errors`` (int64 ``[L, 2]``: each layer's sticky (error mask, first-bad key), the key's bits as
int64) and returns nothing, so ``torch.compile`` (functionalization), ``torch.cuda.graph`` and
``opcheck`` see every write. :func:`dsa_topk_to_slots` calls it (allocating what is not given) and
returns the three tensors.

Kernels:

* CUDA: :func:`kvaddr.dsa.topk_to_slots` on torch's current stream (one launch; no allocation, no
  synchronisation).
* CPU: the NumPy reference (:func:`kvaddr.dsa_reference.topk_to_slots`) written into the tensors,
  with the kernel's treatment of padding tokens (``req_id < 0``: a row of -1s, count 0, no error)
  and its sticky records; a ``req_id`` past the table's rows or a table whose slots pass int32
  raise ``ValueError`` there (the CUDA kernel flags them instead).
* Meta/fake: the argument checks only (dtypes, shapes), so ``torch.compile(fullgraph=True)``
  traces the op without a graph break.
"""

from __future__ import annotations

import numpy as np
import torch

from kvaddr.dsa import topk_to_slots as _device_topk_to_slots
from kvaddr.dsa_reference import topk_to_slots as _reference
from kvaddr.torch.tensors import raw_stream as _raw_stream

SCHEMA = (
    "dsa_topk_to_slots(Tensor topk, Tensor req_id, Tensor block_table, Tensor ctx, int block_size, "
    "bool compact, int cp_size, int cp_rank, int cp_interleave, Tensor(a!) out, Tensor(b!) counts, "
    "Tensor(c!) errors) -> ()"
)
#: The "no error" key as int64 (all ones).
NO_ERROR_I64 = -1


def _check(topk, req_id, block_table, ctx, block_size, out, counts, errors) -> tuple[int, int, int]:
    for name, x in (("topk", topk), ("req_id", req_id), ("block_table", block_table), ("ctx", ctx)):
        if x.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
    if topk.dim() not in (2, 3):
        raise ValueError(f"topk must have shape [T, K] or [L, T, K], got {tuple(topk.shape)}")
    layers, t, k = (1, *topk.shape) if topk.dim() == 2 else tuple(topk.shape)
    if tuple(req_id.shape) != (t,):
        raise ValueError(f"req_id must have shape ({t},) (topk's tokens), got {tuple(req_id.shape)}")
    if tuple(ctx.shape) != (t,):
        raise ValueError(f"ctx must have shape ({t},) (topk's tokens), got {tuple(ctx.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must have shape [rows, W], got {tuple(block_table.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if out.dtype != torch.int32 or tuple(out.shape) != tuple(topk.shape):
        raise ValueError(f"out must be int32 of topk's shape {tuple(topk.shape)}, got {out.dtype} {tuple(out.shape)}")
    if counts.dtype != torch.int32 or tuple(counts.shape) != tuple(topk.shape[:-1]):
        raise ValueError(
            f"counts must be int32 of shape {tuple(topk.shape[:-1])}, got {counts.dtype} {tuple(counts.shape)}"
        )
    if errors.dtype != torch.int64 or tuple(errors.shape) != (layers, 2):
        raise ValueError(f"errors must be int64 of shape ({layers}, 2), got {errors.dtype} {tuple(errors.shape)}")
    for name, x in (("req_id", req_id), ("block_table", block_table), ("ctx", ctx), ("out", out)):
        if x.device != topk.device:
            raise ValueError(f"{name} must be on topk's device {topk.device}, got {x.device}")
    for name, x in (("counts", counts), ("errors", errors)):
        if x.device != topk.device:
            raise ValueError(f"{name} must be on topk's device {topk.device}, got {x.device}")
    return layers, t, k


def _fake(topk, req_id, block_table, ctx, block_size, compact, cp_size, cp_rank, cp_interleave, out, counts, errors):
    _check(topk, req_id, block_table, ctx, block_size, out, counts, errors)


def _cpu(topk, req_id, block_table, ctx, block_size, compact, cp_size, cp_rank, cp_interleave, out, counts, errors):
    layers, t, k = _check(topk, req_id, block_table, ctx, block_size, out, counts, errors)
    tk = topk.numpy().reshape(layers, t, k)
    req = req_id.numpy().astype(np.int64)
    table = block_table.numpy()
    pad = req < 0
    if pad.any():  # padding tokens: a row of -1s, no error (the kernel's rule)
        tk = np.where(pad[None, :, None], -1, tk)
        req = np.where(pad, 0, req)
        if table.shape[0] == 0:
            table = np.zeros((1, table.shape[1]), np.int32)
    r = _reference(
        tk,
        req,
        table,
        block_size,
        np.maximum(ctx.numpy(), 0),
        compact=bool(compact),
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
    )
    out.copy_(torch.from_numpy(r.slots.reshape(tuple(topk.shape))))
    counts.copy_(torch.from_numpy(r.valid_counts.reshape(tuple(topk.shape[:-1]))))
    rec = errors.numpy().view(np.uint64)
    rec[:, 0] |= r.error_mask.astype(np.uint64)
    rec[:, 1] = np.minimum(rec[:, 1], r.error_key.astype(np.uint64))


def _cuda(topk, req_id, block_table, ctx, block_size, compact, cp_size, cp_rank, cp_interleave, out, counts, errors):
    _device_topk_to_slots(
        topk,
        req_id,
        block_table,
        block_size,
        ctx,
        out=out,
        counts=counts,
        errors=errors,
        compact=bool(compact),
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        stream=_raw_stream(topk.device.index),
    )


def new_errors(num_layers: int = 1, device=None) -> torch.Tensor:
    """Clean error records for :func:`dsa_topk_to_slots`: int64 ``[num_layers, 2]`` of (0, -1)."""
    e = torch.empty((num_layers, 2), dtype=torch.int64, device=device)
    e[:, 0] = 0
    e[:, 1] = NO_ERROR_I64
    return e


def dsa_topk_to_slots(
    topk: torch.Tensor,
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    ctx: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    compact: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k positions -> cache slots (``torch.ops.kvaddr.dsa_topk_to_slots``).

    Parameters
    ----------
    topk : int32 [T, K] or [L, T, K]
    req_id : int32 [T]
        Each token's row of ``block_table`` (< 0: padding).
    block_table : int32 [rows, W]
    block_size : int
    ctx : int32 [T]
        Each token's context length.
    out, counts, errors : torch.Tensor, optional
        int32 ``topk.shape``, int32 ``topk.shape[:-1]``, int64 ``[L, 2]`` (:func:`new_errors`):
        persistent outputs (allocated when None; ``errors`` is sticky).
    compact : bool, optional
        Valid slots first in each row.
    cp_size, cp_rank, cp_interleave : int, optional
        Decode context parallelism.

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        ``out`` (slots), ``counts`` (valid slots per row), ``errors`` (per layer: mask, key).
    """
    layers = topk.shape[0] if topk.dim() == 3 else 1
    if out is None:
        out = torch.empty_like(topk)
    if counts is None:
        counts = torch.empty(topk.shape[:-1], dtype=torch.int32, device=topk.device)
    if errors is None:
        errors = new_errors(layers, topk.device)
    _op(
        topk,
        req_id,
        block_table,
        ctx,
        block_size,
        compact,
        cp_size,
        cp_rank,
        cp_interleave,
        out,
        counts,
        errors,
    )
    return out, counts, errors


_lib = torch.library.Library("kvaddr", "FRAGMENT")
_lib.define(SCHEMA)
_lib.impl("dsa_topk_to_slots", _cpu, "CPU")
_lib.impl("dsa_topk_to_slots", _cuda, "CUDA")
torch.library.register_fake("kvaddr::dsa_topk_to_slots", _fake, lib=_lib)
_fallthrough = getattr(torch.library, "fallthrough_kernel", None)
if _fallthrough is not None:  # no derivative, int tensors only: skip autograd's generic fallback
    _lib.impl("dsa_topk_to_slots", _fallthrough, "Autograd")
_op = torch.ops.kvaddr.dsa_topk_to_slots.default
