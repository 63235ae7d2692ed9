"""``VllmStepPlanner(error_records=...)``: caller-owned error records (the torch op packs them into
its one storage tensor). On the CPU with the minimal fake CuPy (tests/support/vllm_fake_cupy.py) and,
for the values, the vLLM kernel emulated in C++ (tests/support/vllm_emulator.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_errors import VLLM_NO_ERROR_KEY
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_emulator
from tests.support.vllm_cases import corrupt, planner_kwargs, random_case, worked_example
from tests.support.vllm_fake_cupy import FakeArray, install, on_fake

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
POISON = 0x5A5A5A5A5A5A5A5A


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def emu(monkeypatch):
    if vllm_emulator.CXX is None:
        pytest.skip("no C++ compiler: the vLLM kernel emulator cannot be built")
    return install(monkeypatch, on_launch=vllm_emulator.run)


def _planner(**over):
    from kvaddr.engines.vllm import VllmStepPlanner

    kw = dict(max_num_reqs=4, max_num_batched_tokens=600, block_sizes=[4], widths=[4])
    kw.update(over)
    return VllmStepPlanner(**kw)


def _records(shape, dtype=np.int64, dev=0):
    return FakeArray(
        np.full(shape, POISON, dtype=np.uint64).view(dtype)
        if np.dtype(dtype).itemsize == 8
        else np.full(shape, 7, dtype=dtype),
        dev,
    )


@pytest.mark.parametrize(
    ("M", "T", "R"),
    [(4, 6, 16), (4, 600, 32), (257, 256, 24), (256, 8192, 264), (1, 1, 16)],
)
def test_error_records_shape_is_one_pair_per_warp_of_the_steps_blocks(fake, M, T, R):
    from kvaddr.engines.vllm import VllmStepPlanner

    assert VllmStepPlanner.error_records_shape(M, T) == (R, 2)
    # the planner's own records have that shape
    pl = _planner(max_num_reqs=M, max_num_batched_tokens=T)
    assert pl._records.shape == (R, 2) and pl._records.dtype == np.uint64


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_caller_records_are_initialised_launched_into_and_read_back(fake, dtype):
    from kvaddr.engines.vllm import VllmStepPlanner

    shape = VllmStepPlanner.error_records_shape(4, 600)
    rec = _records(shape, dtype)
    pl = _planner(error_records=rec)
    # every record cleared to (0, no error) in the caller's memory, at construction
    u = rec.a.view(np.uint64)
    assert (u[:, 0] == 0).all() and (u[:, 1] == VLLM_NO_ERROR_KEY).all()
    assert pl.errors() == (0, VLLM_NO_ERROR_KEY)
    # the launch's parameter points at the caller's array
    _, x = worked_example(max_num_batched_tokens=600)
    pl.compute(*(on_fake(x)[k] for k in NAMES), num_reqs_padded=3, stream=77)
    assert fake.launches[-1]["params"]["errors"] == rec.a.ctypes.data
    # errors() / check() read the caller's memory, then clear it (sticky records)
    u[5, 0] = 4
    u[5, 1] = 123
    u[9, 0] = 1
    u[9, 1] = 77
    assert pl.errors() == (5, 77)
    assert (u[:, 0] == 0).all() and (u[:, 1] == VLLM_NO_ERROR_KEY).all()
    assert pl.errors() == (0, VLLM_NO_ERROR_KEY)
    from kvaddr.engines.vllm_errors import VllmAddressingError

    u[2] = (8, 9)
    with pytest.raises(VllmAddressingError):
        pl.check()
    pl.check()  # cleared by the first check()
    u[3] = (8, 9)
    pl.clear_errors(stream=77)
    assert pl.errors() == (0, VLLM_NO_ERROR_KEY)


def test_caller_records_hold_the_emulated_kernels_records_like_the_reference(emu):
    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(5)
    cfg, x = random_case(rng, max_num_reqs=20, num_reqs=14, block_sizes=(16, 8), max_query=5)
    kw = planner_kwargs(cfg)
    rec = _records(VllmStepPlanner.error_records_shape(kw["max_num_reqs"], kw["max_num_batched_tokens"]))
    pl = VllmStepPlanner(**kw, error_records=rec)
    own = VllmStepPlanner(**kw)
    bad = corrupt(rng, cfg, x, rate=0.2)
    want = vllm_step_reference(cfg, **{k: bad[k] for k in NAMES})
    assert want.error_mask
    for p in (pl, own):
        p.compute(*(on_fake(bad)[k] for k in NAMES))
        assert p.errors() == (want.error_mask, want.error_key)
        # read and cleared: word for word the records the planner keeps itself
        assert (p._records.a[:, 0] == 0).all() and (p._records.a[:, 1] == VLLM_NO_ERROR_KEY).all()
    # sticky: a bad step, then a good one (which writes no record), then the read: the bad step's
    for p in (pl, own):
        p.compute(*(on_fake(bad)[k] for k in NAMES))
        p.compute(*(on_fake(x)[k] for k in NAMES))
    assert (rec.a.view(np.uint64) == own._records.a).all()
    assert pl.errors() == own.errors() == (want.error_mask, want.error_key)
    # a good step alone: clean
    pl.compute(*(on_fake(x)[k] for k in NAMES))
    assert pl.errors() == (0, VLLM_NO_ERROR_KEY)


def test_two_bad_steps_report_the_or_of_the_bits_and_the_smaller_key(emu):
    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(11)
    cfg, x = random_case(rng, max_num_reqs=20, num_reqs=14, block_sizes=(16, 8), max_query=5)
    pl = VllmStepPlanner(**planner_kwargs(cfg))
    wants = []
    bads = []
    while len(bads) < 2:
        bad = corrupt(rng, cfg, x, rate=0.1)
        want = vllm_step_reference(cfg, **{k: bad[k] for k in NAMES})
        if want.error_mask and all(w.error_mask != want.error_mask for w in wants):
            bads.append(bad)
            wants.append(want)
    for bad in bads:
        pl.compute(*(on_fake(bad)[k] for k in NAMES))
    mask = wants[0].error_mask | wants[1].error_mask
    assert pl.errors() == (mask, min(wants[0].error_key, wants[1].error_key))
    assert pl.errors() == (0, VLLM_NO_ERROR_KEY)


def _bad_rows():
    R = 32  # error_records_shape(4, 600)
    rows = [
        ("host array", lambda: np.zeros((R, 2), np.int64), TypeError, "error_records must be a CUDA array"),
        ("int32", lambda: _records((R, 2), np.int32), TypeError, r"int64 or uint64 .* \(32, 2\), got dtype int32"),
        ("float64", lambda: _records((R, 2), np.float64), TypeError, "got dtype float64"),
        ("too few rows", lambda: _records((R - 1, 2)), ValueError, r"of shape \(32, 2\), got shape \(31, 2\)"),
        ("too many rows", lambda: _records((R + 8, 2)), ValueError, r"of shape \(32, 2\), got shape \(40, 2\)"),
        ("flat", lambda: _records((2 * R,)), ValueError, r"of shape \(32, 2\), got shape \(64,\)"),
        ("3 columns", lambda: _records((R, 3)), ValueError, r"got shape \(32, 3\)"),
        ("strided rows", lambda: _records((2 * R, 2))[::2], ValueError, r"C-contiguous .* got strides \(4, 1\)"),
        ("transposed", lambda: FakeArray(np.zeros((2, R), np.int64).T), ValueError, r"got strides \(1, 32\)"),
        ("other device", lambda: _records((R, 2), dev=1), ValueError, "error_records must be on CUDA device 0"),
        ("not an array", lambda: [[0, 0]] * R, TypeError, "error_records"),
    ]
    return [pytest.param(make, exc, msg, id=name) for name, make, exc, msg in rows]


@pytest.mark.parametrize(("make", "exc", "msg"), _bad_rows())
def test_bad_error_records_are_refused_naming_the_argument(fake, make, exc, msg):
    with pytest.raises(exc, match=msg):
        _planner(error_records=make())
    assert not fake.launches


def test_the_baseline_takes_no_records(fake):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    with pytest.raises(ValueError, match="error_records is only taken by the one-launch step.*not by VllmThreeLaunch"):
        VllmThreeLaunch(4, 600, [4], [4], error_records=_records((32, 2)))


def test_caller_records_are_left_alone_when_refused(fake):
    rec = _records((31, 2))
    with pytest.raises(ValueError):
        _planner(error_records=rec)
    assert (rec.a == np.int64(POISON)).all()
