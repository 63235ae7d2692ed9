"""docs/bad-inputs.md, row by row, on the CPU path (tests/gpu/test_bad_inputs_gpu.py: the device path)."""

import re
from pathlib import Path

import numpy as np
import pytest

from kvaddr.validation import ArrayInfo, check_info, describe
from tests.support.bad_input_matrix import ROWS, Row, reference_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"


def test_doc_and_matrix_list_the_same_rows():
    doc_ids = re.findall(r"^\| `([A-Za-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert doc_ids == [r.id for r in ROWS]


def _cpu_strategy_steps(row: Row, case):
    from kvaddr.strategies import cpu as cpu_strategies

    outs = []
    for name in cpu_strategies.STRATEGY_NAMES:
        s = cpu_strategies.make_strategy(
            name,
            max_requests=row.max_requests or max(len(case["seq_lens_decoder"]), 1),
            capacity=case["capacity"],
            block_sizes=case["block_sizes"],
            num_layers=2,
        )
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
            reference_for(case)
        with pytest.raises(row.exc, match=row.message):
            _cpu_strategy_steps(row, case)
        return
    res = reference_for(case)
    assert res.error_mask == row.bits
    if row.check is not None:
        assert row.check(res.outputs)
    for out in _cpu_strategy_steps(row, case):
        for f in ("slot_mapping", "batch_id_per_token", "position_ids", "cu_seqlens_q", "seq_lens_kv"):
            np.testing.assert_array_equal(getattr(out, f), getattr(res.outputs, f))


def test_host_arrays_are_refused_by_the_device_path_checks():
    with pytest.raises(TypeError, match=ROWS[[r.id for r in ROWS].index("host-array-on-gpu-path")].message):
        describe("seq_lens_decoder", np.zeros(3, np.int32))
