"""v9's candidate fixes (kernels.cu's KV_FIX_DECODE_FIRST, KV_FIX_LEAN, KV_ABL_PARAM_REGS; KV_V9_DEFAULT = 416
is the library's kvaddr_step1_c*; issue 16,
benchmarks/ablate_v9.py) against the NumPy reference on the CPU: the device code run by
tests/support/v9_emulator.py (one thread per CUDA thread, shuffles and barriers emulated). Mask 0
(v9 as shipped, proven on the H200) checks the emulator itself. The GPU versions of these tests
are tests/gpu/test_ablate_v9_gpu.py."""

import numpy as np
import pytest

from tests.support import v9_emulator
from tests.support.gpu import reference
from tests.support.step_cases import WORKED_EXAMPLES, random_step

pytestmark = pytest.mark.skipif(v9_emulator.CXX is None, reason="no g++: the v9 emulator needs a C++20 compiler")


def _check(mask, case, label, **kw):
    out, errors = v9_emulator.run(mask, case, **kw)
    ref = reference(case)
    for f, got in out.items():
        want = getattr(ref.outputs, f)
        assert got.dtype == want.dtype and np.array_equal(got, want), f"{label} [mask {mask}]: {f} {got} != {want}"
    assert errors == (ref.error_mask, ref.error_key), f"{label} [mask {mask}]: error record"


@pytest.mark.parametrize("mask", v9_emulator.MASKS)
def test_worked_examples(mask):
    for label, case, *_ in WORKED_EXAMPLES:
        _check(mask, case, label)


@pytest.mark.parametrize("mask", v9_emulator.MASKS)
def test_decode_batches(mask):
    """The decode-first vote holds (plain decode, bad block ids, over capacity) or fails (a
    negative length), at one warp and at several, one block and several (C > T)."""
    rng = np.random.default_rng(16 + mask)
    for i, bsz in enumerate((1, 2, 31, 33, 64, 65)):
        for kw in ({}, dict(errors=True), dict(over_capacity=True), dict(big_ids=True)):
            case = random_step(rng, bsz=bsz, num_caches=1 + i % 2, mix=("decode",), **kw)
            if i % 3 == 0:
                case["capacity"] += 300  # several blocks: every block votes
            _check(mask, case, f"decode {bsz} {kw}", max_requests=bsz + 2)


@pytest.mark.parametrize("mask", v9_emulator.MASKS)
def test_mixed_batches(mask):
    """The vote fails: v9's scan path, with errors and over capacity."""
    rng = np.random.default_rng(1616 + mask)
    for i in range(12):
        kw = [{}, dict(errors=True), dict(over_capacity=True), dict(uniform=int(rng.integers(0, 3)))][i % 4]
        case = random_step(rng, max_bsz=70, num_caches=1 + i % 2, **kw)
        _check(mask, case, f"mixed {i} {kw}", max_requests=case["seq_lens_decoder"].shape[0] + 1)


@pytest.mark.parametrize("mask", (0, 416))
@pytest.mark.parametrize("kw", [{}, dict(mixed=True), dict(bsz=3, num_caches=1), dict(bsz=300, num_caches=1)])
def test_records_are_sticky(mask, kw):
    """Sticky records (docs/spec.md, "Errors"): a launch writes only the records of its warps
    with an error, merged (OR, min); nothing clears them. One record array through a good, a
    bad, a good, a second bad and a good step: what it holds is the OR of the bad steps' bits
    and the smaller key, whatever ran after; a good step alone leaves it clean."""
    from kvaddr.errors import NO_ERROR_KEY
    from tests.support.sticky_cases import sticky_cases

    cases = sticky_cases(**kw)
    C, bsz = cases["good"]["capacity"], cases["good"]["seq_lens_decoder"].shape[0]
    ra, rb = reference(cases["bad_a"]), reference(cases["bad_b"])
    rec = v9_emulator.clean_records(C, bsz + 2)
    _, errors = v9_emulator.run(mask, cases["good"], max_requests=bsz + 2, records=rec)
    assert errors == (0, NO_ERROR_KEY) and not rec[0::2].any(), "a good step writes no record"
    _, errors = v9_emulator.run(mask, cases["bad_a"], max_requests=bsz + 2, records=rec)
    assert errors == (ra.error_mask, ra.error_key)
    _, errors = v9_emulator.run(mask, cases["good"], max_requests=bsz + 2, records=rec)
    assert errors == (ra.error_mask, ra.error_key), "a good step after a bad one keeps its record"
    _, errors = v9_emulator.run(mask, cases["bad_b"], max_requests=bsz + 2, records=rec)
    _, errors = v9_emulator.run(mask, cases["good"], max_requests=bsz + 2, records=rec)
    assert errors == (ra.error_mask | rb.error_mask, min(ra.error_key, rb.error_key)), "two bad steps merge"
