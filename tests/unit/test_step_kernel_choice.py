"""StepPlanner's choice of fused-step kernel (docs/perf-notes.md, v8, v9 and v9 across blocks),
on the CPU with a fake CuPy: which kernel, grid and block compute() launches for each batch,
the use_kernel switch, and the error-record sizing that lets the kernels alternate."""

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
    # ... and without v9 across blocks (its own tests below turn it back on)
    monkeypatch.setattr(StepPlanner, "wide_max_requests", 0)
    return StepPlanner, launches


def test_default_cut_off_is_the_measured_one(fake_planner):  # noqa: F811
    StepPlanner, _, _ = fake_planner
    assert StepPlanner.one_block_max_requests == 256  # v9 loses to v8 at 1024 on the H200 (perf-notes)
    assert StepPlanner.wide_max_requests == 4096 and StepPlanner.wide_threads == 128
    p = StepPlanner(5000, 5000, [16])
    assert p.kernel_for(256)[0] == "kvaddr_step1_c1_i64" and p.kernel_for(257)[0] == "kvaddr_step1w4_c1_i64"
    assert p.kernel_for(4096)[0] == "kvaddr_step1w16_c1_i64" and p.kernel_for(4097)[0] == "kvaddr_step_i64"


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


# -- v9 across blocks (kvaddr_step1w{R}_c{G}_*) ---------------------------------------------


@pytest.fixture
def wide_cls(fake_planner, monkeypatch):  # noqa: F811
    StepPlanner, _, _ = fake_planner
    launches = []

    class RecordingLauncher:
        def __init__(self, fn, args, by_value=False):
            self.fn, self.args = fn, args

        def __call__(self, grid, block, stream):
            launches.append((self.fn, grid, block, self.args.bsz))

    monkeypatch.setattr(kernel_loader, "Launcher", RecordingLauncher)
    return StepPlanner, launches


