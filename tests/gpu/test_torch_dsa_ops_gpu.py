"""torch.ops.kvaddr.dsa_topk_to_slots on CUDA: equal to the NumPy reference at K = 2048 (plain,
compacting, layers, DCP), opcheck, torch.compile(fullgraph=True) (inductor and aot_eager) equal to
eager, inside torch.cuda.graph with the inputs changed between replays, and on a non-default
stream. Skips without torch, CUDA or CuPy. tests/unit/test_torch_dsa_ops.py is the CPU side."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.dsa_reference import topk_to_slots as reference
from tests.support.torch_ops import cuda_torch_skip_reason

SKIP = cuda_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def case(seed, t=300, k=2048, b=64, layers=1):
    rng = np.random.default_rng(seed)
    width = 4096 // b
    table = rng.integers(0, 1 << 20, size=(40, width))
    req = rng.integers(0, 40, size=t)
    ctx = rng.integers(1, 4097, size=t)
    topk = (rng.random((layers, t, k)) * ctx[None, :, None]).astype(np.int64)
    topk = np.where(np.arange(k)[None, None, :] < np.minimum(ctx, k)[None, :, None], topk, -1)
    topk[rng.random(topk.shape) < 0.001] = 5000  # past every context
    return (topk if layers > 1 else topk[0]), req, table, b, ctx


def cuda(x):
    import torch

    return torch.tensor(np.asarray(x), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_equals_the_reference(layers, compact, cp):
    import torch

    from kvaddr.torch import dsa_topk_to_slots

    topk, req, table, b, ctx = case(layers * 10 + cp, layers=layers)
    kw = {"compact": compact, "cp_size": cp, "cp_rank": cp - 1, "cp_interleave": 1}
    out, counts, errors = dsa_topk_to_slots(cuda(topk), cuda(req), cuda(table), b, cuda(ctx), **kw)
    torch.cuda.synchronize()
    want = reference(topk, req, table, b, ctx, **kw)
    np.testing.assert_array_equal(out.cpu().numpy(), want.slots)
    np.testing.assert_array_equal(counts.cpu().numpy(), want.valid_counts)
    rec = errors.cpu().numpy().view(np.uint64)
    np.testing.assert_array_equal(rec[:, 0], np.atleast_1d(want.error_mask))
    np.testing.assert_array_equal(rec[:, 1], np.atleast_1d(np.asarray(want.error_key, np.uint64)))


def test_opcheck_passes():
    import torch
    from torch.library import opcheck

    from kvaddr.torch.dsa_ops import new_errors

    topk, req, table, b, ctx = case(1, t=40)
    tk = cuda(topk)
    args = (
        tk,
        cuda(req),
        cuda(table),
        cuda(ctx),
        b,
        True,
        1,
        0,
        1,
        torch.empty_like(tk),
        torch.empty(tk.shape[:-1], dtype=torch.int32, device="cuda"),
        new_errors(1, "cuda"),
    )
    result = opcheck(torch.ops.kvaddr.dsa_topk_to_slots.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_fullgraph_equals_eager(backend):
    import torch

    from kvaddr.torch import dsa_topk_to_slots

    def model(topk, req, table, ctx, keys):
        slots, counts, _ = dsa_topk_to_slots(topk, req, table, 64, ctx, compact=True)
        return keys[slots.clamp(min=0).long() % keys.shape[0]].sum(-1), counts

    topk, req, table, _b, ctx = case(2, t=64)
    args = (cuda(topk), cuda(req), cuda(table), cuda(ctx), torch.randn(4096, device="cuda"))
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend=backend)(*args)
    want = model(*args)
    assert torch.allclose(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cuda_graph_replay_reads_new_inputs():
    import torch

    from kvaddr.torch import dsa_topk_to_slots
    from kvaddr.torch.dsa_ops import new_errors

    topk, req, table, b, ctx = case(3, t=128)
    ins = [cuda(x) for x in (topk, req, table, ctx)]
    out = torch.empty_like(ins[0])
    counts = torch.empty(128, dtype=torch.int32, device="cuda")
    errors = new_errors(1, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (the kernel is compiled and loaded outside the capture)
        dsa_topk_to_slots(ins[0], ins[1], ins[2], b, ins[3], out=out, counts=counts, errors=errors, compact=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dsa_topk_to_slots(ins[0], ins[1], ins[2], b, ins[3], out=out, counts=counts, errors=errors, compact=True)
    topk2, req2, table2, _, ctx2 = case(4, t=128)
    for x, h in zip(ins, (topk2, req2, table2, ctx2)):
        x.copy_(torch.tensor(h, dtype=torch.int32))
    out.fill_(12345)
    g.replay()
    torch.cuda.synchronize()
    want = reference(topk2, req2, table2, b, ctx2, compact=True)
    np.testing.assert_array_equal(out.cpu().numpy(), want.slots)
    np.testing.assert_array_equal(counts.cpu().numpy(), want.valid_counts)
