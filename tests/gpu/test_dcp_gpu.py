"""Decode context parallelism on one GPU: the kernel's step for every rank in
a loop (no collective) and scripts/gpu/dcp_check.py under ``torchrun --nproc-per-node 1``
(NCCL, cp_size 1). The two-GPU NCCL run is the script itself (README, "Decode context
parallelism"). Skips without a GPU or without PyTorch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.dcp import LoopRanks, PlannerAddresser, TorchBackend, dcp_cases, run_case
from tests.support.gpu import requires_gpu

pytestmark = requires_gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Kept light (the suite also runs under compute-sanitizer): B = 16, 10 requests, 3 steps, up
# to 8 queries per request and step, three of the six B16 cases (I = 1 and B; g1, g2u, g2s).
# scripts/gpu/dcp_check.py runs every case with every query.
LIGHT = dict(block_sizes=(16,), num_reqs=10, steps=3)


def _cases():
    cases = dcp_cases(**LIGHT)
    return [cases[0], cases[4], cases[5]]


def _under_sanitizer() -> bool:
    return any(
        "sanitizer" in v for v in (os.environ.get("CUDA_INJECTION64_PATH", ""), os.environ.get("LD_PRELOAD", ""))
    )


@pytest.mark.parametrize("cp", (1, 2, 4, 8))
def test_kernel_addressing_on_a_loop_over_ranks(cp):
    pytest.importorskip("torch")
    be = TorchBackend("cuda")
    for case in _cases():
        report = run_case(case, cp, be, PlannerAddresser(be, 0), LoopRanks(be, cp), max_queries=8)
        assert report.ok, f"cp {cp} {case.name}: {report.failures[:5]}"


def test_kernel_addressing_check_can_fail():
    pytest.importorskip("torch")
    be = TorchBackend("cuda")
    case = _cases()[1]
    report = run_case(case, 2, be, PlannerAddresser(be, 0), LoopRanks(be, 2), max_queries=8, fault="slot")
    assert report.failures and report.failures[0].startswith("step 1"), report.failures[:5]
    assert any("share a slot" in f or "written by 0 ranks" in f for f in report.failures), report.failures[:5]


def test_script_under_torchrun_one_process():
    pytest.importorskip("torch")
    if _under_sanitizer():
        pytest.skip("under compute-sanitizer: the torchrun child processes are not this test's subject")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["scripts/gpu/dcp_check.py", "--block-sizes", "16", "--only=-I1-", "--steps", "3", "--max-queries", "8"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "3/3 cases passed (OK)" in p.stdout, p.stdout
