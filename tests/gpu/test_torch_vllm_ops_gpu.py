"""torch.ops.kvaddr.vllm_step_into on CUDA (the VllmStepPlanner writing into VllmStepBuffers.storage):
equal to the NumPy reference (docs/vllm.md's worked example, DCP, random batches with several groups,
int32 slots, bad values and their error records, a sequence of steps on the same buffers), opcheck,
torch.compile(fullgraph=True) with inductor and aot_eager equal to eager with no graph break, inside
torch.cuda.graph (eager and compiled) with contents changed between replays, and on a non-default
torch stream. Skips without torch, CUDA or CuPy. tests/unit/test_torch_vllm_ops.py is the CPU side."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY, VllmAddressingError
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.torch_ops import cuda_torch_skip_reason, vllm_case_tensors
from tests.support.vllm_cases import (
    WORKED_EXAMPLE_OUTPUTS,
    assert_same,
    corrupt,
    new_batch,
    random_case,
    worked_example,
)

SKIP = cuda_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def tensors(inputs, device="cuda"):
    return vllm_case_tensors(inputs, device)


def reference(cfg, inputs, padded=None):
    return vllm_step_reference(cfg, **inputs, num_reqs_padded=padded)


def run(cfg, inputs, bufs=None, padded=None):
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    bufs = bufs or VllmStepBuffers(config=cfg, device="cuda")
    out = vllm_step(*tensors(inputs), bufs, num_reqs_padded=padded)
    torch.cuda.synchronize()
    return out, bufs


def copy_inputs(args, inputs):
    """Write a case's inputs into the persistent tensors ``args`` (same shapes) in place."""
    import torch

    idx, qsl, nct, tables, nb = args
    idx.copy_(torch.from_numpy(np.ascontiguousarray(inputs["idx_mapping"])))
    qsl.copy_(torch.from_numpy(inputs["query_start_loc"]))
    nct.copy_(torch.from_numpy(inputs["num_computed_tokens"]))
    for t, x in zip(tables, inputs["block_tables"]):
        t.copy_(torch.from_numpy(x))
    nb.copy_(torch.from_numpy(np.stack(inputs["num_blocks"])))


def test_worked_example_on_cuda():
    cfg, inputs = worked_example()
    out, bufs = run(cfg, inputs)
    want = WORKED_EXAMPLE_OUTPUTS
    assert_same(out, want, "worked example")
    assert out is bufs.outputs and bufs.planner is not None
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)
    assert bufs.planner.errors() == (0, VLLM_NO_ERROR_KEY)


@pytest.mark.parametrize("rank,slot", [(0, -1), (1, 30)])
def test_worked_example_with_dcp_on_cuda(rank, slot):
    cfg, inputs = worked_example(cp_size=2, cp_rank=rank, cp_interleave=1)
    out, _ = run(cfg, inputs)
    assert_same(out, reference(cfg, inputs).outputs.as_dict(), f"rank {rank}")
    assert int(out.slot_mappings[0, 0]) == slot and int(out.dcp_local_seq_lens[0]) == 3


