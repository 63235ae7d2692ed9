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

``StepBuffers(..., attention=..., kv_indices_capacity=...)`` packs the attention metadata
(docs/attention.md) too: ``step_into`` writes it in the same launch and :func:`step` returns it in
``StepOutputs.attention`` (``page_table``: views of the input tables; docs/torch.md).

Both **mutate the caller's tensors** (``Tensor(a!)`` in the schema) and return nothing: allocate
them once (:class:`StepBuffers`) and pass the same tensors every step. CUDA: the fused kernel on
torch's current stream; CPU: the NumPy reference; Meta/fake: shape checks only, so
``torch.compile(fullgraph=True)`` traces them without a graph break.

``torch.ops.kvaddr.vllm_step_into(idx_mapping, query_start_loc, num_computed_tokens, block_tables,
num_blocks, num_reqs_padded, out, layout) -> ()``
    The vLLM step (docs/vllm.md) into ``out`` = :attr:`VllmStepBuffers.storage` (every output and
    the error records packed), ``layout`` = :attr:`VllmStepBuffers.layout`. :func:`vllm_step` calls
    it and returns the views (:mod:`kvaddr.torch.vllm_ops`).

``torch.ops.kvaddr.dsa_topk_to_slots(topk, req_id, block_table, ctx, block_size, compact, cp_size,
cp_rank, cp_interleave, out, counts, errors) -> ()``
    DeepSeek-V3.2's top-k -> slot conversion (docs/dsa.md) into the mutated ``out`` / ``counts`` /
    ``errors``; :func:`dsa_topk_to_slots` calls it (:mod:`kvaddr.torch.dsa_ops`).
``torch.ops.kvaddr.draft_steps(seq_lens_decoder, accept_num, block_tables, block_sizes, cu_seqlens_q,
num_tokens, batch_id_per_token, position_ids, seq_lens_kv, slot_mapping, error_records) -> ()``
    Every MTP substep's addressing (docs/spec-decode.md) in one launch into ``[k, ...]`` tensors
    (:class:`DraftStepBuffers`); :func:`draft_steps` calls it and returns the views
    (:mod:`kvaddr.torch.mtp_ops`).
``torch.ops.kvaddr.vllm_draft_into(idx_mapping, query_start_loc, seq_lens, num_rejected, num_sampled,
block_tables, num_blocks, verify_slot_mappings, out, layout) -> ()``
    The draft forwards' addressing after a verify step (docs/spec-decode.md) into ``out`` =
    :attr:`VllmDraftBuffers.storage`; :func:`vllm_draft` calls it (:mod:`kvaddr.torch.vllm_draft_ops`).

Layer: torch. May import the library and :mod:`kvaddr.engines` only (tests/unit/test_layering.py).
"""

from kvaddr.torch.dsa_ops import dsa_topk_to_slots
from kvaddr.torch.mtp_ops import DraftStepBuffers, draft_errors, draft_steps
from kvaddr.torch.ops import (
    StepBuffers,
    clear_cache,
    reset_workspace_errors,
    set_autograd_fallthrough,
    set_debug,
    step,
    workspace_errors,
    workspace_size,
)
from kvaddr.torch.vllm_draft_ops import VllmDraftBuffers, vllm_draft
from kvaddr.torch.vllm_ops import VllmStepBuffers, vllm_step

# torch.ops.kvaddr.vllm_step_into is registered by importing kvaddr.torch.vllm_ops (above).

__all__ = [
    "DraftStepBuffers",
    "StepBuffers",
    "VllmDraftBuffers",
    "VllmStepBuffers",
    "clear_cache",
    "draft_errors",
    "draft_steps",
    "dsa_topk_to_slots",
    "reset_workspace_errors",
    "set_autograd_fallthrough",
    "set_debug",
    "step",
    "vllm_draft",
    "vllm_step",
    "workspace_errors",
    "workspace_size",
]
