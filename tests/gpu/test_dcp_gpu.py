"""Decode context parallelism on one GPU (issue 17): the kernel's step for every rank in
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


@pytest.mark.parametrize("cp", (1, 2, 4, 8))
def test_kernel_addressing_on_a_loop_over_ranks(cp):
    pytest.importorskip("torch")
    be = TorchBackend("cuda")
    for case in dcp_cases(block_sizes=(16,), steps=3):
        report = run_case(case, cp, be, PlannerAddresser(be, 0), LoopRanks(be, cp))
        assert report.ok, f"cp {cp} {case.name}: {report.failures[:5]}"


def test_kernel_addressing_check_can_fail():
    pytest.importorskip("torch")
    be = TorchBackend("cuda")
    case = dcp_cases(block_sizes=(16,), steps=3)[1]
    report = run_case(case, 2, be, PlannerAddresser(be, 0), LoopRanks(be, 2), fault="slot")
    assert any("share a slot" in f for f in report.failures), report.failures[:5]


def test_script_under_torchrun_one_process():
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["scripts/gpu/dcp_check.py", "--only", "B16-I1", "--steps", "3"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "3/3 cases passed (OK)" in p.stdout, p.stdout
