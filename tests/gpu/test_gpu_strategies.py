"""Every GPU strategy equals the reference, element for element (needs a CUDA GPU)."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.errors import StrategyLimitExceeded
from kvaddr.reference import step_addressing
from tests.support.gpu import assert_outputs_equal, poison, reference, requires_gpu, to_device
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, million_token_step, random_step

pytestmark = requires_gpu

NAMES = ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused")


def run(name, case, *, layers=2, position_dtype=np.int64, max_requests=None, capacity=None):
    from kvaddr.strategies.gpu import make_strategy

    dev = to_device(case)
    bsz = len(case["seq_lens_decoder"])
    s = make_strategy(
        name,
        max_requests=max_requests or max(bsz, 1),
        capacity=capacity or case["capacity"],
        block_sizes=case["block_sizes"],
        num_layers=layers,
        position_dtype=position_dtype,
    )
    poison(s)
    out = s.step(
        dev["seq_lens_decoder"],
        dev["seq_lens_this_time"],
        dev["block_tables"],
        seq_lens_encoder=dev.get("seq_lens_encoder"),
    )
    return s, out


def positions_reference(case):
    """bits 4 and 8 of the step and their first record: what the baselines record."""
    return step_addressing(case["seq_lens_decoder"], case["seq_lens_this_time"], None, [], case["capacity"])


def check_case(case, label, names=NAMES, **kw):
    ref = reference(case, kw.get("position_dtype", np.int64))
    bsz = len(case["seq_lens_decoder"])
    for name in names:
        if name == "one-block" and bsz > 1024:  # one block of one thread per request
            with pytest.raises(StrategyLimitExceeded, match=f"one-block runs at most 1024 requests .*bsz={bsz}$"):
                run(name, case, **kw)
            continue
        s, out = run(name, case, **kw)
        assert_outputs_equal(out, ref.outputs, f"{label}/{name}")
        if name == "one-block":  # its own kernel records bits 4 and 8, with their first record
            pos = positions_reference(case)
            assert s.errors() == (pos.error_mask, pos.error_key), f"{label}/one-block: error record"
        elif name == "fused":
            assert s.planner.errors() == (ref.error_mask, ref.error_key), f"{label}: error record"
        else:  # the position kernel records bits 4 and 8 only
            mask, _ = s.positions.errors()
            assert mask == ref.error_mask & 12, f"{label}/{name}: error bits"


@pytest.mark.parametrize("name,case,expected", WORKED_EXAMPLES, ids=[w[0] for w in WORKED_EXAMPLES])
def test_worked_examples(name, case, expected):
    check_case(case, name)


@pytest.mark.parametrize("label", sorted(edge_cases()))
def test_edge_cases(label):
    check_case(edge_cases()[label], label)


@pytest.mark.parametrize("label", ["example-1", "block-size-96", "5000-mixed"])
def test_int32_positions(label):
    case = WORKED_EXAMPLES[0][1] if label == "example-1" else edge_cases()[label]
    check_case(case, label, position_dtype=np.int32)


def test_million_tokens():
    check_case(million_token_step(), "1M tokens", names=("per-layer-kernel", "one-block", "fused"), layers=1)


def test_capacity_larger_than_the_batch_pads_everything_else():
    case = edge_cases()["5000-mixed"]
    case = dict(case, capacity=case["capacity"] + 3000)
    check_case(case, "padded", names=("fused", "per-layer-kernel", "one-block"))


@pytest.mark.parametrize("bsz", [0, 1, 31, 1023, 1024])
@pytest.mark.parametrize("position_dtype", [np.int64, np.int32])
def test_one_block_at_its_limits(bsz, position_dtype):
    """0 requests (one thread), 1, a partial warp, and the full block of 1024; padding far past the tokens."""
    rng = np.random.default_rng(bsz)
    case = random_step(rng, bsz=bsz, errors=bsz % 2 == 1, mix=("decode", "spec", "idle", "prefill"))
    case = dict(case, capacity=case["capacity"] + 5000)
    check_case(case, f"one-block bsz {bsz}", names=("one-block",), position_dtype=position_dtype)


def test_one_block_refuses_1025_requests_and_keeps_working():
    from kvaddr.strategies.gpu import make_strategy

    s = make_strategy("one-block", max_requests=2000, capacity=3000, block_sizes=[16])
    big = to_device(random_step(np.random.default_rng(0), bsz=1025, block_sizes=[16]))
    with pytest.raises(StrategyLimitExceeded) as exc:
        s.step(big["seq_lens_decoder"], big["seq_lens_this_time"], big["block_tables"])
    assert str(exc.value) == "one-block runs at most 1024 requests (one block of one thread per request), got bsz=1025"
    case = random_step(np.random.default_rng(1), bsz=1024, block_sizes=[16])
    case["capacity"] = 3000
    dev = to_device(case)
    out = s.step(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    assert_outputs_equal(out, reference(case).outputs, "one-block after a refused step")


@settings(max_examples=int(os.environ.get("KVADDR_GPU_EXAMPLES", "500")), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    errors=st.booleans(),
    over=st.booleans(),
    big=st.booleans(),
    large=st.integers(0, 9),
    uniform=st.sampled_from([None, None, None, 0, 1, 2, 5]),
)
def test_random_steps(seed, errors, over, big, large, uniform):
    rng = np.random.default_rng(seed)
    max_bsz = 6000 if large == 0 else 300  # every tenth step takes the large-batch path
    case = random_step(rng, max_bsz=max_bsz, errors=errors, over_capacity=over, big_ids=big, uniform=uniform)
    check_case(case, f"seed {seed}", layers=1)


def test_planner_reused_across_steps_never_keeps_stale_values():
    """One planner, 300 consecutive steps of varying shape (both paths): no stale element."""
    from kvaddr import StepPlanner

    rng = np.random.default_rng(1)
    planner = StepPlanner(max_requests=9000, capacity=4096, block_sizes=[64, 16])
    for i in range(300):
        bsz = int(rng.choice([0, 3, 64, 700, 4096, 4097, 9000]))
        case = random_step(
            rng,
            bsz=bsz,
            block_sizes=[64, 16],
            shared_table=False,
            errors=i % 3 == 0,
            mix=("decode", "idle", "spec") if bsz > 500 else None,
        )
        case["capacity"] = 4096
        dev = to_device(case)
        out = planner.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        ref = reference(case)
        assert_outputs_equal(out, ref.outputs, f"step {i} (bsz {bsz})")
        assert planner.errors() == (ref.error_mask, ref.error_key), f"step {i}"


def test_one_block_check_raises_for_bits_4_and_8_only():
    from kvaddr import AddressingError

    s, _ = run("one-block", WORKED_EXAMPLES[1][1])  # a block-index error (bit 1): not recorded by one-block
    s.check()
    case = dict(WORKED_EXAMPLES[0][1])
    case["seq_lens_this_time"] = case["seq_lens_this_time"].copy()
    case["seq_lens_this_time"][1] = -1
    s, _ = run("one-block", case)
    with pytest.raises(AddressingError, match="request 1.*negative seq_lens_decoder or seq_lens_this_time"):
        s.check()


def test_check_raises_naming_request_token_and_reason():
    from kvaddr import AddressingError

    s, _ = run("fused", WORKED_EXAMPLES[1][1])
    with pytest.raises(AddressingError, match="token 3 of request 1, cache 0: block index beyond"):
        s.check()
    s, _ = run("fused", WORKED_EXAMPLES[0][1])
    s.check()  # no error
