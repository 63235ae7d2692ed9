"""The profiler's vLLM draft rows (kvaddr.measure.vllm_draft_profile) on the CPU: the verify steps
it builds are valid for the reference (every shape kind), ``--engine vllm --spec-tokens K`` is an
accepted setting, and the rendering says what was measured. The GPU run (the check of the one
launch against vLLM's per-draft-step design, then the timing) is in tests/gpu/test_vllm_draft_gpu.py."""

from __future__ import annotations

import io
import types

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


@pytest.fixture
def emulated(monkeypatch):
    """The draft kernels emulated behind the fake CuPy (every launch runs the one-launch emulation,
    so the per-step design's launches end with the same outputs); timing by a stand-in that calls
    the cycle and returns its number of calls."""
    from tests.support import vllm_draft_emulator

    if vllm_draft_emulator.CXX is None:
        pytest.skip("no C++ compiler: kernel emulation skipped")
    fake = vllm_draft_emulator.install(monkeypatch)
    cupy = __import__("sys").modules["cupy"]

    class Stream(cupy.cuda.Stream):  # (CuPy's constructor takes non_blocking)
        def __init__(self, non_blocking=False):
            pass

    monkeypatch.setattr(cupy.cuda, "Stream", Stream)
    calls = []

    def timer(fn, stream, budget_s):
        before = len(fake.launches)
        fn()
        calls.append(len(fake.launches) - before)
        return float(calls[-1])

    monkeypatch.setattr(vllm_draft_profile, "_graph_time", timer)
    return calls


def test_measure_checks_then_times_both_designs(emulated):
    from kvaddr.measure.vllm_profile import VllmProfileOptions

    opts = VllmProfileOptions(shapes=("decode:20", "mixed:40:600"), block_sizes=(16, 32), context=(50, 400))
    section = vllm_draft_profile.measure(opts, 3, budget_s=0.0)
    assert section["spec_tokens"] == 3 and [r["shape"] for r in section["rows"]] == ["decode:20", "mixed:40:600"]
    for r in section["rows"]:
        # the stand-in timer returns the launches of one cycle: 1 against 1 + 2 (k - 1) (+ G per step)
        assert r["addressing"]["kvaddr"]["us"] == 1 and r["addressing"]["per_step"]["us"] == 5
        assert r["metadata"]["kvaddr"]["us"] == 1 and r["metadata"]["per_step"]["us"] == 9
        assert r["metadata"]["per_step"]["launches"] == 9 and r["addressing"]["saving_us"] == 4
    assert emulated == [1, 5, 1, 9] * 2


def test_measure_refuses_designs_that_differ(emulated, monkeypatch):
    from kvaddr.errors import CheckFailed
    from kvaddr.measure.vllm_profile import VllmProfileOptions
    from kvaddr.strategies.vllm_draft_per_step import VllmDraftPerStep

    compute = VllmDraftPerStep.compute

    def off_by_one(self, *a, **kw):
        out = compute(self, *a, **kw)
        out.positions.a[0, 0] += 1
        return out

    monkeypatch.setattr(VllmDraftPerStep, "compute", off_by_one)
    with pytest.raises(CheckFailed, match="per-draft-step design differs from the one launch in positions"):
        vllm_draft_profile.measure(VllmProfileOptions(shapes=("decode:8",)), 2, budget_s=0.0)


class _Recorder:
    """A stream and output arrays that log the order of ``synchronize`` and ``get``."""

    def __init__(self, fields):
        self.log = []
        for f in fields:
            setattr(self, f, types.SimpleNamespace(get=lambda f=f: self.log.append(f"get {f}") or np.zeros(1)))

    def synchronize(self):
        self.log.append("synchronize")


def test_outputs_are_read_after_the_launch_stream_is_done():
    """The check reads the outputs only after the launches' stream finished: ``get()`` copies on
    CuPy's current stream, which does not wait for the profiler's non-blocking stream."""
    from kvaddr.measure import mtp_profile
    from kvaddr.outputs import OUTPUT_FIELDS

    rec = _Recorder(vllm_draft_profile.ADDRESSING)
    got = vllm_draft_profile._host(rec, vllm_draft_profile.ADDRESSING, rec)
    assert rec.log[0] == "synchronize" and len(rec.log) == 1 + len(vllm_draft_profile.ADDRESSING)
    assert sorted(got) == sorted(vllm_draft_profile.ADDRESSING)
    rec = _Recorder(OUTPUT_FIELDS)
    got = mtp_profile._host(rec, rec)
    assert rec.log[0] == "synchronize" and len(rec.log) == 1 + len(OUTPUT_FIELDS)
    assert sorted(got) == sorted(OUTPUT_FIELDS)
