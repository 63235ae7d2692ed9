"""The NumPy strategies (the profiler's CPU path) equal the reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaddr.outputs import OUTPUT_FIELDS
from kvaddr.reference import step_addressing
from kvaddr.strategies import cpu as cpu_strategies
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
        out = s.step(
            case["seq_lens_decoder"],
            case["seq_lens_this_time"],
            case["block_tables"],
            seq_lens_encoder=case.get("seq_lens_encoder"),
        )
        for f in OUTPUT_FIELDS:
            np.testing.assert_array_equal(getattr(out, f), getattr(ref.outputs, f), err_msg=f"{name}: {f}")
        assert s.launches_per_step >= 1


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
    assert counts == {"per-layer": 1 + 61 * 2 * 9, "per-layer-kernel": 1 + 61 * 2, "hoisted": 1 + 9, "fused": 1}


def test_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="strategy must be one of per-layer, per-layer-kernel, hoisted, fused"):
        cpu_strategies.make_strategy("magic", max_requests=1, capacity=1, block_sizes=[16])
