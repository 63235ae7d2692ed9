"""Shared by the torch-op tests (CPU and GPU): why they skip, and running the op on a step case."""

from __future__ import annotations

import numpy as np

from kvaddr.outputs import OUTPUT_FIELDS, StepOutputs
from tests.support.skips import cuda_torch_skip_reason, torch_skip_reason  # noqa: F401  (the torch-op tests import them from here)


def case_tensors(case, device):
    """The case's inputs as torch tensors on ``device`` (row-strided tables kept row-strided)."""
    import torch

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    tables = case["block_tables"]
    if not isinstance(tables, (list, tuple)):
        tables = [tables] * len(case["block_sizes"])
    conv, seen = [], {}
    for x in tables:
        if id(x) not in seen:
            if x.ndim == 2 and x.base is not None and x.base.ndim == 2 and x.strides[0] != x.shape[1] * 4:
                seen[id(x)] = t(x.base)[:, : x.shape[1]]  # keep the row stride
            else:
                seen[id(x)] = t(x)
        conv.append(seen[id(x)])
    return t(case["seq_lens_decoder"]), t(case["seq_lens_this_time"]), conv


def run_op(case, device, *, position_dtype=None, max_requests=None, buffers=None, poison=True):
    """Run ``torch.ops.kvaddr.step`` on a step case; return (NumPy StepOutputs, (mask, key), buffers)."""
    import torch

    from kvaddr.torch import StepBuffers, step

    if position_dtype is None:
        position_dtype = torch.int64
    dec, q, tables = case_tensors(case, device)
    bsz = dec.shape[0]
    if buffers is None:
        buffers = StepBuffers(
            max(max_requests or bsz, 1),
            case["capacity"],
            case["block_sizes"],
            position_dtype=position_dtype,
            device=device,
        )
    if poison:
        for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping"):
            getattr(buffers, name).fill_(0x5A5A5A5A)
        buffers.num_tokens.fill_(-77)
    out = step(dec, q, tables if case["block_sizes"] else [], buffers)
    if device != "cpu":
        torch.cuda.synchronize()
    host = StepOutputs(*(getattr(out, f).cpu().numpy() for f in OUTPUT_FIELDS))
    return host, buffers.errors(), buffers


def vllm_case_tensors(inputs, device):
    """A vLLM case's inputs (tests/support/vllm_cases.py) as torch tensors on ``device``, in the op's
    argument order; ``num_blocks`` stacked into one [G, rows] tensor. Copies: never aliasing the case."""
    import torch

    def t(x):
        return torch.from_numpy(np.array(x)).to(device)

    return (
        t(inputs["idx_mapping"]),
        t(inputs["query_start_loc"]),
        t(inputs["num_computed_tokens"]),
        [t(x) for x in inputs["block_tables"]],
        t(np.stack(inputs["num_blocks"])),
    )
