"""compute()'s memo of checked inputs on the GPU: the same persistent inputs every step, their
contents rewritten (outputs equal to the reference each step), and in-place changes of an input's
metadata (CuPy's shape setter, torch's resize_ / set_ / as_strided_) seen on the next call: a bad
change raises, a good one is computed from the new memory. The torch op's hot path too."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.gpu import assert_outputs_equal, requires_gpu

pytestmark = requires_gpu

SIZES, C = [16, 64], 4096


def _host(rng, bsz, rows, width):
    d = rng.integers(0, 16 * width - 8, rows).astype(np.int32)
    q = rng.choice([0, 1, 1, 2, 4], rows).astype(np.int32)
    t = rng.integers(0, 1 << 20, (rows, width)).astype(np.int32)
    return d[:bsz].copy(), q[:bsz].copy(), t


def _ref(d, q, t, sizes=SIZES):
    from kvaddr.reference import step_addressing

    return step_addressing(d, q, t, sizes, C)


@pytest.mark.parametrize("bsz", [37, 5000])  # small and large (ticketed) path
def test_persistent_cupy_inputs_rewritten_every_step(bsz):
    import cupy

    from kvaddr import StepPlanner

    capacity = 4 * bsz + 64  # every token fits (q <= 4)
    planner = StepPlanner(8192, capacity, SIZES)
    rng = np.random.default_rng(bsz)
    d, q, t = _host(rng, bsz, bsz, 32)
    dec, qq, table = cupy.asarray(d), cupy.asarray(q), cupy.asarray(t)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    for step in range(4):
        d, q, t = _host(rng, bsz, bsz, 32)
        dec.set(d), qq.set(q), table.set(t)
        cupy.cuda.runtime.deviceSynchronize()
        out = planner.compute(dec, qq, table, stream=stream)
        stream.synchronize()
        from kvaddr.reference import step_addressing

        ref = step_addressing(d, q, t, SIZES, capacity)
        assert_outputs_equal(out, ref.outputs, f"step {step}, bsz {bsz}")
        assert planner.errors(stream) == (ref.error_mask, ref.error_key)
    assert planner._memo is not None and planner._memo.same(dec, qq, table, None)  # the memo guard: these inputs


def test_cupy_shape_set_in_place_is_seen():
    import cupy

    from kvaddr import StepPlanner

    planner = StepPlanner(64, C, SIZES)
    rng = np.random.default_rng(1)
    d, q, t = _host(rng, 8, 8, 4)
    dec, qq, table = cupy.asarray(d), cupy.asarray(q), cupy.asarray(t)
    planner.compute(dec, qq, table)
    planner.compute(dec, qq, table)
    table.shape = (4, 8)  # same memory, 4 rows for bsz 8
    with pytest.raises(ValueError, match="got 4 rows for bsz = 8"):
        planner.compute(dec, qq, table)
    table.shape = (8, 4)
    out = planner.compute(dec, qq, table)
    cupy.cuda.get_current_stream().synchronize()
    assert_outputs_equal(out, _ref(d, q, t).outputs, "after the shape came back")


def test_torch_inputs_changed_in_place_are_seen():
    torch = pytest.importorskip("torch")
    import cupy

    from kvaddr import StepPlanner

    planner = StepPlanner(64, C, SIZES)
    rng = np.random.default_rng(2)
    d, q, t = _host(rng, 10, 10, 8)
    dec, qq, table = (torch.from_numpy(x).cuda() for x in (d, q, t))
    torch.cuda.synchronize()

    def run(label, d=d, q=q, t=t):
        out = planner.compute(dec, qq, table, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        assert_outputs_equal(out, _ref(d, q, t).outputs, label)

    run("first")
    run("memoised")
    d2, q2, t2 = _host(rng, 10, 10, 12)
    table.set_(torch.from_numpy(t2).cuda())  # a new pointer and width, the same object
    torch.cuda.synchronize()
    run("table set_", t=t2)
    table.resize_(6, 12)
    with pytest.raises(ValueError, match="got 6 rows for bsz = 10"):
        planner.compute(dec, qq, table)
    table.set_(torch.from_numpy(t2).cuda())
    table.as_strided_((10, 12), (1, 10))
    with pytest.raises(ValueError, match="last-dim stride of 10 elements"):
        planner.compute(dec, qq, table)
    table.set_(torch.from_numpy(t2).cuda())
    dec.set_(torch.from_numpy(d2).cuda())
    qq.set_(torch.from_numpy(q2).cuda())
    torch.cuda.synchronize()
    run("lengths set_", d=d2, q=q2, t=t2)
    dec.resize_(7)
    with pytest.raises(ValueError, match=r"seq_lens_this_time must have shape \(bsz,\) = \(7,\)"):
        planner.compute(dec, qq, table)


@pytest.mark.parametrize("which", ["step", "step_into"])
def test_torch_op_hot_path_follows_contents(which):
    torch = pytest.importorskip("torch")
    from kvaddr.torch import StepBuffers

    rng = np.random.default_rng(3)
    d, q, t = _host(rng, 50, 50, 16)
    dec, qq, table = (torch.from_numpy(x).cuda() for x in (d, q, t))
    bufs = StepBuffers(64, C, SIZES, device="cuda")
    op = torch.ops.kvaddr.step.default
    tables, args = [table], bufs.outputs_args
    for step in range(4):
        d, q, t = _host(rng, 50, 50, 16)
        dec.copy_(torch.from_numpy(d)), qq.copy_(torch.from_numpy(q)), table.copy_(torch.from_numpy(t))
        if which == "step":
            op(dec, qq, tables, SIZES, *args)
        else:
            torch.ops.kvaddr.step_into.default(dec, qq, table, bufs.storage, bufs.layout)
        torch.cuda.synchronize()
        ref = _ref(d, q, t)
        assert np.array_equal(bufs.slot_mapping.cpu().numpy(), ref.outputs.slot_mapping), f"step {step}"
        assert np.array_equal(bufs.position_ids.cpu().numpy(), ref.outputs.position_ids), f"step {step}"
        assert bufs.errors() == (ref.error_mask, ref.error_key)