@pytest.mark.parametrize(
    "seed, M, n, block_sizes, max_query, idx_dtype, slot_dtype",
    [
        (1, 1, 1, (16,), 1, np.int32, np.int64),
        (2, 40, 33, (16, 32), 7, np.int64, np.int64),
        (3, 64, 0, (16,), 1, np.int32, np.int64),
        (4, 300, 260, (4, 8, 16, 64), 3, np.int32, np.int32),
        (5, 1024, 1000, (16, 128), 9, np.int64, np.int64),
    ],
)
def test_random_batches_equal_the_reference_on_cuda(seed, M, n, block_sizes, max_query, idx_dtype, slot_dtype):
    rng = np.random.default_rng(seed)
    cfg, inputs = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=n,
        block_sizes=block_sizes,
        max_query=max_query,
        idx_dtype=idx_dtype,
        slot_dtype=slot_dtype,
    )
    from kvaddr.torch import VllmStepBuffers

    bufs = VllmStepBuffers(config=cfg, device="cuda")
    bufs.storage.fill_(0x5A5A5A5A)  # garbage in every output: each call writes every element
    bufs.clear_errors()  # (not in the sticky error records: those only the reader clears)
    padded = int(rng.integers(n, M + 1))
    out, _ = run(cfg, inputs, bufs=bufs, padded=padded)
    ref = reference(cfg, inputs, padded)
    assert_same(out, ref.outputs.as_dict(), f"seed {seed}")
    assert bufs.errors() == (ref.error_mask, ref.error_key) == (0, VLLM_NO_ERROR_KEY)
    # Bad values: recorded in out's error records, like the reference.
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    out, _ = run(cfg, bad, bufs=bufs)
    ref = reference(cfg, bad)
    assert_same(out, ref.outputs.as_dict(), f"seed {seed}, bad values")
    assert bufs.errors() == (ref.error_mask, ref.error_key)
    if ref.error_mask:
        assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)  # the read reset the records
        run(cfg, bad, bufs=bufs)
        run(cfg, inputs, bufs=bufs)  # sticky: a good step after the bad one keeps its record
        with pytest.raises(VllmAddressingError):
            bufs.check()
    # More steps over the same request state on the same buffers: nothing stale, errors cleared.
    for k in range(3):
        step = new_batch(rng, cfg, inputs, num_reqs=int(rng.integers(0, min(n, cfg.max_num_batched_tokens) + 1)))
        out, _ = run(cfg, step, bufs=bufs)
        assert_same(out, reference(cfg, step).outputs.as_dict(), f"seed {seed}, step {k}")
        assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)


def test_same_tensors_many_steps_take_the_planners_memo():
    """An engine's pattern: persistent input tensors rewritten in place every step; the planner
    checks them once (its memo), the outputs follow the contents."""
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(12)
    cfg, inputs = random_case(rng, max_num_reqs=128, num_reqs=100, block_sizes=(16, 32))
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    args = tensors(inputs)
    for k in range(5):
        step = new_batch(rng, cfg, inputs, num_reqs=100)
        copy_inputs(args, step)
        vllm_step(*args, bufs, num_reqs_padded=128)
        torch.cuda.synchronize()
        assert_same(bufs.outputs, reference(cfg, step, 128).outputs.as_dict(), f"step {k}")
        if k > 0:  # the memo is made by the second call with the same tensors
            assert bufs.planner._memo is not None


def test_opcheck_on_cuda():
    import torch
    from torch.library import opcheck

    from kvaddr.torch import VllmStepBuffers

    for slot_dtype in (np.int64, np.int32):
        rng = np.random.default_rng(3)
        cfg, inputs = random_case(
            rng, max_num_reqs=9, num_reqs=6, block_sizes=(8, 16), max_query=3, slot_dtype=slot_dtype
        )
        bufs = VllmStepBuffers(config=cfg, device="cuda")
        result = opcheck(torch.ops.kvaddr.vllm_step_into.default, (*tensors(inputs), 7, bufs.storage, bufs.layout))
        assert all(v == "SUCCESS" for v in result.values()), result


def _compile_case():
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(5)
    cfg, inputs = random_case(rng, max_num_reqs=64, num_reqs=50, block_sizes=(16, 8), max_query=4)
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    hidden = torch.randn(97, 32, device="cuda")

    def model(idx, qsl, nct, t0, t1, nb, hidden):
        out = vllm_step(idx, qsl, nct, [t0, t1], nb, bufs, num_reqs_padded=56)
        h = hidden[out.positions % hidden.shape[0]].sum(-1)
        return h + out.slot_mappings[1].to(h.dtype), out.seq_lens * 1, out.input_block_tables[0] + 0

    idx, qsl, nct, tables, nb = tensors(inputs)
    return rng, cfg, inputs, bufs, model, [idx, qsl, nct, *tables, nb, hidden]


