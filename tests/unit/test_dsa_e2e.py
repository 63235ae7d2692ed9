"""End to end on the CPU: K/V written through the step's slot mapping (kvaddr.reference) into a
paged MLA cache, top-k chosen from random scores, the top-k converted to slots by the emulated
kernel (kernels/dsa.cuh, compacting) and by the NumPy reference, and the rows gathered through
those slots equal to the contiguous K/V at the chosen positions (tests/support/dsa_e2e.py).
tests/gpu/test_dsa_e2e_gpu.py runs the same on the GPU with torch."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.dsa_reference import indexer_metadata
from kvaddr.dsa_reference import topk_to_slots as reference
from kvaddr.reference import step_addressing
from tests.support import dsa_emulator
from tests.support.dsa_e2e import MLA_BYTES, check_gather, choose_topk, make_batch


@pytest.mark.parametrize("block_size, k, drafts", [(64, 256, 0), (13, 100, 2), (64, 64, 1)])
def test_gathered_keys_equal_the_contiguous_keys(monkeypatch, block_size, k, drafts):
    if dsa_emulator.CXX is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    from kvaddr.dsa import topk_slot_errors, topk_to_slots
    from tests.support import dsa_fake_gpu

    dsa_fake_gpu.install(monkeypatch)
    rng = np.random.default_rng(block_size + k)
    batch = make_batch(rng, num_decodes=5, num_prefills=3, drafts=drafts, block_size=block_size, max_context=700)
    seq, q, table = batch["seq_lens"], batch["query_lens"], batch["table"]
    cache = np.zeros((batch["num_blocks"] * block_size, MLA_BYTES), np.uint8)
    before = seq - q
    cap = int(seq.sum())
    # the history (earlier steps), then this step, each written through its slot mapping
    for dec, this in ((np.zeros_like(seq), before), (before, q)):
        out = step_addressing(dec, this, table, block_size, cap).outputs
        n = int(out.num_tokens)
        b, pos, slot = out.batch_id_per_token[:n], out.position_ids[:n], out.slot_mapping[0][:n]
        assert (slot >= 0).all()
        for i in range(n):
            cache[slot[i]] = batch["kv"][b[i]][pos[i]]
    req_id, ctx = out.batch_id_per_token[:n].astype(np.int32), (out.position_ids[:n] + 1).astype(np.int32)
    meta = indexer_metadata(seq, q, batch["num_decodes"])
    np.testing.assert_array_equal(meta.req_id_per_token, req_id)
    np.testing.assert_array_equal(meta.ctx, ctx)

    topk = choose_topk(rng, ctx, k)
    want = reference(topk, req_id, table, block_size, ctx, compact=True)
    assert want.error_mask == 0 and (want.valid_counts < k).any()
    check_gather(batch, cache, req_id, topk, want.slots, want.valid_counts)
    got = topk_to_slots(
        *(dsa_fake_gpu.on_fake(np.ascontiguousarray(x)) for x in (topk, req_id, table)),
        block_size,
        dsa_fake_gpu.on_fake(ctx),
        compact=True,
    )
    assert topk_slot_errors(got.errors)[0].tolist() == [0]
    check_gather(batch, cache, req_id, topk, got.slots.a, got.valid_counts.a)
