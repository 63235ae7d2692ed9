"""docs/dsa.md's step-output snippets: the CPU one runs and prints what it says; the GPU one
(run by tests/gpu/test_dsa_step_gpu.py) states its outputs and names only existing public names."""

from __future__ import annotations

import contextlib
import io

from tests.support.docs import DOCS, expected_prints, resolve, snippet

TEXT = (DOCS / "dsa.md").read_text()


def test_cpu_snippet_prints_what_it_says():
    code = snippet(TEXT, "dsa-step-cpu")
    assert "cupy" not in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/dsa.md", "exec"), {})
    got = [line.strip() for line in buf.getvalue().splitlines()]
    assert got == expected_prints(code, explanations=False)
    assert len(got) == 5


def test_gpu_snippet_states_its_outputs_and_names_what_exists():
    code = snippet(TEXT, "dsa-step-gpu")
    assert len(expected_prints(code, explanations=False)) == 2
    for name in ("kvaddr.StepPlanner", "kvaddr.outputs.DsaOutputs.value_offsets", "kvaddr.StepPlanner.check"):
        assert resolve(name), name
    assert "dsa=True" in code


def test_vllm_cpu_snippet_prints_what_it_says():
    code = snippet(TEXT, "dsa-vllm-cpu")
    assert "cupy" not in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/dsa.md", "exec"), {})
    got = [line.strip() for line in buf.getvalue().splitlines()]
    assert got == expected_prints(code, explanations=False)
    assert len(got) == 3


def test_vllm_gpu_snippet_states_its_outputs_and_names_what_exists():
    code = snippet(TEXT, "dsa-vllm-gpu")
    assert len(expected_prints(code, explanations=False)) == 2
    for name in ("kvaddr.engines.vllm.VllmStepPlanner", "kvaddr.engines.vllm.VllmStepPlanner.check"):
        assert resolve(name), name
    assert "dsa=True" in code