def _views(bufs):
    o = bufs.outputs
    return [o.positions, o.seq_lens, o.slot_mappings, *o.input_block_tables, o.dcp_local_seq_lens, bufs.records]


def test_no_graph_break_on_cuda():
    import torch

    _, _, _, _, model, args = _compile_case()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_fullgraph_equals_eager_on_cuda(backend):
    import torch

    rng, cfg, inputs, bufs, model, args = _compile_case()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for k in range(3):  # new contents every call, same tensors
        step = new_batch(rng, cfg, inputs, num_reqs=50)
        copy_inputs((args[0], args[1], args[2], args[3:5], args[5]), step)
        want = [x.clone() for x in model(*args)]
        want_views = [x.clone() for x in _views(bufs)]
        # Poison what every call rewrites in full; the gathered tables are the planner's (it zeroes
        # only the entries it may have filled: an outside write there would stay, docs/torch.md).
        # The error records are sticky (a clean step writes nothing): they stay clean, not poisoned.
        o = bufs.outputs
        for t in (o.positions, o.seq_lens, o.slot_mappings, o.dcp_local_seq_lens):
            t.fill_(7)
        got = compiled(*args)
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            if g.is_floating_point():  # the model's own float math: inductor may fuse and round differently
                torch.testing.assert_close(g, w)
            else:
                assert torch.equal(g, w)
        for g, w in zip(_views(bufs), want_views):  # the op's outputs reached the storage, exactly
            assert torch.equal(g, w)
        assert_same(bufs.outputs, reference(cfg, step, 56).outputs.as_dict(), f"{backend}, call {k}")


def _replay_inputs(rng, cfg, base, k):
    """New contents in the base case's shapes: a new batch (same num_reqs), fewer computed tokens,
    new block ids; the third replay with bad values (shapes kept)."""
    nct = base["num_computed_tokens"]
    state = dict(base, num_computed_tokens=rng.integers(0, nct.astype(np.int64) + 1).astype(np.int32))
    tables = []
    for t, nb in zip(base["block_tables"], base["num_blocks"]):
        new = rng.integers(0, 1 << 20, t.shape).astype(np.int32)
        new[np.arange(t.shape[1])[None, :] >= nb[:, None]] = -1
        tables.append(new)
    state["block_tables"] = tables
    step = new_batch(rng, cfg, state, num_reqs=base["idx_mapping"].shape[0])
    return corrupt(rng, cfg, step, rate=0.2) if k == 2 else step


def test_inside_torch_cuda_graph_with_contents_changed_between_replays():
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(9)
    cfg, base = random_case(rng, max_num_reqs=80, num_reqs=60, block_sizes=(16, 64))
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    args = tensors(base)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        vllm_step(*args, bufs, num_reqs_padded=64)  # warm-up: compile the kernel, build the planner, its memo
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = vllm_step(*args, bufs, num_reqs_padded=64)
    for k in range(4):
        step = _replay_inputs(rng, cfg, base, k)
        copy_inputs(args, step)
        g.replay()
        torch.cuda.synchronize()
        ref = reference(cfg, step, 64)
        assert_same(out, ref.outputs.as_dict(), f"replay {k}")
        assert bufs.errors() == (ref.error_mask, ref.error_key), f"replay {k}"
        assert (ref.error_mask != 0) == (k == 2)


