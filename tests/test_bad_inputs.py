"""docs/bad-inputs.md, row by row, on the CPU path and (with a GPU) the device path."""

import re
from pathlib import Path

import numpy as np
import pytest

from bad_input_matrix import ROWS, Row
from gpu_support import assert_outputs_equal, requires_gpu, to_device
from kvaddr._validate import ArrayInfo, check_info, describe
from kvaddr.reference import step_addressing

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"


def test_doc_and_matrix_list_the_same_rows():
    doc_ids = re.findall(r"^\| `([A-Za-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert doc_ids == [r.id for r in ROWS]


def _reference(case):
    c = dict(case)
    return step_addressing(c.pop("seq_lens_decoder"), c.pop("seq_lens_this_time"), c.pop("block_tables"),
                           c.pop("block_sizes"), c.pop("capacity"), **c)


def _cpu_strategy_steps(row: Row, case):
    from kvaddr import cpu_strategies

    outs = []
    for name in cpu_strategies.STRATEGY_NAMES:
        s = cpu_strategies.make_strategy(name, max_requests=row.max_requests or max(len(case["seq_lens_decoder"]), 1),
                                         capacity=case["capacity"], block_sizes=case["block_sizes"], num_layers=2)
        outs.append(s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"]))
    return outs


CPU_ROWS = [r for r in ROWS if "cpu" in r.where]


@pytest.mark.parametrize("row", CPU_ROWS, ids=[r.id for r in CPU_ROWS])
def test_row_on_the_cpu(row):
    case = row.make()
    if row.id == "other-device":
        info = ArrayInfo(0x1000, (3,), (1,), np.dtype(np.int32), 1, None)
        with pytest.raises(row.exc, match=row.message):
            check_info("seq_lens_decoder", info, ndim=1, device=0)
        return
    if row.kind == "host":
        if row.max_requests is not None:
            with pytest.raises(row.exc, match=row.message):
                _cpu_strategy_steps(row, case)
            return
        with pytest.raises(row.exc, match=row.message):
            _reference(case)
        with pytest.raises(row.exc, match=row.message):
            _cpu_strategy_steps(row, case)
        return
    res = _reference(case)
    assert res.error_mask == row.bits
    if row.check is not None:
        assert row.check(res.outputs)
    for out in _cpu_strategy_steps(row, case):
        for f in ("slot_mapping", "batch_id_per_token", "position_ids", "cu_seqlens_q", "seq_lens_kv"):
            np.testing.assert_array_equal(getattr(out, f), getattr(res.outputs, f))


def test_host_arrays_are_refused_by_the_device_path_checks():
    with pytest.raises(TypeError, match=ROWS[[r.id for r in ROWS].index("host-array-on-gpu-path")].message):
        describe("seq_lens_decoder", np.zeros(3, np.int32))


GPU_ROWS = [r for r in ROWS if "gpu" in r.where]


@requires_gpu
@pytest.mark.parametrize("row", GPU_ROWS, ids=[r.id for r in GPU_ROWS])
def test_row_on_the_gpu(row):
    import cupy

    from kvaddr import AddressingError, StepPlanner
    from kvaddr.strategies import make_strategy

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
    ref = _reference(case)
    dev = to_device(case)
    for name in ("fused", "per-layer-kernel", "hoisted", "per-layer"):
        s = make_strategy(name, max_requests=max(bsz, 1), capacity=case["capacity"],
                          block_sizes=case["block_sizes"], num_layers=2)
        out = s.step(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        assert_outputs_equal(out, ref.outputs, f"{row.id}/{name}")
    p = StepPlanner(max(bsz, 1), case["capacity"], case["block_sizes"])
    p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    assert p.errors() == (ref.error_mask, ref.error_key)
    if row.bits:
        with pytest.raises(AddressingError):
            p.check()
    else:
        p.check()
