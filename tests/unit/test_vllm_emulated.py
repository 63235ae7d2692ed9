"""kernels.cu's vLLM device code, emulated on the CPU (tests/support/vllm_emulator.py),
driven by the real VllmStepPlanner / VllmThreeLaunch host code behind a fake CuPy, against
the NumPy reference: every output element, the error mask and the first-bad key, across
sequences of steps (stale rows, the device row count). Skips without a C++ compiler.
The same comparisons run on a real GPU in tests/gpu/test_vllm_step.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr import dispatch
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_emulator
from tests.support.vllm_cases import assert_same, corrupt, new_batch, planner_kwargs, random_case, worked_example
from tests.support.vllm_fake_cupy import install, on_fake

pytestmark = pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


@pytest.fixture
def emu(monkeypatch):
    return install(monkeypatch, on_launch=vllm_emulator.run)


def _host(out):
    return {k: (tuple(t.a.copy() for t in v) if isinstance(v, tuple) else v.a.copy()) for k, v in out.as_dict().items()}


def check(impl, cfg, x, padded=None, errors=True, label="", pin=None):
    """With ``pin`` (the fake's): num_blocks in (fake) pinned host memory, one [G, rows] array, which
    the one-launch planner stages (the copy kernel, then the step reading the copy)."""
    args = on_fake(x)
    if pin is not None:
        args["num_blocks"] = pin(np.stack(x["num_blocks"]).astype(np.int32))
    out = impl.compute(*(args[k] for k in NAMES), num_reqs_padded=padded)
    if pin is not None:
        assert impl.staged and impl.launches_per_step == 2, label
    want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded)
    assert_same(_host(out), want.outputs.as_dict(), label)
    if errors:
        assert impl.errors() == (want.error_mask, want.error_key), label
    return want


def _impls(cfg):
    """The one-launch planner and the three-launch baseline of ``cfg``."""
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    return VllmStepPlanner(**planner_kwargs(cfg)), VllmThreeLaunch(**planner_kwargs(cfg))


def test_worked_example(emu):
    cfg, x = worked_example()
    one, three = _impls(cfg)
    check(one, cfg, x)
    check(three, cfg, x, errors=False)
    assert [L["name"] for L in emu.launches] == [
        dispatch.vllm_kernel(False),
        "kvaddr_vllm3_prepare",
        "kvaddr_vllm3_gather",
        "kvaddr_vllm3_slots",
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp(emu, rank):
    cfg, x = worked_example(cp_size=2, cp_rank=rank)
    one, three = _impls(cfg)
    check(one, cfg, x)
    check(three, cfg, x, errors=False)


@settings(max_examples=60)
@given(st.data())
def test_random_steps_match_the_reference(data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    G = data.draw(st.integers(1, 4))
    block_sizes = tuple(data.draw(st.lists(st.sampled_from([1, 4, 13, 16, 64]), min_size=G, max_size=G)))
    cp = data.draw(st.sampled_from([1, 2, 4]))
    sharded = [data.draw(st.booleans()) for _ in range(G)]
    il = 1
    if cp > 1 and any(sharded) and data.draw(st.booleans()):
        il = min(b for b, s in zip(block_sizes, sharded) if s)
        if any(b % il for b, s in zip(block_sizes, sharded) if s):
            il = 1
    M = data.draw(st.integers(1, 48))
    max_query = data.draw(st.sampled_from([1, 5, 40]))
    cfg, state = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=M,
        block_sizes=block_sizes,
        max_query=max_query,
        cp_size=cp,
        cp_rank=data.draw(st.integers(0, cp - 1)),
        cp_interleave=il,
        dcp_sharded=sharded,
        slot_mapping_enabled=[data.draw(st.booleans()) for _ in range(G)],
        sliding_window_reach=[0 if (cp > 1 and s) else data.draw(st.sampled_from([0, 9])) for s in sharded],
        idx_dtype=data.draw(st.sampled_from([np.int32, np.int64])),
        slot_dtype=data.draw(st.sampled_from([np.int32, np.int64])),
        spare_tokens=M * max_query,
    )
    with pytest.MonkeyPatch.context() as mp:
        ns = install(mp, on_launch=vllm_emulator.run)
        _steps(data, rng, cfg, state, M, max_query, seed, ns.pin if data.draw(st.booleans()) else None)


def _steps(data, rng, cfg, state, M, max_query, seed, pin):
    """Three steps; with ``pin``, num_blocks in pinned host memory for the one-launch planner."""
    one, three = _impls(cfg)
    bad = data.draw(st.booleans())
    for step in range(3):
        n = data.draw(st.integers(0, M))
        x = new_batch(rng, cfg, state, n, max_query=max_query)
        padded = data.draw(st.integers(n, M))
        if bad:
            x = corrupt(rng, cfg, x, rate=0.1)
        label = f"seed {seed}, step {step}"
        check(one, cfg, x, padded, label=label, pin=pin)
        if not bad:
            check(three, cfg, x, padded, errors=False, label=label)


def test_stale_rows(emu):
    rng = np.random.default_rng(3)
    cfg, state = random_case(rng, max_num_reqs=64, num_reqs=64, block_sizes=(4, 16), max_query=6, spare_tokens=400)
    one, three = _impls(cfg)
    for n in [64, 5, 40, 0, 63, 1, 30]:
        x = new_batch(rng, cfg, state, n, max_query=6)
        padded = min(64, n + int(rng.integers(0, 9)))
        check(one, cfg, x, padded, label=f"one, num_reqs {n}")
        check(three, cfg, x, padded, errors=False, label=f"three, num_reqs {n}")
        # every row past the batch is clean (fill 0), the batch's rows hold what they hold
        assert (one._row_fill.a[:, n:] == 0).all()


def test_bad_input_matrix_device_rows(emu):
    from kvaddr.engines.vllm_config import VllmStepConfig
    from tests.support.vllm_bad_input_matrix import ROWS

    for row in ROWS:
        if row.kind not in ("device", "valid"):
            continue
        cfg_kw, x = row.make()
        cfg = VllmStepConfig(**cfg_kw)
        one, _ = _impls(cfg)
        want = check(one, cfg, x, row.num_reqs_padded, label=row.id)
        assert want.error_mask == row.bits, row.id


def test_large_decode_batch(emu):
    rng = np.random.default_rng(8)
    cfg, x = random_case(rng, max_num_reqs=5000, num_reqs=4500, block_sizes=(16, 64), max_query=1, dummy_fraction=0.1)
    one, three = _impls(cfg)
    check(one, cfg, x, 4600)
    check(three, cfg, x, 4600, errors=False)


@pytest.mark.parametrize("pinned", [False, True], ids=["device", "pinned"])
def test_batch_sizes_at_each_edge_of_the_shared_memory_copy(pinned, monkeypatch):
    """Below 2048 requests each token block copies the batch into shared memory (1, 2, 4 or 8
    entries a thread; query_start_loc[num_reqs] by one thread when num_reqs fills them), from
    2048 it searches global memory: decode, mixed and corrupted batches on each side of every
    edge, one planner, against the reference (the GPU test of the same name runs the kernel)."""
    ns = install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(33)
    M = 2100
    cfg, state = random_case(
        rng, max_num_reqs=M, num_reqs=M, block_sizes=(16, 64), max_query=9, max_context=5000, spare_tokens=9 * M
    )
    one, _ = _impls(cfg)
    for n in (1, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049):
        for max_query, bad in ((1, False), (9, False), (9, True)):
            x = new_batch(rng, cfg, state, n, max_query=max_query)
            if bad:
                x = corrupt(rng, cfg, x, rate=0.02)
            label = f"{n} requests, max_query {max_query}" + (", corrupted" if bad else "")
            check(one, cfg, x, min(M, n + 3), label=label, pin=ns.pin if pinned else None)


def test_caller_out_tables_are_zeroed_in_full_then_kept_clean(emu):
    from kvaddr.engines.vllm import VllmStepPlanner
    from tests.support.vllm_fake_cupy import FakeArray

    rng = np.random.default_rng(12)
    cfg, state = random_case(rng, max_num_reqs=40, num_reqs=40, block_sizes=(4, 16), max_query=5, spare_tokens=300)
    tables = [FakeArray(np.full((40, w), 77, np.int32)) for w in cfg.widths]
    one = VllmStepPlanner(**planner_kwargs(cfg), out={"input_block_tables": tables})
    for n in [10, 0, 40, 3]:
        x = new_batch(rng, cfg, state, n, max_query=5)
        check(one, cfg, x, min(40, n + 4), label=f"num_reqs {n}")
    assert one.outputs.input_block_tables[0] is tables[0]
