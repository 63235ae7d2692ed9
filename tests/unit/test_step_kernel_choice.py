"""StepPlanner's choice of fused-step kernel (docs/perf-notes.md, v8 and v9), on the CPU
with a fake CuPy: which kernel, grid and block compute() launches for each batch, the
use_kernel switch, and the error-record sizing that lets the two kernels alternate."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import kernel_loader
from tests.unit.test_planner_attention import _dev, fake_planner  # noqa: F401 (a fixture)


@pytest.fixture
def planner_cls(fake_planner, monkeypatch):  # noqa: F811
    StepPlanner, _, _ = fake_planner
    launches = []

    class RecordingLauncher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args

        def __call__(self, grid, block, stream):
            launches.append((self.fn, grid, block, self.args.bsz))

    monkeypatch.setattr(kernel_loader, "Launcher", RecordingLauncher)
    # The geometry tests below reach the kernel's own limit (KV_SB_THREADS = 1024 requests);
    # the shipped default cut-off is lower (test_default_cut_off_is_the_measured_one).
    monkeypatch.setattr(StepPlanner, "one_block_max_requests", 1024)
    return StepPlanner, launches


def test_default_cut_off_is_the_measured_one(fake_planner):  # noqa: F811
    StepPlanner, _, _ = fake_planner
    assert StepPlanner.one_block_max_requests == 256  # v9 loses to v8 at 1024 on the H200 (perf-notes)
    p = StepPlanner(2000, 2000, [16])
    assert p.kernel_for(256)[0] == "kvaddr_step1_c1_i64" and p.kernel_for(257)[0] == "kvaddr_step_i64"


def _compute(p, bsz, caches):
    d = _dev(np.zeros(bsz, np.int32))
    q = _dev(np.ones(bsz, np.int32))
    t = [_dev(np.zeros((max(bsz, 1), 4), np.int32)) for _ in range(caches)]
    p.compute(d, q, t if caches else None)


@pytest.mark.parametrize("caches", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_small_batches_run_one_block_of_the_cache_count_kernel(planner_cls, caches, dtype):
    StepPlanner, launches = planner_cls
    suffix = "i64" if dtype == np.int64 else "i32"
    p = StepPlanner(5000, 2048, [16] * caches, position_dtype=dtype)
    assert p.step_kernel == "v9"
    for bsz, grid, threads in ((0, 8, 256), (1, 8, 256), (64, 8, 256), (300, 7, 320), (1024, 2, 1024)):
        _compute(p, bsz, caches)
        want = (f"kvaddr_step1_c{caches}_{suffix}", grid, threads)
        assert launches[-1][:3] == want == p.kernel_for(bsz), bsz
    _compute(p, 1025, caches)
    assert launches[-1][:3] == (f"kvaddr_step_{suffix}", p.grid(1025), 256) == p.kernel_for(1025)


def test_threads_cover_the_batch_and_the_capacity_in_warps(planner_cls):
    StepPlanner, launches = planner_cls
    cases = [(1, 1, 1, 32), (33, 1, 1, 64), (64, 64, 1, 64), (8, 100, 1, 128), (1000, 1000, 1, 1024)]
    cases += [(4096, 3, 16, 256), (257, 3, 2, 256), (16384, 256, 64, 256), (5000, 700, 8, 704)]
    for cap, bsz, grid, threads in cases:
        p = StepPlanner(1024, cap, [16])
        _compute(p, bsz, 1)
        assert launches[-1][1:3] == (grid, threads), (cap, bsz)
    p = StepPlanner(1024, 4096, [16])
    p.one_block_min_threads = 1024  # wider blocks: a single one up to C = 1024
    _compute(p, 3, 1)
    assert launches[-1][1:3] == (4, 1024)


def test_v8_large_capacity_and_attention_take_the_multi_block_kernel(planner_cls):
    StepPlanner, launches = planner_cls
    p = StepPlanner(64, 64, [16, 16])
    p.use_kernel("v8")
    _compute(p, 64, 2)
    assert launches[-1][:3] == ("kvaddr_step_i64", 1, 256)
    p.use_kernel("v9")
    _compute(p, 64, 2)
    assert launches[-1][:3] == ("kvaddr_step1_c2_i64", 1, 64)
    p.use_kernel("v9-old")  # v9 as first shipped, same geometry (one comparison run)
    _compute(p, 64, 2)
    assert launches[-1][:3] == ("kvaddr_step1old_c2_i64", 1, 64)
    assert p.kernel_for(64) == ("kvaddr_step1old_c2_i64", 1, 64) and p.kernel_for(65)[0] == "kvaddr_step_i64"
    p.use_kernel("v9")
    assert p.kernel_for(64)[0] == "kvaddr_step1_c2_i64"
    with pytest.raises(ValueError, match="version must be 'v8', 'v9' or 'v9-old'"):
        p.use_kernel("v7")
    big = StepPlanner(64, 4097, [16])
    _compute(big, 64, 1)
    assert launches[-1][:3] == ("kvaddr_step1_c1_i64", 17, 256)
    big.use_kernel("v9", max_capacity=4096)  # capacity above the limit: the multi-block kernel
    _compute(big, 64, 1)
    assert launches[-1][0] == "kvaddr_step_i64"
    on = StepPlanner(64, 64, [16], attention="varlen")
    assert on.kernel_for(64)[0] == "kvaddr_step_i64"


@pytest.mark.parametrize("max_requests", [1, 64, 4096, 4097, 20000])
@pytest.mark.parametrize("capacity", [1, 256, 257, 768, 769, 5000])
def test_records_cover_every_warp_of_the_single_block(planner_cls, max_requests, capacity):
    """The single block writes records [0, 32) and clears the rest; kvaddr_step_* writes or
    clears records [0, (num_chunks + max_tiles) * 8): both ranges are the whole buffer."""
    StepPlanner, _ = planner_cls
    consts = kernel_loader.constants()
    p = StepPlanner(max_requests, capacity, [16])
    n_rec = (p._num_chunks + p._params.max_tiles) * consts["KV_WARPS"]
    assert n_rec >= consts["KV_SB_WARPS"] and p._records.size == 2 * n_rec
    for min_threads in (32, 256, 1024):
        p.one_block_min_threads = min_threads
        for bsz in {0, 1, 31, 33, 255, 257, 1000, 1024} & set(range(min(max_requests, 1024) + 1)):
            _, grid, threads = p.kernel_for(bsz)
            assert grid * threads // 32 <= n_rec, (bsz, grid, threads)
    tiles = -(-max_requests // consts["KV_TILE"]) if max_requests > consts["KV_TILE"] else 0
    assert p._params.max_tiles >= tiles and p._tile_status.size >= max(tiles, 1)


def test_the_single_block_batch_limit_is_a_planner_knob(planner_cls):
    StepPlanner, launches = planner_cls
    p = StepPlanner(2000, 1024, [16])
    assert p.kernel_for(1024)[0] == "kvaddr_step1_c1_i64" and p.kernel_for(1025)[0] == "kvaddr_step_i64"
    p.use_kernel("v9", max_requests=256)
    assert p.kernel_for(256) == ("kvaddr_step1_c1_i64", 4, 256) and p.kernel_for(257)[0] == "kvaddr_step_i64"
    _compute(p, 300, 1)
    assert launches[-1][0] == "kvaddr_step_i64"
    with pytest.raises(ValueError, match="max_requests"):
        p.use_kernel("v9", max_requests=1025)
