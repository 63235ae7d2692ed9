"""v9's candidate fixes (issue 16; kvaddr/kernels.cu's KV_FIX_* bits of kv_step_one; 416 =
KV_V9_DEFAULT, what the library's kvaddr_step1_c* instantiate since round 2) against
the NumPy reference, so a fix that measures ahead in benchmarks/ablate_v9.py can be adopted:
``KV_FIX_DECODE_FIRST`` (one vote "every request is decode" replaces the scan; the scan runs
when it fails), ``KV_FIX_LEAN`` (pos / B once per token), both.
The kernels are ``kvaddr_step1_abl_c{G}_m{MASK}`` (G = 1, 2 caches, int64 positions) of
kernels.cu compiled with ``KV_ABLATION`` (the benchmark's module, tests/support/ablation.py), launched with a v9
planner's struct and geometry: every output and the error record as the reference's, from
poisoned outputs and cleared (sticky) records. Also ``m0`` (v9 recompiled there) as a control. Skipped without a GPU."""

import functools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.ablation import ablation_source
from tests.support.gpu import assert_outputs_equal, poison, reference, requires_gpu, to_device
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, random_step

#: KV_ABL_PARAM_REGS (a copy: correct), KV_FIX_DECODE_FIRST, KV_FIX_LEAN, both, all three
#: (416 = KV_V9_DEFAULT, the library's kvaddr_step1_c* since round 2); 0 = v9 as first shipped
#: (control, "v9-old").
MASKS = [0, 32, 128, 256, 384, 416]
#: The broad tests (edge cases, random steps): each fix bit alone and the default (the GPU
#: check script's 120 s budget); the worked examples run every mask, hypothesis 32, 384, 416.
FIXES = [128, 256, 416]
DEFAULT = 416


@functools.cache
def _module():
    import cupy

    from kvaddr import kernel_loader

    # the same string as benchmarks/ablate_v9.py's module: one compile per machine
    return cupy.RawModule(code=ablation_source(), options=kernel_loader.COMPILE_OPTIONS)


def _tables(dev, case):
    return dev["block_tables"]


def _planner(case, wide, max_requests):
    from kvaddr import StepPlanner

    bsz = case["seq_lens_decoder"].shape[0]
    p = StepPlanner(max(max_requests or bsz, 1), case["capacity"], case["block_sizes"])
    if wide:
        p.one_block_min_threads = 1024
    p.use_kernel("v9", max_requests=1024)
    return p


def _launch(p, mask, dev, case):
    """Check and write the struct as compute() does, then launch the fix kernel with v9's geometry."""
    import cupy

    from kvaddr import kernel_loader

    G = len(case["block_sizes"])
    bsz = case["seq_lens_decoder"].shape[0]
    name, blocks, threads = p.kernel_for(bsz)
    assert name == f"kvaddr_step1_c{G}_i64", name
    p.launch_args(dev["seq_lens_decoder"], dev["seq_lens_this_time"], _tables(dev, case))
    fn = _module().get_function(f"kvaddr_step1_abl_c{G}_m{mask}").kernel  # the Function takes a stream
    launcher = kernel_loader.Launcher(fn, p._params, by_value=True)
    stream = cupy.cuda.get_current_stream()
    launcher(blocks, threads, stream.ptr)
    stream.synchronize()
    return p._outputs(bsz), (name, blocks, threads)


def _run(mask, case, label, wide=False, max_requests=None):
    G = len(case["block_sizes"])
    bsz = case["seq_lens_decoder"].shape[0]
    assert G in (1, 2) and bsz <= 1024, label
    ref = reference(case)
    dev = to_device(case)
    p = _planner(case, wide, max_requests)
    poison(p)
    p.clear_errors()
    out, geometry = _launch(p, mask, dev, case)
    where = f"{label} [mask {mask}, {'wide' if wide else 'v9'} <<<{geometry[1]}, {geometry[2]}>>>]"
    assert_outputs_equal(out, ref.outputs, where)
    assert p.errors() == (ref.error_mask, ref.error_key), f"{where}: error record"


def _fits(case):
    return len(case["block_sizes"]) in (1, 2) and case["seq_lens_decoder"].shape[0] <= 1024


EDGE = {k: v for k, v in edge_cases().items() if _fits(v)}


@requires_gpu
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("index", range(len(WORKED_EXAMPLES)))
def test_worked_examples(mask, index):
    label, case = WORKED_EXAMPLES[index][0], WORKED_EXAMPLES[index][1]
    _run(mask, case, f"worked example {label}")


@requires_gpu
@pytest.mark.parametrize("mask", FIXES)
@pytest.mark.parametrize("name", sorted(EDGE))
def test_edge_cases(mask, name):
    _run(mask, EDGE[name], name, wide=sorted(EDGE).index(name) % 2 == 1)


@requires_gpu
@pytest.mark.parametrize("mask", [128, 0, DEFAULT])
@pytest.mark.parametrize("num_caches", [1, 2])
def test_decode_batches(mask, num_caches):
    """The decode-first path (every request n == 1, d >= 0) and its errors: negative and
    beyond-the-row block ids (the vote holds, the token checks flag them), over capacity (bsz
    > C: the vote holds, bit 4), a negative length (the vote fails: the scan path)."""
    rng = np.random.default_rng(16_000 + num_caches)
    i = 0
    for bsz in (1, 2, 32, 33, 64, 256, 257, 1024):
        for kw in ({}, dict(errors=True), dict(over_capacity=True), dict(big_ids=True)):
            case = random_step(rng, bsz=bsz, num_caches=num_caches, mix=("decode",), **kw)
            wide = bool(i % 2)
            _run(mask, case, f"decode {bsz} {kw} #{i}", wide=wide, max_requests=bsz + int(rng.integers(0, 9)))
            i += 1


