"""Decode context parallelism on the CPU: every rank's vLLM step by the NumPy
reference, a loop over ranks for the collective, the partial attentions merged by
log-sum-exp against attention over the whole context (tests/support/dcp.py; the GPU run
is scripts/gpu/dcp_check.py under torchrun)."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_reference import dcp_local_lengths, vllm_step_reference
from tests.support.dcp import (
    FAULTS,
    KINDS,
    LoopRanks,
    NumpyBackend,
    ReferenceAddresser,
    dcp_cases,
    full_attention_numpy,
    global_positions,
    merge_numpy,
    owner_rank,
    partial_attention_numpy,
    run_case,
)

CP_SIZES = (1, 2, 4, 8)
MAX_QUERIES = 4  # per request and step (the first, the last and 2 others) and
NUM_REQS = 10  # requests per batch: keep the suite fast (the GPU script checks every query of 16)


@pytest.mark.parametrize("cp", (2, 4, 8))
@pytest.mark.parametrize("B", (16, 64))
@pytest.mark.parametrize("interleave", ("1", "B"))
def test_local_position_rule_matches_the_reference(cp, B, interleave):
    """Rank c's local position j is slot ``row[j // B] * B + j % B`` and global position
    ``global_positions(...)[j]``: one request of s tokens, block table = identity, so the
    reference's slot of position p is p's local index on its rank."""
    il = 1 if interleave == "1" else B
    s = 3 * B * cp + 5  # three virtual blocks and part of a fourth
    W = -(-s // (B * cp))
    seen = np.zeros(s, int)
    for c in range(cp):
        cfg = VllmStepConfig(1, s, [B], [W], cp_size=cp, cp_rank=c, cp_interleave=il)
        res = vllm_step_reference(
            cfg,
            np.array([0], np.int32),
            np.array([0, s], np.int32),
            np.zeros(1, np.int32),
            [np.arange(W, dtype=np.int32)[None, :]],
            [np.array([W], np.int32)],
        )
        slots = res.outputs.slot_mappings[0]
        mine = np.flatnonzero(slots >= 0)
        L = int(res.outputs.dcp_local_seq_lens[0])
        assert dcp_local_lengths(np.array([s]), cp, c, il)[0] == L
        assert np.array_equal(np.sort(slots[mine]), np.arange(L)), "the local cache is dense in local positions"
        assert np.array_equal(global_positions(L, B, cp, c, il)[slots[mine]], mine)
        assert np.array_equal(owner_rank(mine, B, cp, il), np.full(mine.size, c))
        seen[mine] += 1
    assert (seen == 1).all()


def test_merge_of_split_keys_is_whole_attention():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 3, 8)) for n in (5, 40, 40))
    q_pos = np.array([0, 7, 19, 30, 39])
    k_pos = rng.permutation(40)
    want = full_attention_numpy(q, k, v, q_pos, k_pos)
    parts = [partial_attention_numpy(q, k[i::3], v[i::3], q_pos, k_pos[i::3]) for i in range(3)]
    parts.append(partial_attention_numpy(q, k[:0], v[:0], q_pos, k_pos[:0]))  # a rank with no keys
    out, lse = merge_numpy(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    assert np.allclose(out, want, rtol=1e-12, atol=1e-12)
    whole = partial_attention_numpy(q, k, v, q_pos, k_pos)
    assert np.allclose(lse, whole[1], rtol=1e-12, atol=1e-12)
    assert np.isneginf(parts[-1][1]).all() and not parts[-1][0].any()


def test_merge_of_no_keys_is_zero_not_nan():
    out, lse = merge_numpy(np.zeros((2, 3, 1, 4)), np.full((2, 3, 1), -np.inf))
    assert not out.any() and np.isneginf(lse).all()


@pytest.mark.parametrize("cp", CP_SIZES)
def test_every_case_passes_on_a_loop_over_ranks(cp):
    be = NumpyBackend()
    cases = dcp_cases(num_reqs=NUM_REQS)
    assert len(cases) == 12
    kinds = set()
    for case in cases:
        report = run_case(case, cp, be, ReferenceAddresser(be), LoopRanks(be, cp), max_queries=MAX_QUERIES)
        assert report.ok, f"cp {cp} {case.name}: {report.failures[:5]}"
        kinds |= set(report.kinds)
    assert kinds == set(KINDS), kinds


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("cp", (1, 2, 8))
def test_a_broken_rank_fails_the_check(fault, cp):
    be = NumpyBackend()
    case = dcp_cases(block_sizes=(16,), num_reqs=NUM_REQS)[1]  # two groups, the second unsharded
    report = run_case(case, cp, be, ReferenceAddresser(be), LoopRanks(be, cp), max_queries=MAX_QUERIES, fault=fault)
    assert not report.ok
    want = {"slot": "share a slot", "partial": "merged attention differs", "length": "local lengths add up"}[fault]
    assert any(want in f for f in report.failures), report.failures
    assert report.failures[0].startswith("step 1"), report.failures  # the fault is injected at step 1


def test_a_token_written_by_two_ranks_fails():
    be = NumpyBackend()
    case = dcp_cases(block_sizes=(16,), num_reqs=NUM_REQS)[0]

    def corrupt(step, rank, out):
        if step == 2 and rank == 0:  # rank 0 also writes a token rank 1 owns
            out["slot_mappings"][0] = np.where(out["slot_mappings"][0] >= 0, out["slot_mappings"][0], 0)

    report = run_case(case, 2, be, ReferenceAddresser(be), LoopRanks(be, 2), max_queries=MAX_QUERIES, corrupt=corrupt)
    assert any("written by 2 ranks" in f for f in report.failures), report.failures[:3]


def test_torch_backend_on_the_cpu_agrees():
    """The GPU script's arithmetic (TorchBackend) on the CPU, where PyTorch is installed."""
    torch = pytest.importorskip("torch")
    from tests.support.dcp import TorchBackend

    be = TorchBackend("cpu")
    rng = np.random.default_rng(1)
    outs, lses = rng.standard_normal((3, 4, 2, 8)), rng.standard_normal((3, 4, 2))
    lses[1, 2] = -np.inf
    got = be.merge(torch.from_numpy(outs), torch.from_numpy(lses))
    want = merge_numpy(outs, lses)
    assert all(np.allclose(g.numpy(), w, rtol=1e-12, atol=1e-12) for g, w in zip(got, want))
    for case in dcp_cases(block_sizes=(16,), num_reqs=NUM_REQS)[:3]:
        report = run_case(case, 4, be, ReferenceAddresser(be), LoopRanks(be, 4), max_queries=MAX_QUERIES)
        assert report.ok, report.failures[:5]
    bad = run_case(case, 4, be, ReferenceAddresser(be), LoopRanks(be, 4), max_queries=MAX_QUERIES, fault="partial")
    assert not bad.ok


def _script():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu", "dcp_check.py")
    spec = importlib.util.spec_from_file_location("dcp_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_single_process_on_the_cpu(capsys, monkeypatch):
    """``dcp_check.py --single-process --device cpu``: the NumPy reference addresses, PyTorch on the CPU."""
    pytest.importorskip("torch")
    main = _script().main
    args = ["--single-process", "--device", "cpu", "--ranks", "1,4", "--only", "B16-I16", "--max-queries", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("PASS  cp_size=") == 6 and "6/6 cases passed (OK)" in out, out
    assert main([*args, "--fault", "partial"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL  cp_size=") == 6 and "0/6 cases passed (FAILED)" in out, out
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--device", "cpu"]) == 2  # neither torchrun nor --single-process
    assert "start it with torchrun" in capsys.readouterr().err


def test_script_under_torchrun_with_gloo():
    """Two processes, the gloo collective on the CPU: the script's distributed path without a GPU."""
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["scripts/gpu/dcp_check.py", "--backend", "gloo", "--device", "cpu", "--only=-I1-", "--max-queries", "4"]
    p = subprocess.run(
        cmd, cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("[gloo, 2 processes]") == 6 and "6/6 cases passed (OK)" in p.stdout, p.stdout
