"""The vLLM engine profile's CPU-testable parts: shapes, workloads, rows, savings, JSON."""

import io

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from kvaddr.measure.timing import FLOOR, Measurement
from kvaddr.measure.vllm_profile import (
    CPU_REASON,
    ONE,
    THREE,
    VllmProfileOptions,
    VllmProfileUnavailable,
    VllmShapeResult,
    render_vllm,
    run_vllm_profile,
    savings,
    vllm_document,
)
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES, VllmShape, VllmWorkload, make_batch_set, parse_shape


def test_parse_shape():
    assert parse_shape("decode:64") == VllmShape("decode", 64, 64)
    assert parse_shape("1024") == VllmShape("decode", 1024, 1024)
    assert parse_shape("mixed:256:16384") == VllmShape("mixed", 256, 16384)
    assert parse_shape("mixed:256:16384").name == "mixed:256:16384"
    for bad in ("decode:0", "mixed:1:5", "mixed:8:4", "prefill:3", ""):
        with pytest.raises(ValueError, match="shape"):
            parse_shape(bad)


@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
@pytest.mark.parametrize(
    "workload",
    [
        VllmWorkload(input_sets=2),
        VllmWorkload(block_sizes=(16, 64), dummy_fraction=0.1, sliding_window_reach=256, input_sets=2),
        VllmWorkload(block_sizes=(16, 64), cp_size=4, cp_rank=3, cp_interleave=16, input_sets=2),
    ],
    ids=["one-group", "two-groups-dummies-swa", "dcp4"],
)
def test_workload_batches_are_clean_and_shaped(shape, workload):
    bs = make_batch_set(workload, parse_shape(shape))
    s = parse_shape(shape)
    for i, x in enumerate(bs.inputs):
        res = vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded)
        assert res.error_mask == 0
        st = bs.stats(i)
        assert st["num_reqs"] - st["dummies"] == s.num_reqs
        assert st["dummies"] == int(workload.dummy_fraction * s.num_reqs)
        if s.kind == "mixed":
            assert abs(st["num_tokens"] - st["dummies"] - s.num_tokens) <= s.num_reqs
        real = x["idx_mapping"][x["idx_mapping"] >= 0]
        assert len(np.unique(real)) == len(real) and bs.config.max_num_reqs >= 2 * len(real)
    assert bs.num_reqs_padded % 8 == 0 and bs.num_reqs_padded >= bs.num_reqs


def test_cpu_device_is_refused_with_a_reason():
    with pytest.raises(VllmProfileUnavailable, match="has no CPU path"):
        run_vllm_profile(VllmProfileOptions(), device="cpu")
    assert "--device cuda" in CPU_REASON


def _fake_result():
    bs = make_batch_set(VllmWorkload(input_sets=1), parse_shape("decode:64"))
    r = VllmShapeResult("decode:64", bs.num_reqs, bs.config.max_num_batched_tokens, bs)
    r.measurements = [
        Measurement(THREE, "graph", "gpu", 3, 10, [9.0, 9.1, 9.2, 9.0]),
        Measurement(ONE, "graph", "gpu", 1, 10, [2.0, 2.1, 2.0, 2.05]),
        Measurement(FLOOR, "graph", "gpu", 1, 10, [1.0, 1.0, 1.0, 1.0]),
        Measurement(THREE, "eager", "host", 3, 10, [20.0, 21.0, 20.5, 20.2]),
        Measurement(ONE, "eager", "host", 1, 10, [20.0, 21.0, 20.5, 20.2]),
    ]
    r.checks = {"status": "passed"}
    return r


def test_savings_and_document():
    r = _fake_result()
    sv = {(s["mode"], s["clock"]): s for s in savings(r)}
    g = sv[("graph", "gpu")]
    assert g["verdict"] == "saving" and g["saved_us"] == pytest.approx(9.05 - 2.025) and g["ratio"] > 4
    assert sv[("eager", "host")]["verdict"] == "within noise"
    doc = vllm_document([r], VllmProfileOptions(shapes=("decode:64",)), {"device": "cuda"})
    assert doc["kind"] == "kvaddr.profile.vllm" and doc["options"]["engine"] == "vllm"
    shape = doc["shapes"][0]
    names = [(x["mode"], x["strategy"]) for x in shape["results"]]
    assert names[:3] == [("graph", THREE), ("graph", ONE), ("graph", FLOOR)]
    assert shape["results"][0]["vs_three_launch"]["verdict"] == "baseline"
    assert shape["savings"][0]["mode"] == "graph"


def test_render_prints_a_table_and_the_saving():
    from rich.console import Console

    buf = io.StringIO()
    render_vllm(Console(file=buf, width=140), [_fake_result()], VllmProfileOptions())
    text = buf.getvalue()
    assert "vllm-one-launch" in text and "vllm-three-launch" in text
    assert "graph: GPU: one launch saves" in text
