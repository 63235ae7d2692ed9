"""The three-launch baseline (kvaddr/strategies/vllm_three_launch.py) equals the reference."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import assert_same, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

INPUT_NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


def run(three, cfg, inputs, padded, label):
    import cupy

    d = {k: ([cupy.asarray(x) for x in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in inputs.items()}
    cupy.cuda.runtime.deviceSynchronize()
    out = three.compute(*(d[k] for k in INPUT_NAMES), num_reqs_padded=padded)
    cupy.cuda.get_current_stream().synchronize()
    want = vllm_step_reference(cfg, **{k: inputs[k] for k in INPUT_NAMES}, num_reqs_padded=padded)
    assert want.error_mask == 0
    assert_same(out, want.outputs.as_dict(), label)


@pytest.mark.parametrize("block_sizes", [(16,), (16, 64), (1, 16, 64, 13)])
@pytest.mark.parametrize("max_query", [1, 40])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_three_launch_equals_the_reference_over_steps(block_sizes, max_query, cp):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    rng = np.random.default_rng(11)
    G = len(block_sizes)
    cfg, state = random_case(
        rng,
        max_num_reqs=400,
        num_reqs=400,
        block_sizes=block_sizes,
        max_query=max_query,
        cp_size=cp,
        cp_rank=cp - 1,
        cp_interleave=1,
        dcp_sharded=[g % 2 == 0 for g in range(G)],
        sliding_window_reach=[0 if (cp > 1 and g % 2 == 0) else 50 for g in range(G)],
        spare_tokens=400 * max_query,
    )
    three = VllmThreeLaunch(**planner_kwargs(cfg))
    assert three.launches_per_step == 3
    for step, n in enumerate([400, 30, 250, 0, 399]):
        inputs = new_batch(rng, cfg, state, n, max_query=max_query)
        run(three, cfg, inputs, min(400, n + 16), f"step {step}")


def test_three_launch_and_one_launch_agree_with_int64_idx_and_int32_slots():
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    cfg, inputs = random_case(
        np.random.default_rng(12), max_num_reqs=5000, num_reqs=4500, block_sizes=(16, 64), idx_dtype=np.int64,
        slot_dtype=np.int32,
    )  # fmt: skip
    for cls in (VllmThreeLaunch, VllmStepPlanner):
        run(cls(**planner_kwargs(cfg)), cfg, inputs, 4608, cls.__name__)
