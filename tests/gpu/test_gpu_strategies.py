"""Every GPU strategy equals the reference, element for element (needs a CUDA GPU)."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.gpu import assert_outputs_equal, poison, reference, requires_gpu, to_device
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, million_token_step, random_step

pytestmark = requires_gpu

NAMES = ("per-layer", "per-layer-kernel", "hoisted", "fused")


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


def check_case(case, label, names=NAMES, **kw):
    ref = reference(case, kw.get("position_dtype", np.int64))
    for name in names:
        s, out = run(name, case, **kw)
        assert_outputs_equal(out, ref.outputs, f"{label}/{name}")
        if name == "fused":
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
    check_case(million_token_step(), "1M tokens", names=("per-layer-kernel", "fused"), layers=1)


def test_capacity_larger_than_the_batch_pads_everything_else():
    case = edge_cases()["5000-mixed"]
    case = dict(case, capacity=case["capacity"] + 3000)
    check_case(case, "padded", names=("fused", "per-layer-kernel"))


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


def test_check_raises_naming_request_token_and_reason():
    from kvaddr import AddressingError

    s, _ = run("fused", WORKED_EXAMPLES[1][1])
    with pytest.raises(AddressingError, match="token 3 of request 1, cache 0: block index beyond"):
        s.check()
    s, _ = run("fused", WORKED_EXAMPLES[0][1])
    s.check()  # no error
