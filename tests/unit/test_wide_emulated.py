"""v9 across blocks (the library's ``kvaddr_step1w{R}_c{G}_i64``: ``kv_step_one`` with R > 0 requests per
thread) against the NumPy reference on the CPU: the device code run by tests/support/v9_emulator.py (one
std::thread per CUDA thread, shuffles, votes and barriers emulated; blocks one after another). The decode
vote, the scan path, padding, every error bit and the first bad key, R = 4, 8, 16, one warp and 32 warps,
one block and many, 0-4 caches, int4 and scalar length loads. The GPU versions are
tests/gpu/test_wide_step_gpu.py and the "v9-across" rows of tests/gpu/test_step_kernels_gpu.py."""

import numpy as np
import pytest

from tests.support import v9_emulator
from tests.support.gpu import reference
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, random_step

pytestmark = pytest.mark.skipif(v9_emulator.CXX is None, reason="no g++: the v9 emulator needs a C++20 compiler")


def _contiguous(case):
    """The case with int32 tables whose rows are contiguous (the emulator's struct takes a row stride only)."""
    t = case["block_tables"]

    def fix(x):
        if x.dtype == np.int32 and x.strides[1] == 4:
            return x
        out = np.zeros((max(x.shape[0], 1), max(x.shape[1], 1)), np.int32)  # (0, w): a row of zeros, never read
        out[: x.shape[0], : x.shape[1]] = x
        return out

    return dict(case, block_tables=[fix(x) for x in t] if isinstance(t, (list, tuple)) else fix(np.asarray(t)))


def _check(case, label, r=0, wide_threads=256, **kw):
    case = _contiguous(case)
    bsz = case["seq_lens_decoder"].shape[0]
    geometry = v9_emulator.wide_geometry(bsz, case["capacity"], r, wide_threads)
    out, errors = v9_emulator.run(0, case, across=geometry, **kw)
    ref = reference(case)
    for f, got in out.items():
        want = getattr(ref.outputs, f)
        assert got.dtype == want.dtype and np.array_equal(got, want), f"{label} {geometry}: {f} {got} != {want}"
    assert errors == (ref.error_mask, ref.error_key), f"{label} {geometry}: error record"
    return ref


def test_worked_examples_and_edge_cases():
    """Every bsz >= 0 (the planner runs the wide kernel from 257 requests; the kernel takes any)."""
    for label, case, *_ in WORKED_EXAMPLES:
        _check(case, label)
    for name, case in sorted(edge_cases().items()):
        if case["seq_lens_decoder"].shape[0] <= 4096 and case["capacity"] <= 20000:
            _check(case, name)


@pytest.mark.parametrize("r", [4, 8, 16])
def test_decode_batches(r):
    """The vote holds (plain decode, padding C > bsz, bad block ids, block index past the width,
    ids near 2**31) or fails (a negative length; over capacity; C < bsz), at one warp and more."""
    rng = np.random.default_rng(100 + r)
    for i, bsz in enumerate((1, 31, 33, 257, 300, 600)):
        for kw in ({}, dict(errors=True), dict(over_capacity=True), dict(big_ids=True)):
            case = random_step(rng, bsz=bsz, block_sizes=[16, 96][: 1 + i % 2], mix=("decode",), **kw)
            if i % 3 == 0:
                case["capacity"] += 300  # padding, more blocks
            elif i % 3 == 1 and not kw:
                case["capacity"] = bsz  # floor_step's rows
            _check(case, f"decode {bsz} {kw}", r=r, max_requests=bsz + 2)
        case = random_step(rng, bsz=bsz, block_sizes=[16], mix=("decode",))
        case["capacity"] = max(1, bsz - 5)  # a decode batch larger than the capacity: the scan path, bit 4
        ref = _check(case, f"decode {bsz} C < bsz", r=r)
        assert ref.error_mask & 4 or bsz <= 5


@pytest.mark.parametrize("r", [4, 16])
def test_mixed_batches(r):
    """The vote fails: the scan with R requests per thread, errors, over capacity, uniform batches."""
    rng = np.random.default_rng(1616 + r)
    for i in range(10):
        kw = [{}, dict(errors=True), dict(over_capacity=True), dict(uniform=int(rng.integers(0, 4)))][i % 4]
        bsz = int(rng.choice([1, 32, 65, 257, 400, 700]))
        case = random_step(rng, bsz=bsz, block_sizes=[64, 3][: 1 + i % 2], **kw)
        _check(case, f"mixed {i} {kw}", r=r, max_requests=bsz + 1)


def test_large_batches_one_and_two_caches():
    """decode 1024 (4 blocks of 256), 2048 and 4096 (16 blocks of 256, R = 16), a speculative and a
    mixed 2048 with a bad request."""
    rng = np.random.default_rng(4096)
    for bsz, kw in ((1024, dict(mix=("decode",))), (4096, dict(mix=("decode",))), (2048, dict(uniform=2))):
        case = random_step(rng, bsz=bsz, block_sizes=[16, 64], **kw)
        case["capacity"] = int(np.clip(case["seq_lens_this_time"], 0, None).sum())
        assert _check(case, f"{bsz} {kw}").error_mask == 0
    case = random_step(rng, bsz=2048, block_sizes=[96], mix=("decode", "spec", "idle", "continue"))
    case["seq_lens_this_time"][2047] = -1
    assert _check(case, "mixed 2048, bad last request").error_mask & 8


@pytest.mark.parametrize("caches", [0, 3, 4])
def test_every_cache_count(caches):
    rng = np.random.default_rng(7 + caches)
    for bsz, kw in ((300, dict(mix=("decode",))), (300, dict(errors=True)), (520, {})):
        case = random_step(rng, bsz=bsz, block_sizes=[16, 7, 96, 64][: max(caches, 1)], **kw)
        if caches == 0:
            case = dict(case, block_tables=np.zeros((bsz, 1), np.int32), block_sizes=[])
        _check(case, f"{caches} caches {kw}")


def test_unaligned_length_arrays_and_geometry_knobs():
    """Length arrays 4 bytes past a 16-byte boundary (scalar loads instead of int4); blocks of 32 to 1024
    threads (wide_threads 32 and 1024: one warp per block, one 1024-thread block per 4096 requests)."""
    rng = np.random.default_rng(5)
    for bsz, kw in ((1024, dict(mix=("decode",))), (700, dict(errors=True)), (333, {})):
        case = random_step(rng, bsz=bsz, block_sizes=[16], **kw)
        _check(case, f"unaligned {bsz} {kw}", unaligned_lengths=True)
        for wide_threads in (32, 1024):
            _check(case, f"{bsz} {kw} wide_threads {wide_threads}", wide_threads=wide_threads)
