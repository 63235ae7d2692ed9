"""The across-blocks kernel (``step_wide<G, pos, R>``: the dispatch table's kernel for 256 < bsz <= 4096
without attention outputs) against the NumPy reference: decode,
speculative, mixed, chunked prefill and idle batches, bad lengths, negative blocks, block indices past
the table's width, padding (C > bsz), the capacity error (C < tokens, also C < bsz), non-power-of-two
block sizes, block ids near 2**31, 0-4 caches, both position dtypes, every R the table picks (4, 8, 16
requests per thread), length arrays that are not 16-byte aligned (no int4 loads), hypothesis over
random batches, switching between the small, across-blocks and multi-block kernels across calls (no
stale error record), CUDA-graph replay and StepPlanner.bind. Skipped without a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.gpu import assert_outputs_equal, force_multiblock, poison, reference, requires_gpu, to_device
from tests.support.step_cases import BIG_BLOCK, random_step

pytestmark = requires_gpu

SIZES = [257, 300, 511, 1024, 1025, 2048, 4095, 4096]
KINDS = [
    "decode",
    "decode C = bsz",
    "speculative",
    "mixed",
    "chunked prefill",
    "idle",
    "all idle",
    "bad lengths",
    "negative block",
    "index past width",
    "padding",
    "capacity < tokens",
    "capacity < bsz",
    "odd block sizes",
    "big ids",
]


def _case(bsz: int, kind: str, seed: int, num_caches: int = 1) -> dict:
    """One step of ``bsz`` requests of a named kind (block sizes kept >= 3 so tables stay small)."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.choice([16, 64, 96, 256])) for _ in range(num_caches)]
    kw: dict = dict(bsz=bsz, block_sizes=sizes)
    if kind.startswith("decode") or kind in ("bad lengths", "negative block", "index past width", "padding"):
        kw["mix"] = ("decode",)
    elif kind == "speculative":
        kw.update(mix=("decode",), uniform=2)
    elif kind == "chunked prefill":
        kw["mix"] = ("continue", "decode", "prefill")
    elif kind == "idle":
        kw["mix"] = ("idle", "decode")
    elif kind == "all idle":
        kw["mix"] = ("idle",)
    elif kind == "odd block sizes":
        kw["block_sizes"] = [3, 96, 7, 1000][: max(num_caches, 1)]
    elif kind == "big ids":
        kw.update(big_ids=True, mix=("decode", "spec"))
    case = random_step(rng, **kw)
    dec, q = case["seq_lens_decoder"], case["seq_lens_this_time"]
    tables = case["block_tables"]
    tables = list(tables) if isinstance(tables, list) else [tables] * len(case["block_sizes"])
    if kind == "decode C = bsz":
        case["capacity"] = bsz
    elif kind == "bad lengths":  # bit 8, in the first, a middle and the last request (the last warp)
        dec[0] = -1
        q[bsz // 2] = -5
        dec[bsz - 1] = -(2**31)
    elif kind == "negative block":  # bit 2 in two requests of different blocks
        for b in (bsz - 1, bsz // 3):
            for g, t in enumerate(tables):
                col = int(dec[b]) // case["block_sizes"][g]
                if col < t.shape[1]:
                    if not t.flags.writeable:
                        t = np.array(t)
                        tables[g] = t
                    t[b, col] = -1
        case["block_tables"] = tables
    elif kind == "index past width":  # bit 1
        dec[bsz - 2] += tables[0].shape[1] * case["block_sizes"][0]
        dec[5] += 3 * tables[0].shape[1] * case["block_sizes"][0]
    elif kind == "padding":
        case["capacity"] = bsz + 777
    elif kind == "capacity < tokens":
        case = random_step(rng, **dict(kw, mix=("decode", "spec", "prefill")))
        total = int(np.clip(case["seq_lens_this_time"], 0, None).sum())
        case["capacity"] = max(1, total - int(rng.integers(1, 50)))
    elif kind == "capacity < bsz":  # a decode batch larger than the capacity: bit 4
        case["capacity"] = bsz - 37
    return case


def _planner(case, position_dtype=np.int64, max_requests=None):
    from kvaddr import StepPlanner

    bsz = case["seq_lens_decoder"].shape[0]
    return StepPlanner(
        max(max_requests or bsz, 1), case["capacity"], case["block_sizes"], position_dtype=position_dtype
    )


def _run(case, label, position_dtype=np.int64, max_requests=None, dev=None):
    import cupy

    from kvaddr import dispatch

    ref = reference(case, position_dtype=position_dtype)
    dev = to_device(case) if dev is None else dev
    p = _planner(case, position_dtype, max_requests)
    bsz = case["seq_lens_decoder"].shape[0]
    name, blocks, threads = p.kernel_for(bsz)
    launch = dispatch.step_launch(p.config, bsz)
    assert (name, blocks, threads) == (launch.kernel, launch.blocks, launch.threads), label
    if 256 < bsz <= 4096:
        assert name.startswith("step_wide<"), f"{label}: {name}"
    poison(p)
    tables = dev["block_tables"] if case["block_sizes"] else None
    out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], tables)
    cupy.cuda.get_current_stream().synchronize()
    assert_outputs_equal(out, ref.outputs, f"{label} [{name} {blocks}x{threads}]")
    assert p.errors() == (ref.error_mask, ref.error_key), f"{label} [{name}]: error record"
    return p, ref


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bsz", SIZES)
def test_wide_kernel_against_the_reference(bsz, kind):
    case = _case(bsz, kind, seed=bsz * 131 + KINDS.index(kind))
    _, ref = _run(case, f"{kind} bsz {bsz}")
    if kind in ("bad lengths",):
        assert ref.error_mask & 8
    elif kind == "negative block":
        assert ref.error_mask & 2
    elif kind == "index past width":
        assert ref.error_mask & 1
    elif kind.startswith("capacity"):
        assert ref.error_mask & 4
    elif kind in ("decode", "decode C = bsz", "speculative", "padding"):
        assert ref.error_mask == 0


