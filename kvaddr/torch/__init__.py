"""kvaddr as PyTorch ops: ``import kvaddr.torch`` registers ``torch.ops.kvaddr.step``.

``import kvaddr`` never imports torch; this subpackage does, and registers (through
``torch.library.Library("kvaddr", "DEF")``, no Python dispatch of ``custom_op``):

``torch.ops.kvaddr.step_into(seq_lens_decoder, seq_lens_this_time, block_table, out, layout) -> ()``
and ``step_into.tables(..., block_tables, out, layout)``
    The whole step's addressing (docs/spec.md) in one launch, into ``out`` =
    :attr:`StepBuffers.storage` (every output and the workspace packed in one int64 tensor,
    mutated) with ``layout`` = :attr:`StepBuffers.layout` (an int handle). :func:`step` calls it
    and returns views of the outputs (the same objects for the same bsz, eagerly).
``torch.ops.kvaddr.step(seq_lens_decoder, seq_lens_this_time, block_tables, block_sizes,
cu_seqlens_q, num_tokens, batch_id_per_token, position_ids, seq_lens_kv, slot_mapping,
workspace) -> ()``
    The same with one mutated argument per output (``StepBuffers.outputs_args``, or your own
    tensors); more host time per eager call (more arguments through torch's dispatcher).

Both **mutate the caller's tensors** (``Tensor(a!)`` in the schema) and return nothing: allocate
them once (:class:`StepBuffers`) and pass the same tensors every step. CUDA: the fused kernel on
torch's current stream; CPU: the NumPy reference; Meta/fake: shape checks only, so
``torch.compile(fullgraph=True)`` traces them without a graph break.

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
