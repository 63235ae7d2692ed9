"""Helpers the torch ops share: torch's current stream as a raw handle, the 1-D tensor check
of the ops' metadata (it runs on fake tensors too), and a tensor on a packed output's memory.

Layer: torch (imports the library core only).
"""

from __future__ import annotations

import torch


def _raw_stream_slow(dev: int) -> int:
    return torch.cuda.current_stream(dev).cuda_stream


#: torch's current stream of a device as a raw cudaStream_t (what inductor's get_raw_stream uses;
#: no Stream object is made per call).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _raw_stream_slow


def check_vector(name, t, dtypes, length=None, min_length=None, shape_text="") -> None:
    """Raise TypeError / ValueError naming ``name`` unless ``t`` is a contiguous 1-D tensor of one
    of ``dtypes`` with ``length`` (or at least ``min_length``) entries."""
    what = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {what} with shape {shape_text}, got dtype {t.dtype}")
    if (
        t.dim() != 1
        or (length is not None and t.shape[0] != length)
        or (min_length is not None and t.shape[0] < min_length)
    ):
        raise ValueError(f"{name} must be {what} with shape {shape_text}, got shape {tuple(t.shape)}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got a strided view (stride {t.stride(0)} elements)")


def storage_alias(out: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s memory that is not a view of ``out`` (no ``_base``: it holds the
    storage, not the ``out`` object, so ``out`` can die and its planner be forgotten)."""
    t = torch.empty(0, dtype=view.dtype, device=view.device)
    return t.set_(out.untyped_storage(), view.storage_offset(), view.shape, view.stride())
