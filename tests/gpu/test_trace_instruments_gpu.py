"""The trace instruments (benchmarks/trace_step1m.py and trace_step1wm.py: kernels.cu compiled with
``KV_TRACE``, benchmarks/trace_common.py) on the GPU: the traced kernel writes the reference's
outputs (the stamps change no result), and every metadata block of a launch leaves its stamps
in order. Skips, with the reason, without a GPU."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.support.attention_cases import ALL_GROUPS, make_case
from tests.support.gpu import assert_attention_equal, requires_gpu, to_device

pytestmark = requires_gpu

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _import(name):
    sys.path.insert(0, BENCHMARKS)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCHMARKS)


# (script, batches (bsz, block sizes), kernel prefix, the kinds stamped, the kinds whose stamps are
# checked for order, every slot written (else only the written ones must be in order))
INSTRUMENTS = [
    ("trace_step1m", ((1, [16]), (64, [64, 5]), (200, [16])), "kvaddr_step1m_", {1, 2}, (1,), True),
    ("trace_step1wm", ((300, [16]), (400, [64, 5]), (1500, [16])), "kvaddr_step1wm", {1, 2, 3}, (1,), False),
]


@pytest.mark.parametrize("script, shapes, prefix, stamped, ordered, every_slot", INSTRUMENTS)
def test_traced_kernel_is_exact_and_stamps_in_order(script, shapes, prefix, stamped, ordered, every_slot):
    import cupy

    from kvaddr import StepPlanner, kernel_loader
    from kvaddr.reference import step_addressing

    instrument, common = _import(script), _import("trace_common")
    mod = common.traced_module()
    trace = cupy.ndarray((common.TRACE_BLOCKS, 16), dtype=cupy.uint64, memptr=mod.get_global("kv_trace"))
    rng = np.random.default_rng(61)
    for bsz, sizes in shapes:
        case = make_case(rng, bsz=bsz, block_sizes=sizes, spare_capacity=2)
        p = StepPlanner(
            bsz, case["capacity"], sizes, attention=ALL_GROUPS, kv_indices_capacity=case["kv_indices_capacity"]
        )
        dev = to_device(case)
        out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        name, grid, threads = p.kernel_for(bsz)
        assert name.startswith(prefix) and grid <= common.TRACE_BLOCKS, (name, grid)
        for a in out.attention.kv_indices, out.attention.kv_indptr:
            a.fill(0x5A5A5A5A)
        trace.fill(0)
        launch = kernel_loader.Launcher(mod.get_function(name).kernel, p._params, by_value=True)
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
        assert set(rows[:, 15].tolist()) == stamped, f"bsz {bsz}: every block kind stamped"
        for r in rows[np.isin(rows[:, 15], ordered)]:
            clocks = r[1:12].astype(np.int64)
            if not every_slot:
                clocks = clocks[clocks != 0]
            assert len(clocks) > 2 and (np.diff(clocks) >= 0).all(), f"bsz {bsz}: stamps out of order {clocks}"
        summary = common.summarize([trace.get()], instrument.SEGMENTS, instrument.KINDS, ordered)
        kind = instrument.KINDS[ordered[0]]
        assert summary[kind]["cycles"] > 0 and summary["token"]["cycles"] > 0
        assert all(summary[kind][n] >= 0 for _, _, n in instrument.SEGMENTS if n in summary[kind])
