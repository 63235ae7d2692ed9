"""Sticky error records (docs/spec.md, "Errors"): the host side. The kernels only merge into the
records (tests/unit/test_vllm_error_records.py runs the vLLM device code on the CPU, tests/gpu
the rest); the readers reduce every record (OR of the masks, smallest key) and then reset them:
``StepPlanner.errors()`` / ``check()`` / ``clear_errors()`` under the planner's fake CuPy, and the
helpers of kvaddr.errors for caller-owned records."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.errors import (
    NO_ERROR_KEY,
    AddressingError,
    clean_error_records,
    error_key,
    reduce_error_records,
    reset_error_records,
)
from tests.support.fake_cupy import FakeDeviceArray, install_planner_fake

ONES = np.uint64(NO_ERROR_KEY)


def test_clean_records_are_mask_0_and_key_all_ones():
    rec = clean_error_records(5)
    assert rec.shape == (5, 2) and rec.dtype == np.uint64
    assert (rec[:, 0] == 0).all() and (rec[:, 1] == ONES).all()
    assert reduce_error_records(rec) == (0, NO_ERROR_KEY)
    assert clean_error_records(0).shape == (0, 2)


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
@pytest.mark.parametrize("flat", [False, True])
def test_reduce_is_the_or_of_the_masks_and_the_unsigned_min_of_the_keys(dtype, flat):
    rec = clean_error_records(6)
    rec[1] = (2, error_key(9, 1, 0, 2))
    rec[4] = (8, error_key(3, 4, 0, 8))
    rec[5] = (1, error_key(3, 4, 1, 1))  # same token and request, cache 1: a larger key
    arr = rec.view(dtype)
    if flat:
        arr = arr.reshape(-1)
    assert reduce_error_records(arr) == (11, error_key(3, 4, 0, 8))
    # int64 words are their uint64 bit patterns: all ones is no error, not -1 < every key
    assert reduce_error_records(clean_error_records(3).view(dtype)) == (0, NO_ERROR_KEY)
    assert reduce_error_records(np.zeros(0, dtype)) == (0, NO_ERROR_KEY)


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_reset_clears_in_place(dtype):
    rec = np.arange(12, dtype=np.uint64).reshape(6, 2).view(dtype)
    reset_error_records(rec)
    assert (rec.view(np.uint64) == clean_error_records(6)).all()
    flat = np.full(8, 5, dtype)
    reset_error_records(flat)
    assert (flat.view(np.uint64).reshape(4, 2) == clean_error_records(4)).all()


def test_reset_refuses_other_dtypes():
    with pytest.raises(TypeError, match="error records must be int64 or uint64, got int32"):
        reset_error_records(np.zeros((2, 2), np.int32))


# -- StepPlanner: errors() reads every launch's errors since the last read, then resets ---------


@pytest.fixture
def fake(monkeypatch):
    ns = install_planner_fake(monkeypatch)
    ns.sets = []
    real = FakeDeviceArray.set

    def counting_set(self, host, stream=None):
        ns.sets.append(getattr(stream, "ptr", stream))
        real(self, host, stream)

    monkeypatch.setattr(FakeDeviceArray, "set", counting_set)
    return ns


def _planner(**kw):
    from kvaddr.planner import StepPlanner

    return StepPlanner(8, 300, [16, 16], **kw)


def _records(p) -> np.ndarray:
    return p._records.a.reshape(-1, 2)


def test_the_planner_starts_clean_and_a_clean_read_writes_nothing(fake):
    p = _planner()
    assert (_records(p) == clean_error_records(len(_records(p)))).all()
    assert fake.launches == [] and fake.sets == []
    assert p.errors() == (0, NO_ERROR_KEY)
    p.check()
    assert fake.sets == [], "a clean read resets nothing (no extra launch)"


def test_errors_reports_the_or_and_the_min_then_resets_on_the_same_stream(fake):
    p = _planner()
    rec = _records(p)
    n = len(rec)
    # two launches' errors merged into records, as the kernels' atomics leave them
    rec[0] = (2, error_key(40, 7, 1, 2))
    rec[n - 1] = (1 | 4, error_key(12, 3, 0, 1))
    rec[5] = (8, error_key(12, 3, 0, 8))
    assert p.errors(stream=0x77) == (15, error_key(12, 3, 0, 1))
    assert fake.sets == [0x77], "reset once, on the stream read"
    assert (rec == clean_error_records(n)).all()
    assert p.errors(stream=0x77) == (0, NO_ERROR_KEY), "the second read is clean"
    assert fake.sets == [0x77]


def test_check_raises_the_first_bad_record_and_resets(fake):
    p = _planner()
    rec = _records(p)
    rec[3] = (8, error_key(5, 2, 0, 8))
    with pytest.raises(AddressingError) as exc:
        p.check()
    assert (exc.value.mask, exc.value.token, exc.value.request, exc.value.bit) == (8, 5, 2, 8)
    p.check()  # cleared by the first check
    assert len(fake.sets) == 1


def test_clear_errors_drops_unread_errors_without_reading(fake):
    p = _planner()
    rec = _records(p)
    rec[1] = (2, error_key(1, 1, 0, 2))
    p.clear_errors(stream=0x99)
    assert fake.sets == [0x99] and (rec == clean_error_records(len(rec))).all()
    p.clear_errors()  # CuPy's current stream by default
    assert fake.sets == [0x99, fake.current.ptr]


# -- the torch ops' CPU kernels merge like a device warp; their readers reset -------------------


def test_torch_step_buffers_are_sticky_and_the_workspace_helpers_read_and_reset():
    pytest.importorskip("torch")
    import torch

    import kvaddr.torch as kt
    from tests.support.gpu import reference
    from tests.support.sticky_cases import sticky_cases
    from tests.support.torch_ops import case_tensors

    cases = sticky_cases(bsz=40, num_caches=2)
    C = cases["good"]["capacity"]
    ra, rb = reference(cases["bad_a"]), reference(cases["bad_b"])
    t = {k: case_tensors(c, "cpu") for k, c in cases.items()}
    bufs = kt.StepBuffers(64, C, [16, 16], device="cpu")
    kt.step(*t["bad_a"], bufs)
    kt.step(*t["good"], bufs)
    assert bufs.errors() == (ra.error_mask, ra.error_key), "a good step keeps the bad one's record"
    assert bufs.errors() == (0, NO_ERROR_KEY), "the read reset the records"
    kt.step(*t["bad_a"], bufs)
    kt.step(*t["bad_b"], bufs)
    assert bufs.errors() == (ra.error_mask | rb.error_mask, min(ra.error_key, rb.error_key))
    kt.step(*t["bad_b"], bufs)
    bufs.clear_errors()
    assert bufs.errors() == (0, NO_ERROR_KEY)
    # the old op on caller tensors: workspace_errors reads without resetting, the helper resets
    ws = bufs.outputs_args[-1]
    dec, q, tables = t["bad_a"]
    torch.ops.kvaddr.step.default(dec, q, tables, [16, 16], *bufs.outputs_args)
    assert kt.workspace_errors(ws, C) == (ra.error_mask, ra.error_key)
    assert kt.workspace_errors(ws, C) == (ra.error_mask, ra.error_key), "reading does not reset"
    kt.reset_workspace_errors(ws, C)
    assert kt.workspace_errors(ws, C) == (0, NO_ERROR_KEY)


def test_torch_vllm_buffers_are_sticky_and_the_records_reset_with_the_helper():
    pytest.importorskip("torch")
    from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY
    from kvaddr.engines.vllm_reference import vllm_step_reference
    from kvaddr.torch import VllmStepBuffers, vllm_step
    from kvaddr.torch.vllm_ops import records_errors
    from tests.support.torch_ops import vllm_case_tensors
    from tests.support.vllm_cases import corrupt, random_case

    rng = np.random.default_rng(3)
    cfg, inputs = random_case(rng, max_num_reqs=20, num_reqs=15, block_sizes=(16, 8), max_query=4)
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    want = vllm_step_reference(cfg, **bad)
    assert want.error_mask
    bufs = VllmStepBuffers(config=cfg, device="cpu")
    vllm_step(*vllm_case_tensors(bad, "cpu"), bufs)
    vllm_step(*vllm_case_tensors(inputs, "cpu"), bufs)
    assert records_errors(bufs.records) == (want.error_mask, want.error_key)  # read, not reset
    assert bufs.errors() == (want.error_mask, want.error_key)  # read and reset
    assert records_errors(bufs.records) == (0, VLLM_NO_ERROR_KEY)
    vllm_step(*vllm_case_tensors(bad, "cpu"), bufs)
    reset_error_records(bufs.records)
    assert bufs.errors() == (0, VLLM_NO_ERROR_KEY)
