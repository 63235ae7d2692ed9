"""The vLLM step's host checks and bad-input matrix on the CPU path (the reference);
tests/gpu/test_vllm_step.py runs the same rows on the device."""

import re
from pathlib import Path

import numpy as np
import pytest

from kvaddr.engines.vllm_config import INT32, VllmStepConfig, check_matrix, check_vector
from kvaddr.engines.vllm_errors import VLLM_ERROR_REASONS, VllmAddressingError, decode_vllm_error_key, vllm_error_key
from kvaddr.engines.vllm_reference import vllm_step_reference
from kvaddr.validation import ArrayInfo
from tests.support.vllm_bad_input_matrix import ROWS, Row

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs-vllm.md"


def test_doc_and_matrix_list_the_same_rows():
    doc_ids = re.findall(r"^\| `([A-Za-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert doc_ids == [r.id for r in ROWS]


CPU_ROWS = [r for r in ROWS if "cpu" in r.where]


@pytest.mark.parametrize("row", CPU_ROWS, ids=[r.id for r in CPU_ROWS])
def test_row_on_the_cpu(row: Row):
    cfg_kw, inp = row.make()
    if row.kind == "config":
        with pytest.raises(row.exc, match=row.message):
            VllmStepConfig(**cfg_kw)
        return
    cfg = VllmStepConfig(**cfg_kw)
    if row.kind == "host":
        with pytest.raises(row.exc, match=row.message):
            vllm_step_reference(cfg, **inp, num_reqs_padded=row.num_reqs_padded)
        return
    res = vllm_step_reference(cfg, **inp, num_reqs_padded=row.num_reqs_padded)
    assert res.error_mask == row.bits
    if row.key is not None:
        assert decode_vllm_error_key(res.error_key) == (*row.key, row.bits)
        with pytest.raises(VllmAddressingError, match=re.escape(VLLM_ERROR_REASONS[row.bits])):
            res.check()
    if row.check is not None:
        assert row.check(res.outputs)


def test_error_key_round_trips():
    for bit in VLLM_ERROR_REASONS:
        key = vllm_error_key(123456, (1 << 24) - 1, 3, bit)
        assert decode_vllm_error_key(key) == (123456, (1 << 24) - 1, 3, bit)
    assert vllm_error_key(0, 5, 0, 256) < vllm_error_key(1, 0, 0, 1)  # token first


def test_addressing_error_message_names_request_token_and_group():
    err = VllmAddressingError(1 | 32, vllm_error_key(7, 3, 2, 1))
    assert "token 7 of request 3, group 2" in str(err) and "error bits 33" in str(err)
    assert (err.token, err.request, err.group, err.bit) == (7, 3, 2, 1)


def _info(shape, strides=None, dtype=np.int32, device=0):
    if strides is None:
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
    return ArrayInfo(0x1000, tuple(shape), tuple(strides), np.dtype(dtype), device, None)


def test_device_checks_name_the_argument():
    with pytest.raises(ValueError, match=r"idx_mapping must be on CUDA device 0, got an array in device 1"):
        check_vector("idx_mapping", _info((3,), device=1), shape_text="(num_reqs,)", device=0)
    with pytest.raises(ValueError, match=r"query_start_loc must be contiguous, got a strided view \(stride 2"):
        check_vector("query_start_loc", _info((3,), (2,)), shape_text="(num_reqs + 1,)", device=0)
    with pytest.raises(ValueError, match=r"block_tables must not have overlapping rows, got row stride 2"):
        check_matrix("block_tables", _info((4, 4), (2, 1)), min_rows=4, cols=4, shape_text="(rows, 4)", device=0)
    check_matrix("block_tables", _info((4, 4), (9, 1)), min_rows=4, cols=4, shape_text="(rows, 4)", device=0)
    check_vector("seq_lens", _info((0,), device=-2), dtypes=(INT32,), length=0, shape_text="(0,)", device=0)


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        (dict(max_num_reqs=0), ValueError, r"max_num_reqs must be an int in \[1, 16777215\], got 0"),
        (dict(max_num_reqs=1 << 24), ValueError, r"max_num_reqs must be an int in \[1, 16777215\]"),
        (dict(max_num_batched_tokens=0), ValueError, r"max_num_batched_tokens must be an int in \[1, 2147483646\]"),
        (dict(block_sizes=[]), ValueError, r"block_sizes must name 1 to 4 groups, got 0"),
        (dict(block_sizes=[0]), ValueError, r"block_sizes\[0\] must be an int in \[1, 2147483647\], got 0"),
        (dict(widths=[0]), ValueError, r"widths\[0\] must be an int in \[1, 2147483647\], got 0"),
        (dict(widths=[4, 4]), ValueError, r"widths must hold one int >= 1 per group \(1\)"),
        (dict(slot_mapping_enabled=[1]), TypeError, r"slot_mapping_enabled\[0\] must be a bool, got 1"),
        (dict(dcp_sharded=[True, True]), ValueError, r"dcp_sharded must hold one value per group \(1\), got 2"),
        (dict(cp_size=0), ValueError, r"cp_size must be an int in \[1, 65536\], got 0"),
        (dict(cp_interleave=0), ValueError, r"cp_interleave must be an int in \[1, 2147483647\], got 0"),
        (
            dict(block_sizes=[2**30], cp_size=4),
            ValueError,
            r"block_sizes\[0\] \* cp_size must be < 2\*\*31, got 1073741824 \* 4",
        ),
    ],
)
def test_config_checks(kw, exc, message):
    base = dict(max_num_reqs=4, max_num_batched_tokens=8, block_sizes=[16], widths=[4])
    base.update(kw)
    with pytest.raises(exc, match=message):
        VllmStepConfig(**base)


def test_config_defaults_and_broadcasts():
    c = VllmStepConfig(4, 8, [16, 32], 4, dcp_sharded=False, cp_size=2, cp_interleave=16)
    assert c.widths == (4, 4) and c.slot_mapping_enabled == (True, True) and c.dcp_sharded == (False, False)
    assert not c.sharded(0) and c.sliding_window_reach == (0, 0) and c.slot_dtype == np.int64


def test_reference_rejects_non_numpy_inputs():
    cfg = VllmStepConfig(4, 6, [4], [4])
    with pytest.raises(TypeError, match=r"idx_mapping must be a numpy.ndarray, got builtins.list"):
        vllm_step_reference(cfg, [2, 0], np.array([0, 1, 3], np.int32), np.zeros(4, np.int32), [], [])