@pytest.mark.parametrize("kind", ["decode", "decode C = bsz", "mixed", "bad lengths", "capacity < bsz"])
@pytest.mark.parametrize("bsz", [257, 512, 513, 1024, 1025, 2048, 4096])
def test_every_requests_per_thread(bsz, kind):
    """Both ends of each R the dispatch table picks (4, 8, 16 requests per thread)."""
    case = _case(bsz, kind, seed=7 * bsz)
    _run(case, f"{kind} bsz {bsz}")


@pytest.mark.parametrize("num_caches", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("position_dtype", [np.int64, np.int32])
def test_every_cache_count_and_position_dtype(num_caches, position_dtype):
    for bsz, kind in ((300, "mixed"), (1024, "decode C = bsz"), (4096, "decode"), (2048, "negative block")):
        case = _case(bsz, kind, seed=bsz + num_caches, num_caches=max(num_caches, 1))
        if num_caches == 0:
            case = dict(case, block_tables=np.zeros((bsz, 1), np.int32), block_sizes=[])
        p, _ = _run(case, f"{kind} {num_caches} caches", position_dtype=position_dtype)
        assert p.config.num_caches == num_caches and p.config.position_int64 == (position_dtype == np.int64)


def test_block_ids_near_2_31_and_positions_near_the_int32_limit():
    rng = np.random.default_rng(31)
    for bsz in (300, 4096):
        case = random_step(rng, bsz=bsz, block_sizes=[2**20, 64], mix=("decode",), big_ids=True)
        case["seq_lens_decoder"][: bsz // 2] = 2**31 - 2  # position 2**31 - 2, block index 2047 of 2**20
        for g, t in enumerate(case["block_tables"]):
            need = (2**31 - 2) // case["block_sizes"][g] + 1
            if t.shape[1] < need and g == 0:
                full = np.full((t.shape[0], need), BIG_BLOCK - 1, np.int32)
                full[:, : t.shape[1]] = t
                case["block_tables"][g] = full
        _run(case, f"big positions bsz {bsz}", max_requests=bsz + 5)


def test_length_arrays_not_16_byte_aligned():
    """Length arrays at a 4-byte offset: the kernel's scalar loads instead of int4."""
    import cupy

    for bsz, kind in ((1024, "decode"), (4096, "mixed"), (2048, "bad lengths")):
        case = _case(bsz, kind, seed=bsz)
        dev = to_device(case)
        for key in ("seq_lens_decoder", "seq_lens_this_time"):
            host = np.concatenate([np.array([12345], np.int32), case[key]])
            dev[key] = cupy.asarray(host)[1:]
            assert dev[key].data.ptr % 16 == 4
        cupy.cuda.runtime.deviceSynchronize()
        _run(case, f"unaligned {kind} bsz {bsz}", dev=dev)


def test_a_planner_larger_than_the_batch():
    """max_requests and the table rows beyond bsz: nothing past bsz is read (garbage there)."""
    import cupy

    for bsz, kind in ((511, "decode"), (1025, "mixed"), (4095, "decode C = bsz")):
        case = _case(bsz, kind, seed=bsz + 1)
        dev = to_device(case)
        for key in ("seq_lens_decoder", "seq_lens_this_time"):
            host = np.concatenate([case[key], np.full(100, 7, np.int32)])
            dev[key] = cupy.asarray(host)[:bsz]
        cupy.cuda.runtime.deviceSynchronize()
        _run(case, f"larger planner {kind} bsz {bsz}", max_requests=4096, dev=dev)


def test_switching_kernels_leaves_no_stale_error_record():
    """An erroneous step in one kernel, then a clean one in another (every order of the small
    kernel, the across-blocks kernel at two R, the multi-block kernel forced at 1000 requests and
    above 4096): the clean step's error record is clean whichever kernel wrote the previous one."""
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(16)
    C = 6000
    steps = {}
    for bsz in (200, 1000, 4096, 5000):
        bad = random_step(rng, bsz=bsz, block_sizes=[16, 96], errors=True, mix=("decode", "spec"))
        bad["seq_lens_decoder"][bsz - 1] = -1  # the last warp too
        good = random_step(rng, bsz=bsz, block_sizes=[16, 96], mix=("decode",))
        for case in (bad, good):
            case["capacity"] = C
        steps[bsz] = (bad, good)
    p = StepPlanner(5000, C, [16, 96])
    # (kernel, bsz): the dispatch table's at 200, 1000 and 4096 requests, the multi-block kernel
    # forced at 1000, the table's multi-block kernel at 5000
    runs = [("dispatch", 200), ("dispatch", 1000), ("dispatch", 4096), ("multiblock", 1000), ("dispatch", 5000)]
    for a in runs:
        for b in runs:
            if a == b:
                continue
            for (version, bsz), which in ((a, 0), (b, 1)):
                force_multiblock(p, version == "multiblock")
                case = steps[bsz][which]
                ref = reference(case)
                dev = to_device(case)
                out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
                cupy.cuda.get_current_stream().synchronize()
                label = f"{a} then {b}: {version} bsz {bsz} ({p.kernel_for(bsz)[0]})"
                assert_outputs_equal(out, ref.outputs, label)
                assert p.errors() == (ref.error_mask, ref.error_key), f"{label}: error record"
                assert bool(ref.error_mask) == (which == 0), label


def test_graph_replay_and_bind_follow_changing_inputs():
    import cupy

    from kvaddr import StepPlanner

    rng = np.random.default_rng(1024)
    bsz, rows = 1000, 1010
    cases = [random_step(rng, bsz=bsz, block_sizes=[64, 16], shared_table=False, errors=i == 1) for i in range(3)]
    cases.append(random_step(rng, bsz=bsz, block_sizes=[64, 16], shared_table=False, mix=("decode",)))
    cap = max(c["capacity"] for c in cases)
    width = max(t.shape[1] for c in cases for t in c["block_tables"])
    p = StepPlanner(rows, cap, [64, 16])
    assert p.kernel_for(bsz)[0].startswith("step_wide<")  # across blocks, whatever R the table picks
    d = cupy.zeros(rows, np.int32)
    q = cupy.zeros(rows, np.int32)
    d_v, q_v = d[:bsz], q[:bsz]  # the step's views of the persistent buffers (one object each)
    tables = [cupy.full((rows, width), -1, np.int32) for _ in range(2)]
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    bound = p.bind(d, q, tables, stream=stream)
    with stream:
        p.compute(d_v, q_v, tables, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        p.compute(d_v, q_v, tables, stream=stream)
        graph = stream.end_capture()
    for i, c in enumerate(cases):
        c = dict(c, capacity=cap)
        host_tables = []
        for g in range(2):
            t = c["block_tables"][g]
            full = np.full((rows, width), -1, np.int32)
            full[: t.shape[0], : t.shape[1]] = t
            host_tables.append(full)
        ref = reference(dict(c, block_tables=host_tables))
        with stream:
            d_v.set(c["seq_lens_decoder"], stream=stream)
            q_v.set(c["seq_lens_this_time"], stream=stream)
            for g in range(2):
                tables[g].set(host_tables[g], stream=stream)
            graph.launch(stream)
        stream.synchronize()
        assert_outputs_equal(p._outputs(bsz), ref.outputs, f"replay {i}")
        assert p.errors(stream) == (ref.error_mask, ref.error_key), f"replay {i}"
        poison(p)
        cupy.cuda.runtime.deviceSynchronize()
        out = bound.launch(bsz)
        stream.synchronize()
        assert_outputs_equal(out, ref.outputs, f"bound {i}")
        assert p.errors(stream) == (ref.error_mask, ref.error_key), f"bound {i}"


@settings(max_examples=min(300, int(os.environ.get("KVADDR_GPU_EXAMPLES", "120"))), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    bsz=st.sampled_from([257, 258, 300, 511, 512, 513, 1000, 1024, 1025, 2047, 2048, 2049, 3333, 4095, 4096]),
    errors=st.booleans(),
    over=st.booleans(),
    big=st.booleans(),
    uniform=st.sampled_from([None, None, 0, 1, 1, 2, 5]),
    mix=st.sampled_from([None, ("decode",), ("decode", "spec", "idle"), ("continue", "idle")]),
    num_caches=st.integers(1, 4),
)
def test_hypothesis_wide_steps(seed, bsz, errors, over, big, uniform, mix, num_caches):
    rng = np.random.default_rng(seed)
    sizes = [int(rng.choice([3, 16, 64, 96, 256])) for _ in range(num_caches)]
    case = random_step(
        rng, bsz=bsz, block_sizes=sizes, errors=errors, over_capacity=over, big_ids=big, uniform=uniform, mix=mix
    )
    if uniform == 1 and not over and rng.integers(0, 2):
        case["capacity"] = bsz  # the decode rows of floor_step.py
    _run(case, f"seed {seed}", max_requests=bsz + int(rng.integers(0, 3)))
