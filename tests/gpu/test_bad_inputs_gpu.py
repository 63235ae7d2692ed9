"""docs/bad-inputs.md, row by row, on the device path (skipped without a GPU)."""

import numpy as np
import pytest

from tests.support.bad_input_matrix import ROWS, reference_for
from tests.support.gpu import (
    assert_attention_equal,
    assert_outputs_equal,
    kernel_choice_fixture,
    requires_gpu,
    to_device,
)

GPU_ROWS = [r for r in ROWS if "gpu" in r.where]

# every row with the dispatch table's kernels, then with every batch on the multi-block kernel
kernel_choice = kernel_choice_fixture()


@requires_gpu
@pytest.mark.parametrize("row", GPU_ROWS, ids=[r.id for r in GPU_ROWS])
def test_row_on_the_gpu(row):
    import cupy

    from kvaddr import AddressingError, StepPlanner
    from kvaddr.errors import NO_ERROR_KEY
    from kvaddr.strategies.gpu import make_strategy

    case = row.make()
    bsz = case["seq_lens_decoder"].shape[0] if case["seq_lens_decoder"].ndim == 1 else 3
    if row.id == "other-device":
        if cupy.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("needs two GPUs (the check itself is tested on the CPU)")
        p = StepPlanner(3, 8, [4], device=0)
        with cupy.cuda.Device(1):
            dev = to_device(case)
        with pytest.raises(row.exc, match=row.message):
            p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        return
    if row.kind == "host":
        if row.id in ("block-size-zero", "block-size-negative", "capacity-zero"):
            with pytest.raises(row.exc, match=row.message):
                StepPlanner(3, case["capacity"], case["block_sizes"])
            return
        dev = case if row.id == "host-array-on-gpu-path" else to_device(case)
        if row.id == "transposed-table":  # keep it a transposed view on the device too
            dev["block_tables"] = cupy.asarray(np.ascontiguousarray(case["block_tables"].T)).T
        p = StepPlanner(row.max_requests or 3, case["capacity"], case["block_sizes"])
        with pytest.raises(row.exc, match=row.message):
            p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        return
    ref = reference_for(case)
    dev = to_device(case)
    # a row may ask for attention outputs (kv-indices-capacity): every strategy gets them
    extra = {k: case[k] for k in ("attention", "kv_indices_capacity") if k in case}
    for name in ("fused", "per-layer-kernel", "hoisted", "per-layer", "one-block"):
        if name == "one-block" and bsz > 1024:
            continue  # one block of one thread per request (tests/gpu/test_gpu_strategies.py checks the limit)
        s = make_strategy(
            name,
            max_requests=max(bsz, 1),
            capacity=case["capacity"],
            block_sizes=case["block_sizes"],
            num_layers=2,
            **extra,
        )
        out = s.step(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        assert_outputs_equal(out, ref.outputs, f"{row.id}/{name}")
        assert (out.attention is None) == (ref.outputs.attention is None), f"{row.id}/{name}: attention"
    p = StepPlanner(max(bsz, 1), case["capacity"], case["block_sizes"], **extra)
    out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    assert p.errors() == (ref.error_mask, ref.error_key)
    if ref.outputs.attention is not None:  # the fused step's metadata is the reference's, bad values included
        assert_attention_equal(out.attention, ref.outputs.attention, row.id)
    if row.check is not None:
        assert row.check(out), f"{row.id}: the row's check on the planner's outputs"
    assert p.errors() == (0, NO_ERROR_KEY), f"{row.id}: the read cleared the (sticky) records"
    if row.bits:  # the bad step again, then a good one (every request idle): check() still sees the bad one
        good = dict(dev, seq_lens_decoder=cupy.zeros_like(dev["seq_lens_decoder"]))
        good["seq_lens_this_time"] = cupy.zeros_like(dev["seq_lens_this_time"])
        p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        p.compute(good["seq_lens_decoder"], good["seq_lens_this_time"], good["block_tables"])
        with pytest.raises(AddressingError):
            p.check()
    p.check()
