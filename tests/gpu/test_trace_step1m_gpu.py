"""benchmarks/trace_step1m.py's instrument (kernels.cu compiled with ``KV_TRACE``) on the GPU: the
traced kernel writes the reference's outputs (the stamps change no result), and every block
of a launch leaves its stamps in order. Skips, with the reason, without a GPU."""

from __future__ import annotations

import os
import sys

import numpy as np

from tests.support.attention_cases import ALL_GROUPS, make_case
from tests.support.gpu import assert_attention_equal, requires_gpu, to_device

pytestmark = requires_gpu

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def test_traced_kernel_is_exact_and_stamps_in_order():
    import cupy

    from kvaddr import StepPlanner
    from kvaddr.reference import step_addressing

    sys.path.insert(0, BENCHMARKS)
    try:
        import trace_step1m
    finally:
        sys.path.remove(BENCHMARKS)
    mod = trace_step1m.traced_module()
    trace = cupy.ndarray((256, 16), dtype=cupy.uint64, memptr=mod.get_global("kv_trace"))
    rng = np.random.default_rng(61)
    for bsz, sizes in ((1, [16]), (64, [64, 5]), (200, [16])):
        case = make_case(rng, bsz=bsz, block_sizes=sizes, spare_capacity=2)
        p = StepPlanner(
            bsz, case["capacity"], sizes, attention=ALL_GROUPS, kv_indices_capacity=case["kv_indices_capacity"]
        )
        dev = to_device(case)
        out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        name, grid, threads = p.kernel_for(bsz)
        for a in out.attention.kv_indices, out.attention.kv_indptr:
            a.fill(0x5A5A5A5A)
        trace.fill(0)
        launch = trace_step1m.kernel_loader.Launcher(mod.get_function(name).kernel, p._params, by_value=True)
        launch(grid, threads, cupy.cuda.get_current_stream().ptr)
        cupy.cuda.get_current_stream().synchronize()
        ref = step_addressing(
            case["seq_lens_decoder"],
            case["seq_lens_this_time"],
            case["block_tables"],
            sizes,
            case["capacity"],
            attention=ALL_GROUPS,
            kv_indices_capacity=case["kv_indices_capacity"],
        )
        assert_attention_equal(out.attention, ref.outputs.attention, f"traced, bsz {bsz}")
        rows = trace.get()[:grid]
        assert set(rows[:, 15].tolist()) == {1, 2}, f"bsz {bsz}: metadata and token blocks stamped"
        for r in rows[rows[:, 15] == 1]:
            clocks = r[1:12].astype(np.int64)
            assert (np.diff(clocks) >= 0).all(), f"bsz {bsz}: a metadata block's stamps out of order {clocks}"
        summary = trace_step1m.summarize([trace.get()])
        assert summary["metadata"]["cycles"] > 0 and summary["token"]["cycles"] > 0
