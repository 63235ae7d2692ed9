"""docs/spec.md's worked examples on the GPU: StepPlanner and every GPU strategy give the
page's outputs, and the fused step records the page's error mask and first bad record."""

import numpy as np
import pytest

from kvaddr.errors import NO_ERROR_KEY, error_key
from kvaddr.outputs import OUTPUT_FIELDS
from tests.support.gpu import poison, requires_gpu, to_device
from tests.support.spec_doc import example_case, spec_examples

pytestmark = requires_gpu

EXAMPLES = spec_examples()
NAMES = ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused")


def _want_key(ex):
    return NO_ERROR_KEY if ex["first_bad"] is None else error_key(*ex["first_bad"])


def _assert_page_outputs(out, ex, label):
    for name in OUTPUT_FIELDS:
        got = getattr(out, name)
        got = got.get() if hasattr(got, "get") else np.asarray(got)
        want = np.asarray(ex["outputs"][name])
        assert got.shape == want.shape, f"{label}: {name} shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"{label}: {name} = {got.tolist()}, the page says {want.tolist()}"


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex["name"])
def test_step_planner_gives_the_page(ex):
    from kvaddr import StepPlanner

    case = example_case(ex)
    dev = to_device(case)
    planner = StepPlanner(
        max_requests=max(len(case["seq_lens_decoder"]), 1), capacity=case["capacity"], block_sizes=case["block_sizes"]
    )
    out = planner.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    _assert_page_outputs(out, ex, f"{ex['name']}/StepPlanner")
    assert planner.errors() == (ex["error_mask"], _want_key(ex)), f"{ex['name']}: error record"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex["name"])
def test_every_gpu_strategy_gives_the_page(ex, name):
    from kvaddr.strategies.gpu import make_strategy

    case = example_case(ex)
    dev = to_device(case)
    s = make_strategy(
        name,
        max_requests=max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        num_layers=2,
    )
    poison(s)
    out = s.step(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    _assert_page_outputs(out, ex, f"{ex['name']}/{name}")
    if name == "fused":
        assert s.planner.errors() == (ex["error_mask"], _want_key(ex)), f"{ex['name']}: error record"
    elif name == "one-block":  # its own kernel records bits 4 and 8 only
        mask, _ = s.errors()
        assert mask == ex["error_mask"] & 12, f"{ex['name']}/one-block: error bits"
        return
    else:  # the position kernel records bits 4 and 8 only
        mask, _ = s.positions.errors()
        assert mask == ex["error_mask"] & 12, f"{ex['name']}/{name}: error bits"
