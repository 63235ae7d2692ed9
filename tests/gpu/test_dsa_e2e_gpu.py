"""End to end on the GPU with torch: K/V written through the step's slot mapping
(``kvaddr.torch.step``) into a paged MLA cache, top-k chosen by ``torch.topk`` from random scores
inside each token's context, converted by ``torch.ops.kvaddr.dsa_topk_to_slots`` (compacting), and
the cache rows gathered through the slots equal to the contiguous K/V at the chosen positions.
tests/unit/test_dsa_e2e.py is the CPU twin (NumPy, the emulated kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.dsa_e2e import MLA_BYTES, check_gather, make_batch
from tests.support.torch_ops import cuda_torch_skip_reason

SKIP = cuda_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def run_e2e(device, block_size, k, drafts, max_context, seed=0):
    import torch

    from kvaddr.torch import StepBuffers, dsa_topk_to_slots, step

    rng = np.random.default_rng(seed)
    num_decodes = 40
    batch = make_batch(
        rng, num_decodes=num_decodes, num_prefills=2, drafts=drafts, block_size=block_size, max_context=max_context
    )
    seq, q = batch["seq_lens"], batch["query_lens"]
    dev = torch.device(device)
    table = torch.tensor(batch["table"], device=dev)
    cache = torch.zeros((batch["num_blocks"] * block_size, MLA_BYTES), dtype=torch.uint8, device=dev)
    before = seq - q
    bufs = StepBuffers(len(seq), int(seq.sum()), (block_size,), device=dev)
    for dec, this in ((np.zeros_like(seq), before), (before, q)):
        out = step(torch.tensor(dec, device=dev), torch.tensor(this, device=dev), table, bufs)
        n = int(out.num_tokens)
        b = out.batch_id_per_token[:n].cpu().numpy()
        pos = out.position_ids[:n].cpu().numpy()
        kv = torch.tensor(np.stack([batch["kv"][b[i]][pos[i]] for i in range(n)]), device=dev)
        cache.index_copy_(0, out.slot_mapping[0][:n], kv)  # the step's slot mapping writes the cache
    req_id = out.batch_id_per_token[:n].clone()
    ctx = (out.position_ids[:n] + 1).to(torch.int32)
    scores = torch.rand((n, max_context), device=dev)
    inside = torch.arange(max_context, device=dev)[None, :] < ctx[:, None]
    scores = torch.where(inside, scores, torch.full_like(scores, -1.0))
    val, idx = torch.topk(scores, min(k, max_context), dim=1)
    topk = torch.where(val >= 0, idx, torch.full_like(idx, -1)).to(torch.int32)
    if topk.shape[1] < k:
        topk = torch.cat([topk, torch.full((n, k - topk.shape[1]), -1, dtype=torch.int32, device=dev)], 1)
    topk = topk.contiguous()
    slots, counts, errors = dsa_topk_to_slots(topk, req_id, table, block_size, ctx, compact=True)
    assert errors[:, 0].cpu().tolist() == [0]
    gathered = cache.cpu().numpy()
    # every decode token and 64 of the prefill tokens (each token compares K rows of 656 bytes)
    nd = num_decodes * (1 + drafts)
    tokens = [*range(nd), *rng.choice(np.arange(nd, n), size=min(64, n - nd), replace=False).tolist()]
    host = (req_id.cpu().numpy(), topk.cpu().numpy(), slots.cpu().numpy(), counts.cpu().numpy())
    check_gather(batch, gathered, *host, tokens=tokens)
    # the gather on the device, through the first counts[t] slots, equals the contiguous rows too
    t = int(torch.argmax(counts))
    rows = cache[slots[t, : int(counts[t])].long()].cpu().numpy()
    chosen = topk[t][topk[t] >= 0].cpu().numpy()
    np.testing.assert_array_equal(rows, batch["kv"][int(req_id[t])][chosen])
    return int(counts.min()), int(counts.max())


@pytest.mark.parametrize("block_size, drafts", [(64, 0), (64, 1), (13, 2)])
def test_gathered_keys_equal_the_contiguous_keys(block_size, drafts):
    lo, hi = run_e2e("cuda", block_size, 2048, drafts, max_context=3000, seed=block_size + drafts)
    assert lo < 2048 == hi  # short requests and full rows
