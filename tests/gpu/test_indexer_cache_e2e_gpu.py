"""End to end through the indexer's K cache on the GPU (CPU twin: tests/unit/test_indexer_cache_e2e.py):
the fused step's DSA offsets (StepPlanner with ``dsa=True``) place random fp8 keys and fp32 scales,
written with torch on the device, in a ``[blocks, B * 132]`` byte cache exactly where the layout
puts them, and the scorer's block read (values first, then scales) returns every token's key.
Decode, MTP and mixed steps, B = 64 and a block size that is not a power of two, more than 1024
requests. Skips, with the reason, without a GPU, CuPy or CUDA torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import indexer_cache as ic
from tests.support.skips import cuda_torch_skip_reason

pytestmark = pytest.mark.skipif(cuda_torch_skip_reason() is not None, reason=str(cuda_torch_skip_reason()))


@pytest.mark.parametrize("B", [64, 48])
@pytest.mark.parametrize("bsz, n", [(1, 1), (64, 1), (300, 3), (1100, 2)])
def test_write_and_scorer_read(bsz, n, B):
    import cupy
    import torch

    from kvaddr import StepPlanner

    rng = np.random.default_rng(bsz * n + B)
    dec, q, table, nb = ic.step_inputs(rng, bsz, B, n=n)
    C = int(q.sum()) + 3
    p = StepPlanner(bsz, C, [B, B], dsa=True, dsa_decode_len=n)
    out = p.compute(cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table))
    p.check()
    req = torch.as_tensor(out.batch_id_per_token, device="cuda").long()
    pos = torch.as_tensor(out.position_ids, device="cuda").long()
    values, scales = ic.keys(rng, C)
    cache = torch.zeros((nb, B * (ic.V + ic.S)), dtype=torch.uint8, device="cuda")
    ic.write_torch(
        cache,
        torch.as_tensor(out.dsa.value_offsets, device="cuda"),
        torch.as_tensor(out.dsa.scale_offsets, device="cuda"),
        torch.from_numpy(values).cuda(),
        torch.from_numpy(scales).cuda(),
    )
    req_h, pos_h = req.cpu().numpy(), pos.cpu().numpy()
    np.testing.assert_array_equal(cache.cpu().numpy(), ic.expected_cache(nb, B, table, req_h, pos_h, values, scales))
    real = req >= 0
    vals, sc = ic.read_torch(cache, B, torch.from_numpy(table).cuda().long(), req[real], pos[real])
    np.testing.assert_array_equal(vals.cpu().numpy(), values[req_h >= 0])
    np.testing.assert_array_equal(sc.cpu().numpy().view(np.uint32), scales[req_h >= 0].view(np.uint32))
