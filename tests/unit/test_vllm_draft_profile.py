"""The profiler's vLLM draft rows (kvaddr.measure.vllm_draft_profile) on the CPU: the verify steps
it builds are valid for the reference (every shape kind), ``--engine vllm --spec-tokens K`` is an
accepted setting, and the rendering says what was measured. The GPU run (the check of the one
launch against vLLM's per-draft-step design, then the timing) is in tests/gpu/test_vllm_draft_gpu.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from kvaddr.engines.spec_reference import vllm_draft_reference
from kvaddr.measure import vllm_draft_profile
from kvaddr.measure.profile_run import ProfileConfig
from kvaddr.measure.vllm_workload import parse_shape


@pytest.mark.parametrize(
    ("text", "sizes", "k"), [("decode:64", (16,), 3), ("mixed:40:2000", (16, 64), 2), ("5", (8,), 5)]
)
def test_verify_batches_are_valid_for_the_reference(text, sizes, k):
    shape = parse_shape(text)
    x, s, N = vllm_draft_profile.verify_batch(shape, k, sizes, (100, 3000), np.random.default_rng(0))
    n = shape.num_reqs
    assert x["idx_mapping"].shape == (n,) and sorted(x["idx_mapping"].tolist()) == list(range(n))
    qlen = np.diff(x["query_start_loc"])
    if shape.kind == "mixed":
        assert (qlen != k + 1).sum() == n // 16 and int(x["query_start_loc"][-1]) <= shape.num_tokens
        assert (x["num_sampled"][qlen != k + 1] == 0).all()
    else:
        assert (qlen == k + 1).all()
    assert s["max_num_batched_tokens"] == x["verify_slot_mappings"].shape[1] == int(x["query_start_loc"][-1])
    want = vllm_draft_reference(
        x["idx_mapping"], x["query_start_loc"], x["seq_lens"], x["num_rejected"], x["num_sampled"],
        x["block_tables"], s["block_sizes"], x["verify_slot_mappings"], s["max_model_len"], k,
        num_blocks=x["num_blocks"], max_num_reqs=n, attention="flashinfer,varlen", kv_indices_capacity=N,
    )  # fmt: skip
    assert want.error_mask == 0
    assert (want.slot_mappings[:, :, :n] >= 0).all()  # every draft step's slot inside the allocated blocks


def test_spec_tokens_is_a_setting_of_the_vllm_engine():
    cfg = ProfileConfig(engine="vllm", spec_tokens=3)
    cfg.validate()
    assert cfg.recorded_options()["spec_tokens"] == 3
    assert ProfileConfig(spec_tokens=2).recorded_options()["spec_tokens"] == 2


def test_render_reports_the_saving_per_cycle():
    m = lambda one, per: {  # noqa: E731
        "kvaddr": {"launches": 1, "us": one},
        "per_step": {"launches": 5, "us": per},
        "saving_us": per - one,
        "ratio": per / one,
    }
    section = {
        "spec_tokens": 3,
        "engine": "vllm",
        "rows": [
            {
                "shape": "decode:64",
                "requests": 64,
                "spec_tokens": 3,
                "addressing": m(2.5, 8.0),
                "metadata": m(4.0, 16.0),
            }
        ],
    }
    buf = io.StringIO()
    vllm_draft_profile.render(Console(file=buf, width=200), section)
    text = buf.getvalue()
    assert "3 draft tokens per verify step" in text
    assert (
        "decode:64 addressing: per-draft-step 8.00 us (5 launches), kvaddr one launch 2.50 us: saving 5.50 us per cycle (3.2x)"
        in text
    )
    assert "decode:64 with attention metadata" in text and "saving 12.00 us" in text
