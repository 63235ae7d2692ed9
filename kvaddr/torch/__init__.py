"""kvaddr as PyTorch ops: ``import kvaddr.torch`` registers ``torch.ops.kvaddr.step``.

``import kvaddr`` never imports torch; this subpackage does, and registers (through
``torch.library.Library("kvaddr", "DEF")``, no Python dispatch of ``custom_op``):

``torch.ops.kvaddr.step(seq_lens_decoder, seq_lens_this_time, block_tables, block_sizes,
cu_seqlens_q, num_tokens, batch_id_per_token, position_ids, seq_lens_kv, slot_mapping,
workspace) -> ()``
    The whole step's addressing (docs/spec.md) in one launch. It **mutates the caller's
    output tensors** (``Tensor(a!)`` in the schema) and returns nothing: allocate them
    once (:class:`StepBuffers`) and pass the same tensors every step. CUDA: the fused
    kernel on torch's current stream; CPU: the NumPy reference; Meta/fake: shape checks
    only, so ``torch.compile(fullgraph=True)`` traces it without a graph break.

Layer: torch. May import the library and :mod:`kvaddr.engines` only (tests/unit/test_layering.py).
"""

from kvaddr.torch.ops import (
    StepBuffers,
    clear_cache,
    set_autograd_fallthrough,
    set_debug,
    step,
    workspace_errors,
    workspace_size,
)

__all__ = [
    "StepBuffers",
    "clear_cache",
    "set_autograd_fallthrough",
    "set_debug",
    "step",
    "workspace_errors",
    "workspace_size",
]
