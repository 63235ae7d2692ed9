"""The NumPy strategies (the profiler's CPU path) equal the reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaddr.constants import ONE_BLOCK_MAX_REQUESTS
from kvaddr.errors import ERR_CAPACITY, ERR_NEGATIVE_LENGTH, AddressingError, StrategyLimitExceeded
from kvaddr.outputs import OUTPUT_FIELDS
from kvaddr.reference import step_addressing
from kvaddr.strategies import cpu as cpu_strategies
from tests.support.spec_doc import example_case, spec_examples
from tests.support.step_cases import edge_cases, random_step


def check_all(case, layers=2):
    ref = step_addressing(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    bsz = max(1, len(case["seq_lens_decoder"]))
    for name in cpu_strategies.STRATEGY_NAMES:
        s = cpu_strategies.make_strategy(
            name, max_requests=bsz, capacity=case["capacity"], block_sizes=case["block_sizes"], num_layers=layers
        )
        if name == "one-block" and bsz > ONE_BLOCK_MAX_REQUESTS:
            with pytest.raises(StrategyLimitExceeded, match=f"one-block runs at most 1024 requests .*bsz={bsz}"):
                s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"])
            continue
        out = s.step(
            case["seq_lens_decoder"],
            case["seq_lens_this_time"],
            case["block_tables"],
            seq_lens_encoder=case.get("seq_lens_encoder"),
        )
        for f in OUTPUT_FIELDS:
            np.testing.assert_array_equal(getattr(out, f), getattr(ref.outputs, f), err_msg=f"{name}: {f}")
        assert s.launches_per_step >= 1


def check_one_block_errors(case):
    """one-block records bits 4 and 8 exactly as the reference does (the position-only reference)."""
    bsz = len(case["seq_lens_decoder"])
    want = step_addressing(case["seq_lens_decoder"], case["seq_lens_this_time"], None, [], case["capacity"])
    s = cpu_strategies.make_strategy(
        "one-block", max_requests=max(1, bsz), capacity=case["capacity"], block_sizes=case["block_sizes"]
    )
    s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"])
    assert s.errors() == (want.error_mask, want.error_key)
    if want.error_mask:
        with pytest.raises(AddressingError) as exc:
            s.check()
        assert (exc.value.mask, exc.value.token, exc.value.request) == (
            want.error_mask,
            *want.first_bad[:2],
        )
    else:
        s.check()


SMALL_EDGE_CASES = [n for n in sorted(edge_cases()) if len(edge_cases()[n]["seq_lens_decoder"]) <= 1024]


@pytest.mark.parametrize("name", SMALL_EDGE_CASES)
def test_one_block_error_record_is_the_position_kernels(name):
    check_one_block_errors(edge_cases()[name])


@given(seed=st.integers(0, 2**32 - 1))
def test_one_block_error_record_random(seed):
    check_one_block_errors(random_step(np.random.default_rng(seed), max_bsz=20, errors=True))


def test_one_block_limit_is_1024_requests():
    s = cpu_strategies.make_strategy("one-block", max_requests=2048, capacity=2048, block_sizes=[16])
    table = np.zeros((2048, 1), dtype=np.int32)
    ones = np.ones(1024, dtype=np.int32)
    out = s.step(ones * 0, ones, table)  # 1024 requests: the largest it runs
    assert int(out.num_tokens) == 1024 and (out.batch_id_per_token[:1024] == np.arange(1024)).all()
    ones = np.ones(1025, dtype=np.int32)
    with pytest.raises(StrategyLimitExceeded) as exc:
        s.step(ones * 0, ones, table)
    assert str(exc.value) == "one-block runs at most 1024 requests (one block of one thread per request), got bsz=1025"


@pytest.mark.parametrize("name", [n for n in sorted(edge_cases()) if not n.startswith("16384")])
def test_edge_cases(name):
    check_all(edge_cases()[name])


@given(seed=st.integers(0, 2**32 - 1), errors=st.booleans())
def test_random_steps(seed, errors):
    check_all(random_step(np.random.default_rng(seed), max_bsz=20, errors=errors), layers=1)


def test_launch_counts():
    case = edge_cases()["block-size-64"]
    counts = {}
    for name in cpu_strategies.STRATEGY_NAMES:
        s = cpu_strategies.make_strategy(
            name, max_requests=64, capacity=case["capacity"], block_sizes=case["block_sizes"], num_layers=61
        )
        s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"])
        counts[name] = s.launches_per_step
    assert counts == {
        "per-layer": 1 + 61 * 2 * 9,
        "per-layer-kernel": 1 + 61 * 2,
        "hoisted": 1 + 9,
        "one-block": 1,
        "fused": 1,
    }


def test_unknown_strategy_is_named():
    with pytest.raises(
        ValueError, match="strategy must be one of per-layer, per-layer-kernel, hoisted, one-block, fused"
    ):
        cpu_strategies.make_strategy("magic", max_requests=1, capacity=1, block_sizes=[16])


@pytest.mark.parametrize("ex", spec_examples(), ids=lambda ex: ex["name"])
def test_one_block_gives_the_spec_pages_worked_examples(ex):
    """docs/spec.md's worked examples through the CPU one-block: the page's outputs; its error
    record holds the page's bits 4 and 8 only."""
    case = example_case(ex)
    s = cpu_strategies.make_strategy(
        "one-block",
        max_requests=max(1, len(case["seq_lens_decoder"])),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
    )
    out = s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"])
    for f in OUTPUT_FIELDS:
        np.testing.assert_array_equal(getattr(out, f), np.asarray(ex["outputs"][f]), err_msg=f)
    assert s.errors()[0] == ex["error_mask"] & (ERR_CAPACITY | ERR_NEGATIVE_LENGTH)