def test_compiled_with_inductor_inside_a_cuda_graph():
    """torch.compile(fullgraph=True, backend="inductor") (which updates out in place), then the compiled
    function captured in torch.cuda.graph and replayed on new contents."""
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(21)
    cfg, base = random_case(rng, max_num_reqs=48, num_reqs=40, block_sizes=(16, 32))
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    idx, qsl, nct, tables, nb = args = tensors(base)

    def prepare(idx, qsl, nct, t0, t1, nb):
        out = vllm_step(idx, qsl, nct, [t0, t1], nb, bufs, num_reqs_padded=44)
        return out.slot_mappings * 1, out.positions + 0, out.input_block_tables[1] + 0, out.seq_lens + 0

    torch._dynamo.reset()
    compiled = torch.compile(prepare, fullgraph=True, backend="inductor")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            compiled(idx, qsl, nct, *tables, nb)  # compile, build the planner, its memo
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = compiled(idx, qsl, nct, *tables, nb)
    for k in range(3):
        step = _replay_inputs(rng, cfg, base, k)
        copy_inputs(args, step)
        g.replay()
        torch.cuda.synchronize()
        ref = reference(cfg, step, 44)
        r = ref.outputs
        np.testing.assert_array_equal(outs[0].cpu().numpy(), r.slot_mappings, f"replay {k}")
        np.testing.assert_array_equal(outs[1].cpu().numpy(), r.positions, f"replay {k}")
        np.testing.assert_array_equal(outs[2].cpu().numpy(), r.input_block_tables[1], f"replay {k}")
        np.testing.assert_array_equal(outs[3].cpu().numpy(), r.seq_lens, f"replay {k}")
        assert bufs.errors() == (ref.error_mask, ref.error_key)


def test_runs_on_the_current_non_default_torch_stream():
    import torch

    from kvaddr.torch import VllmStepBuffers, vllm_step

    rng = np.random.default_rng(4)
    cfg, inputs = random_case(rng, max_num_reqs=200, num_reqs=180, block_sizes=(16,))
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        args = tensors(inputs)
        torch.cuda._sleep(50_000_000)  # keep the stream busy: a launch elsewhere would finish first
        vllm_step(*args, bufs)
        got = [x.clone() for x in _views(bufs)[:3]]  # on s: ordered after the step
    s.synchronize()
    ref = reference(cfg, inputs).outputs
    np.testing.assert_array_equal(got[0].cpu().numpy(), ref.positions)
    np.testing.assert_array_equal(got[1].cpu().numpy(), ref.seq_lens)
    np.testing.assert_array_equal(got[2].cpu().numpy(), ref.slot_mappings)


def test_tensors_on_the_wrong_device_and_bad_shapes_are_refused():
    import torch

    from kvaddr.torch import VllmStepBuffers

    cfg, inputs = worked_example()
    bufs = VllmStepBuffers(config=cfg, device="cuda")
    idx, qsl, nct, tables, nb = tensors(inputs)
    with pytest.raises((ValueError, TypeError), match="num_computed_tokens must be"):
        torch.ops.kvaddr.vllm_step_into(idx, qsl, nct.cpu(), tables, nb, 2, bufs.storage, bufs.layout)
    with pytest.raises(ValueError, match="num_reqs_padded must be an int in"):
        torch.ops.kvaddr.vllm_step_into(idx, qsl, nct, tables, nb, 9, bufs.storage, bufs.layout)
    with pytest.raises(ValueError, match="out must be the VllmStepBuffers.storage of this layout"):
        torch.ops.kvaddr.vllm_step_into(idx, qsl, nct, tables, nb, 2, bufs.storage[:-1], bufs.layout)
    torch.ops.kvaddr.vllm_step_into(idx, qsl, nct, tables, nb, 2, bufs.storage, bufs.layout)  # still works
    torch.cuda.synchronize()
    assert_same(bufs.outputs, reference(cfg, inputs).outputs.as_dict(), "after refused calls")


def test_readme_snippet():
    import torch

    import kvaddr.torch

    _, inputs = worked_example()
    idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks = tensors(inputs)
    # README: the vLLM step as a torch op
    bufs = kvaddr.torch.VllmStepBuffers(
        max_num_reqs=4, max_num_batched_tokens=6, block_sizes=[4], widths=[4], device="cuda"
    )
    out = kvaddr.torch.vllm_step(
        idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, bufs, num_reqs_padded=4
    )
    torch.cuda.synchronize()
    assert out.positions.tolist() == [5, 9, 10, 0, 0, 0]
    assert out.slot_mappings.tolist() == [[9, 33, 34, -1, -1, -1]]
    bufs.check()
