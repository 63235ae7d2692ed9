"""The fused step's kernels against the NumPy reference: the dispatch table's choice for each
batch (step_small up to 256 requests, step_wide to 4096, step_multiblock above) and every batch
on step_multiblock (its scan path and tiles at any bsz): worked examples, edge cases, seeded
random steps (every request kind, errors, block ids near 2**31, strided tables, 0-4 caches, both
position dtypes), the bad-input matrix's device rows, switching kernels between launches (sticky
error records: none lost, none invented), graph replay. Skipped without a GPU."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.gpu import assert_outputs_equal, force_multiblock, poison, reference, requires_gpu, to_device
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, random_step

#: The dispatch table's kernel for each batch; every batch on the multi-block kernel.
KERNELS = ["dispatch", "multiblock"]
EDGE = edge_cases()


def _planner(kernel, case, max_requests=None, position_dtype=np.int64):
    from kvaddr import StepPlanner

    bsz = case["seq_lens_decoder"].shape[0]
    p = StepPlanner(max(max_requests or bsz, 1), case["capacity"], case["block_sizes"], position_dtype=position_dtype)
    return force_multiblock(p, kernel == "multiblock")


def _launch(p, kernel, bsz):
    """The launch ``kernel`` makes for ``bsz`` requests on ``p``: the dispatch table's, or the
    multi-block kernel's (the table's name and grid for it)."""
    import dataclasses

    from kvaddr import dispatch

    if kernel == "dispatch":
        return dispatch.step_launch(p.config, bsz)
    big = dataclasses.replace(p.config, max_requests=dispatch.WIDE_MAX_REQUESTS + 1)
    name = dispatch.step_launch(big, big.max_requests).kernel
    return dispatch.Launch(name, dispatch.multiblock_blocks(p.config, bsz), dispatch.THREADS)


def _tables(dev, case):
    return dev["block_tables"] if case["block_sizes"] else None


def _run(kernel, case, label, position_dtype=np.int64, max_requests=None):
    import cupy

    ref = reference(case, position_dtype=position_dtype)
    dev = to_device(case)
    p = _planner(kernel, case, max_requests, position_dtype)
    bsz = case["seq_lens_decoder"].shape[0]
    name, blocks, threads = p.kernel_for(bsz)
    launch = _launch(p, kernel, bsz)
    assert (name, blocks, threads) == (launch.kernel, launch.blocks, launch.threads) and blocks == p.grid(bsz), label
    poison(p)
    out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], _tables(dev, case))
    cupy.cuda.get_current_stream().synchronize()
    assert_outputs_equal(out, ref.outputs, f"{label} [{kernel}, {name}]")
    assert p.errors() == (ref.error_mask, ref.error_key), f"{label} [{kernel}, {name}]: error record"
    return p


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index", range(len(WORKED_EXAMPLES)))
def test_worked_examples(kernel, index):
    label, case = WORKED_EXAMPLES[index][0], WORKED_EXAMPLES[index][1]
    _run(kernel, case, f"worked example {label}")


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(EDGE))
def test_edge_cases(kernel, name):
    _run(kernel, EDGE[name], name)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("position_dtype", [np.int64, np.int32])
def test_random_steps(kernel, position_dtype):
    rng = np.random.default_rng(1616 + (position_dtype == np.int32))
    for i in range(60):
        kw = {}
        r = i % 6
        if r == 1:
            kw = dict(uniform=int(rng.integers(0, 4)))
        elif r == 2:
            kw = dict(errors=True)
        elif r == 3:
            kw = dict(over_capacity=True)
        elif r == 4:
            kw = dict(big_ids=True, num_caches=int(rng.integers(0, 5)))
        elif r == 5:
            kw = dict(mix=("decode",), bsz=int(rng.choice([1, 31, 32, 33, 64, 255, 256, 257, 513, 1024, 1025, 4096])))
        case = random_step(rng, max_bsz=int(rng.choice([8, 100, 1024])), **kw)
        if position_dtype == np.int32 and case["block_sizes"] and int(case["seq_lens_decoder"].max(initial=0)) > 2**30:
            continue
        # a planner larger than the batch, as engines size them
        _run(kernel, case, f"random step {i} {kw}", position_dtype, max_requests=case["seq_lens_decoder"].shape[0] + 7)


@requires_gpu
@pytest.mark.parametrize("num_caches", [0, 1, 2, 3, 4])
def test_every_cache_count_runs_its_own_kernels(num_caches):
    """The small and across-blocks kernels of each cache count (their template's G)."""
    rng = np.random.default_rng(40 + num_caches)
    for bsz in (100, 300):
        case = random_step(rng, bsz=bsz, num_caches=max(num_caches, 1), errors=num_caches % 2 == 1)
        if not num_caches:
            case = dict(case, block_tables=np.zeros((bsz, 1), np.int32), block_sizes=[])
        p = _run("dispatch", case, f"{num_caches} caches, bsz {bsz}")
        assert p.config.num_caches == num_caches and p.kernel_for(bsz)[0].startswith(("step_small<", "step_wide<"))


@requires_gpu
def test_switching_kernels_leaves_no_stale_error_record():
    """An erroneous step on one kernel, then a clean one on another (and back), each read: the
    clean step's read is clean whichever kernel wrote the previous records (errors() clears
    them; no kernel clears another's). The batch sizes pick the small, across-blocks or
    multi-block kernel; a planner forced onto the multi-block kernel meets the others."""
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(7)
    bad = random_step(rng, bsz=600, block_sizes=[16, 16], errors=True, mix=("decode", "spec"))
    bad["seq_lens_decoder"][599] = -1  # the last warp too
    good = random_step(rng, bsz=200, block_sizes=[16, 16], mix=("decode", "spec"))
    good["seq_lens_this_time"][:] = np.minimum(good["seq_lens_this_time"], 3)  # <= 600 tokens: no error
    big = random_step(rng, bsz=5000, block_sizes=[16, 16], mix=("decode",))
    big["seq_lens_this_time"][:] = np.minimum(big["seq_lens_this_time"], 1)
    for case in (bad, good, big):
        case["capacity"] = 6000
    p = StepPlanner(5000, 6000, [16, 16])
    for order in (("dispatch", "multiblock"), ("multiblock", "dispatch"), ("dispatch", "dispatch")):
        for first, second in ((bad, good), (bad, big), (big, good), (good, bad)):
            for kernel, case in zip(order, (first, second)):
                force_multiblock(p, kernel == "multiblock")
                ref = reference(case)
                dev = to_device(case)
                out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
                cupy.cuda.get_current_stream().synchronize()
                label = f"{order} {kernel} {p.kernel_for(len(case['seq_lens_decoder']))[0]}"
                assert_outputs_equal(out, ref.outputs, label)
                assert p.errors() == (ref.error_mask, ref.error_key), f"{label}: error record"


def _launch_kernel(p, kernel, case):
    """``case`` on ``kernel`` ("dispatch" or "multiblock"), records not read."""
    import cupy

    force_multiblock(p, kernel == "multiblock")
    dev = to_device(case)
    p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    cupy.cuda.get_current_stream().synchronize()


@requires_gpu
@pytest.mark.parametrize("mixed", [False, True])
def test_sticky_records_across_kernels(mixed):
    """Sticky records (docs/spec.md, "Errors") through kernel switches, none read in between:
    a bad step then errors() reports it and a second errors() is clean; a bad step then a good
    step (any kernel) then errors(): the bad one's; two bad steps (any two kernels): the OR of
    the bits and the smaller key. Every order of the dispatch table's kernel and the
    multi-block kernel."""
    from kvaddr import StepPlanner
    from kvaddr.errors import NO_ERROR_KEY
    from tests.support.sticky_cases import sticky_cases

    # C > 256: the small kernel runs several blocks, the multi-block kernel ceil(C / 256) chunks
    cases = sticky_cases(bsz=40, num_caches=2, mixed=mixed, spare=600)
    C = cases["good"]["capacity"]
    ra, rb = reference(cases["bad_a"]), reference(cases["bad_b"])
    assert ra.error_mask and rb.error_mask and rb.error_key < ra.error_key
    both = (ra.error_mask | rb.error_mask, rb.error_key)
    p = StepPlanner(64, C, [16, 16])
    for k1 in KERNELS:
        _launch_kernel(p, k1, cases["bad_a"])
        assert p.errors() == (ra.error_mask, ra.error_key), k1
        assert p.errors() == (0, NO_ERROR_KEY), f"{k1}: the read cleared the records"
        for k2 in KERNELS:
            _launch_kernel(p, k1, cases["bad_a"])
            _launch_kernel(p, k2, cases["good"])
            assert p.errors() == (ra.error_mask, ra.error_key), f"{k1} bad, {k2} good"
            _launch_kernel(p, k1, cases["bad_a"])
            _launch_kernel(p, k2, cases["bad_b"])
            _launch_kernel(p, k1, cases["good"])
            assert p.errors() == both, f"{k1} bad, {k2} bad"
            _launch_kernel(p, k2, cases["good"])
            assert p.errors() == (0, NO_ERROR_KEY), f"{k1}, {k2}: good alone"
    _launch_kernel(p, "dispatch", cases["bad_a"])
    p.clear_errors()
    assert p.errors() == (0, NO_ERROR_KEY), "clear_errors drops unread errors"


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_replay_follows_changing_inputs(kernel):
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(99)
    cases = [random_step(rng, bsz=200, block_sizes=[64, 16], shared_table=False, errors=i == 1) for i in range(3)]
    cap = max(c["capacity"] for c in cases)
    width = max(t.shape[1] for c in cases for t in c["block_tables"])
    p = force_multiblock(StepPlanner(200, cap, [64, 16]), kernel == "multiblock")
    d = cupy.zeros(200, np.int32)
    q = cupy.zeros(200, np.int32)
    tables = [cupy.full((202, width), -1, np.int32) for _ in range(2)]
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p.compute(d, q, tables, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        p.compute(d, q, tables, stream=stream)
        graph = stream.end_capture()
    for i, c in enumerate(cases):
        c = dict(c, capacity=cap)
        host_tables = []
        for g in range(2):
            t = c["block_tables"][g]
            full = np.full((202, width), -1, np.int32)
            full[: t.shape[0], : t.shape[1]] = t
            host_tables.append(full)
        ref = reference(dict(c, block_tables=host_tables))
        with stream:  # the copies and the replay on one stream, in order
            d.set(c["seq_lens_decoder"], stream=stream)
            q.set(c["seq_lens_this_time"], stream=stream)
            for g in range(2):
                tables[g].set(host_tables[g], stream=stream)
            graph.launch(stream)
        stream.synchronize()
        assert_outputs_equal(p._outputs(200), ref.outputs, f"replay {i} [{kernel}]")
        assert p.errors(stream) == (ref.error_mask, ref.error_key), f"replay {i} [{kernel}]"


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_input_matrix_rows(kernel):
    from kvaddr import AddressingError
    from tests.support.bad_input_matrix import ROWS, reference_for

    rows = [r for r in ROWS if "gpu" in r.where and r.kind != "host" and r.id != "other-device"]
    rows = [r for r in rows if "attention" not in r.make()]
    assert rows
    for row in rows:
        case = row.make()
        ref = reference_for(case)
        dev = to_device(case)
        bsz = case["seq_lens_decoder"].shape[0]
        p = _planner(kernel, case, max(bsz, 1))
        out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        assert_outputs_equal(out, ref.outputs, f"{row.id} [{kernel}]")
        assert p.errors() == (ref.error_mask, ref.error_key), f"{row.id} [{kernel}]"
        if row.bits:  # the read cleared the records: the step again, then check()
            p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
            with pytest.raises(AddressingError):
                p.check()
        p.check()


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=min(200, int(os.environ.get("KVADDR_GPU_EXAMPLES", "200"))), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    errors=st.booleans(),
    over=st.booleans(),
    big=st.booleans(),
    bsz=st.sampled_from([None, None, 1, 32, 33, 256, 257, 1024, 1025]),
    uniform=st.sampled_from([None, None, None, 0, 1, 2, 5]),
)
def test_hypothesis_steps(kernel, seed, errors, over, big, bsz, uniform):
    rng = np.random.default_rng(seed)
    kw = {} if bsz is None else dict(bsz=bsz, mix=("decode", "spec", "idle"))
    case = random_step(rng, max_bsz=300, errors=errors, over_capacity=over, big_ids=big, uniform=uniform, **kw)
    _run(kernel, case, f"seed {seed}", max_requests=case["seq_lens_decoder"].shape[0] + 3)