@requires_gpu
@pytest.mark.parametrize("mask", FIXES)
def test_random_steps(mask):
    """Mixed, speculative, idle and uniform batches: the vote fails (or holds) and the scan runs."""
    rng = np.random.default_rng(1616)
    for i in range(24):
        kw = {}
        r = i % 4
        if r == 1:
            kw = dict(uniform=int(rng.integers(0, 4)))
        elif r == 2:
            kw = dict(errors=True)
        elif r == 3:
            kw = dict(over_capacity=True)
        case = random_step(rng, max_bsz=int(rng.choice([8, 100, 1024])), num_caches=int(rng.integers(1, 3)), **kw)
        _run(mask, case, f"random step {i} {kw}", wide=bool(i % 2), max_requests=case["seq_lens_decoder"].shape[0] + 7)


@requires_gpu
@pytest.mark.parametrize("mask", [128, 0, DEFAULT])
def test_decode_then_mixed_in_place(mask):
    """The same planner and arrays: a decode batch, the same requests turned mixed in place
    (the vote fails: every output rewritten by the scan path), then decode again; no poison
    between launches, so anything a path leaves unwritten shows."""
    import cupy

    rng = np.random.default_rng(7)
    case = random_step(rng, bsz=48, num_caches=2, mix=("decode",), block_sizes=[16, 16], shared_table=True)
    case["capacity"] = 200
    dev = to_device(case)
    p = _planner(case, False, 64)
    poison(p)
    p.clear_errors()
    for step in range(3):
        # (tokens past a request's blocks are errors the reference reports too)
        q = np.ones(48, dtype=np.int32) if step != 1 else rng.integers(0, 4, size=48).astype(np.int32)
        case = dict(case, seq_lens_this_time=q)
        dev["seq_lens_this_time"][...] = cupy.asarray(q)
        cupy.cuda.runtime.deviceSynchronize()
        ref = reference(case)
        out, _ = _launch(p, mask, dev, case)
        assert_outputs_equal(out, ref.outputs, f"step {step} [mask {mask}]")
        assert p.errors() == (ref.error_mask, ref.error_key), f"step {step} [mask {mask}]: error record"


@requires_gpu
@pytest.mark.parametrize("mask", [32, 384, DEFAULT])
@settings(max_examples=min(100, int(os.environ.get("KVADDR_GPU_EXAMPLES", "100"))), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    errors=st.booleans(),
    over=st.booleans(),
    big=st.booleans(),
    wide=st.booleans(),
    num_caches=st.sampled_from([1, 2]),
    bsz=st.sampled_from([None, 1, 2, 32, 33, 64, 256, 1024]),
    decode=st.booleans(),
)
def test_hypothesis_steps(mask, seed, errors, over, big, wide, num_caches, bsz, decode):
    rng = np.random.default_rng(seed)
    kw = {} if bsz is None else dict(bsz=bsz)
    if decode:
        kw["mix"] = ("decode",)
    case = random_step(rng, max_bsz=300, errors=errors, over_capacity=over, big_ids=big, num_caches=num_caches, **kw)
    _run(mask, case, f"seed {seed} {kw}", wide=wide, max_requests=case["seq_lens_decoder"].shape[0] + 3)


@requires_gpu
@pytest.mark.parametrize("mask", [0, DEFAULT])
@pytest.mark.parametrize("spare", [24, 600])
def test_records_are_sticky(mask, spare):
    """No clearing between launches: a bad step's record survives a good step of the same
    planner, and two bad steps merge (OR of the bits, the smaller key); errors() then resets.
    One block (C = 64) and several (C = 640: three blocks of 256 threads)."""
    from kvaddr.errors import NO_ERROR_KEY
    from tests.support.sticky_cases import sticky_cases

    cases = sticky_cases(bsz=40, num_caches=2, spare=spare)
    ra, rb = reference(cases["bad_a"]), reference(cases["bad_b"])
    assert reference(cases["good"]).error_mask == 0 and ra.error_mask and rb.error_mask
    p = _planner(cases["good"], False, 64)
    p.clear_errors()
    _launch(p, mask, to_device(cases["bad_a"]), cases["bad_a"])
    _launch(p, mask, to_device(cases["good"]), cases["good"])
    assert p.errors() == (ra.error_mask, ra.error_key), f"mask {mask}: bad then good"
    assert p.errors() == (0, NO_ERROR_KEY), f"mask {mask}: the read reset the records"
    _launch(p, mask, to_device(cases["bad_a"]), cases["bad_a"])
    _launch(p, mask, to_device(cases["bad_b"]), cases["bad_b"])
    _launch(p, mask, to_device(cases["good"]), cases["good"])
    want = (ra.error_mask | rb.error_mask, min(ra.error_key, rb.error_key))
    assert p.errors() == want, f"mask {mask}: two bad steps"