@pytest.mark.parametrize("caches", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_wide_batches_run_the_wide_kernel_of_their_cache_count(wide_cls, caches, dtype):
    StepPlanner, launches = wide_cls
    suffix = "i64" if dtype == np.int64 else "i32"
    p = StepPlanner(5000, 4096, [16] * caches, position_dtype=dtype)
    # (bsz, R, blocks, threads): R = the smallest of 4, 8, 16 with R x 128 >= bsz; T = bsz / R in warps
    cases = ((256, None, 16, 256), (257, 4, 43, 96), (300, 4, 43, 96), (512, 4, 32, 128), (513, 8, 43, 96))
    cases += ((1024, 8, 32, 128), (1025, 16, 43, 96), (2048, 16, 32, 128), (2049, 16, 26, 160))
    cases += ((4095, 16, 16, 256), (4096, 16, 16, 256))
    for bsz, r, grid, threads in cases:
        _compute(p, bsz, caches)
        kind = f"step1w{r}" if r else "step1"
        want = (f"kvaddr_{kind}_c{caches}_{suffix}", grid, threads)
        assert launches[-1][:3] == want == p.kernel_for(bsz), bsz
        assert launches[-1][3] == bsz
    _compute(p, 4097, caches)
    assert launches[-1][:3] == (f"kvaddr_step_{suffix}", p.grid(4097), 256) == p.kernel_for(4097)


def test_wide_decode_batches_whose_capacity_is_the_batch(wide_cls):
    """The rows of benchmarks/floor_step.py: decode 1024 and 4096 with C = bsz."""
    StepPlanner, _ = wide_cls
    assert StepPlanner(1024, 1024, [16]).kernel_for(1024) == ("kvaddr_step1w8_c1_i64", 8, 128)
    assert StepPlanner(4096, 4096, [16, 16]).kernel_for(4096) == ("kvaddr_step1w16_c2_i64", 16, 256)
    assert StepPlanner(512, 512, [16]).kernel_for(512) == ("kvaddr_step1w4_c1_i64", 4, 128)


def test_wide_knobs(wide_cls):
    StepPlanner, launches = wide_cls
    p = StepPlanner(4096, 4096, [16])
    for r, threads in ((4, 256), (8, 128), (16, 64)):
        p.use_kernel("v9", wide_per_thread=r)
        assert p.kernel_for(1024) == (f"kvaddr_step1w{r}_c1_i64", 4096 // threads, threads), r
        _compute(p, 1024, 1)
        assert launches[-1][:3] == p.kernel_for(1024)
    p.use_kernel("v9", wide_per_thread=4)
    assert p.kernel_for(4096) == ("kvaddr_step1w4_c1_i64", 4, 1024)
    p.use_kernel("v9", wide_per_thread=0)  # automatic again
    assert p.kernel_for(4096) == ("kvaddr_step1w16_c1_i64", 16, 256)
    p.wide_threads = 64  # aim at 64-thread blocks: R = 16 from 257 requests on
    assert p.kernel_for(1024) == ("kvaddr_step1w16_c1_i64", 64, 64)
    assert p.kernel_for(300) == ("kvaddr_step1w8_c1_i64", 4096 // 64, 64)
    p.wide_threads = 1024  # R = 4 up to 4096 requests
    assert p.kernel_for(4096) == ("kvaddr_step1w4_c1_i64", 4, 1024)
    p.wide_threads = 256
    p.use_kernel("v9", wide_max_requests=1024)
    assert p.kernel_for(1024)[0] == "kvaddr_step1w4_c1_i64" and p.kernel_for(1025)[0] == "kvaddr_step_i64"
    p.use_kernel("v9", wide_max_requests=0)
    assert p.kernel_for(256)[0] == "kvaddr_step1_c1_i64" and p.kernel_for(257)[0] == "kvaddr_step_i64"
    p.use_kernel("v9", wide_max_requests=4096, max_requests=1024)  # v9's one block up to 1024, then wide
    assert p.kernel_for(1024)[0] == "kvaddr_step1_c1_i64" and p.kernel_for(1025)[0] == "kvaddr_step1w8_c1_i64"
    with pytest.raises(ValueError, match="wide_max_requests"):
        p.use_kernel("v9", wide_max_requests=4097)
    for bad in (2, 3, 32, True):
        with pytest.raises(ValueError, match="wide_per_thread must be 0, 4, 8 or 16"):
            p.use_kernel("v9", wide_per_thread=bad)


def test_v8_v9_old_attention_and_large_capacity_never_run_the_wide_kernel(wide_cls):
    StepPlanner, launches = wide_cls
    p = StepPlanner(4096, 4096, [16])
    p.use_kernel("v8")
    for bsz in (1, 257, 1024, 4096):
        assert p.kernel_for(bsz) == ("kvaddr_step_i64", p.grid(bsz), 256), bsz
        _compute(p, bsz, 1)
        assert launches[-1][:3] == p.kernel_for(bsz)
    p.use_kernel("v9-old")
    assert p.kernel_for(256)[0] == "kvaddr_step1old_c1_i64" and p.kernel_for(257)[0] == "kvaddr_step_i64"
    p.use_kernel("v9")
    assert p.kernel_for(257)[0] == "kvaddr_step1w4_c1_i64"
    p.use_kernel("v9", max_capacity=4095)  # C above the small-batch kernels' limit
    assert p.kernel_for(1)[0] == p.kernel_for(1024)[0] == "kvaddr_step_i64"
    for cap in (256, 4096):  # attention outputs: kvaddr_step1m_* or kvaddr_step_*, as before
        on = StepPlanner(4096, cap, [16], attention="varlen")
        assert on._wide_max_bsz == -1 and on.kernel_for(257)[0] == on.kernel_for(4096)[0] == "kvaddr_step_i64"
    small = StepPlanner(200, 4096, [16])  # max_requests <= one_block_max_requests: no wide kernel
    assert small._wide_max_bsz == -1 and small.kernel_for(200)[0] == "kvaddr_step1_c1_i64"
    mid = StepPlanner(1500, 4096, [16])
    assert mid.kernel_for(1500)[0] == "kvaddr_step1w16_c1_i64"


@pytest.mark.parametrize("capacity", [1, 100, 256, 257, 1000, 1024, 4096, 4097, 9000])
def test_wide_geometry_covers_the_batch_and_records_exist(wide_cls, capacity):
    """R x T >= bsz, T a multiple of 32 in [32, 1024], R x T <= KV_W_MAX (the kernel's shared
    memory), ceil(C / T) blocks; every record the wide kernel writes (grid x T / 32) exists, so
    v8, v9 and wide clear each other's (kvaddr_step_* clears up to (num_chunks + max_tiles) x 8)."""
    StepPlanner, _ = wide_cls
    consts = kernel_loader.constants()
    p = StepPlanner(4096, capacity, [16])
    n_rec = (p._num_chunks + p._params.max_tiles) * consts["KV_WARPS"]
    assert p._records.size == 2 * n_rec
    for r_knob, target in ((0, 256), (0, 32), (0, 1024), (4, 256), (8, 256), (16, 256)):
        p.wide_threads = target
        p.use_kernel("v9", wide_per_thread=r_knob)
        for bsz in (257, 300, 511, 512, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 3000, 4095, 4096):
            name, grid, threads = p.kernel_for(bsz)
            r = int(name[len("kvaddr_step1w") :].split("_")[0])
            assert r in (4, 8, 16) and r * threads >= bsz and r * threads <= consts["KV_W_MAX"], (bsz, r, threads)
            assert threads % 32 == 0 and 32 <= threads <= 1024 and grid == -(-capacity // threads), (bsz, threads)
            assert grid * threads // 32 <= n_rec, (bsz, grid, threads)
            if r_knob and r_knob * 1024 >= bsz:
                assert r == r_knob
