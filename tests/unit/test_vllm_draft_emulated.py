"""The draft-addressing kernel (kernels/spec.cuh) emulated on the CPU (tests/support/vllm_draft_emulator.py),
driven by the real VllmDraftPlanner host code behind a fake CuPy, against the NumPy reference:
every output element, the error mask and the first-bad key. The same comparisons run on a GPU
in tests/gpu/test_vllm_draft_gpu.py. Skips without a C++ compiler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr.engines.spec_reference import VERR_NUM_REJECTED
from tests.support import vllm_draft_emulator
from tests.support.draft_cases import compare, corrupt, draft_case, reference
from tests.support.vllm_fake_cupy import FakeArray

pytestmark = pytest.mark.skipif(vllm_draft_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")

ARGS = ("idx_mapping", "query_start_loc", "seq_lens", "num_rejected", "num_sampled")


def fake(x):
    return [FakeArray(a) for a in x] if isinstance(x, list) else FakeArray(x)


def run(planner, case):
    x = case["inputs"]
    out = planner.compute(
        *(fake(x[k]) for k in ARGS),
        fake(x["block_tables"]),
        fake(x["num_blocks"]),
        fake(x["verify_slot_mappings"]),
    )
    return {k: vllm_draft_emulator.host(v) for k, v in out.as_dict().items()}


def check_case(case, label=""):
    from kvaddr.engines.vllm_draft import VllmDraftPlanner

    planner = VllmDraftPlanner(**case["settings"])
    got = run(planner, case)
    want = reference(case)
    compare(got, want, label)
    assert planner.errors() == (want.error_mask, want.error_key), label
    return planner, want


@pytest.fixture
def emu(monkeypatch):
    return vllm_draft_emulator.install(monkeypatch)


def test_worked_example(emu):
    from kvaddr.engines.vllm_draft import VllmDraftPlanner

    t5, t2 = [7, 3, 9, 12, 4], [11, 0, 6, 8, -1]
    table = np.full((6, 5), -1, dtype=np.int32)
    table[5], table[2] = t5, t2
    planner = VllmDraftPlanner(2, 8, 3, [4], [5], 64, mask_rejected=True)
    vsm = np.array([[38, 39, 48, 49, 2, 3, 24, 25]], dtype=np.int64)
    out = planner.compute(
        fake(np.array([5, 2], dtype=np.int32)),
        fake(np.array([0, 4, 8], dtype=np.int32)),
        fake(np.array([14, 10], dtype=np.int32)),
        fake(np.array([0, 2], dtype=np.int32)),
        fake(np.array([4, 2], dtype=np.int32)),
        fake(table),
        None,
        fake(vsm),
    )
    assert out.last_token_indices.a.tolist() == [3, 5]
    assert out.positions.a.tolist() == [[14, 8], [15, 9]]
    assert out.seq_lens.a.tolist() == [[15, 9], [16, 10]]
    assert out.slot_mappings.a[:, 0].tolist() == [[50, 24], [51, 25]]
    assert out.query_start_loc.a.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert out.first_slot_mappings.a.tolist() == [[38, 39, 48, 49, 2, 3, -1, -1]]
    assert planner.errors()[0] == 0
    assert [L["name"] for L in emu.launches] == ["vllm_draft_step<false>"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 12),
    extra=st.integers(0, 5),
    k=st.integers(1, 5),
    sizes=st.sampled_from([(4,), (16,), (3, 5), (4, 8, 1)]),
    M=st.integers(1, 80),
    attention=st.sampled_from([None, "flashinfer", "varlen", "flashinfer,varlen"]),
    bad=st.booleans(),
    idx64=st.booleans(),
)
def test_random_against_reference(emu, seed, n, extra, k, sizes, M, attention, bad, idx64):
    rng = np.random.default_rng(seed)
    case = draft_case(
        rng,
        num_reqs=n,
        max_num_reqs=n + extra if n + extra else 1,
        k=k,
        block_sizes=sizes,
        max_model_len=max(M, k + 1 + 5),
        attention=attention,
        idx64=idx64,
        mask_rejected=bool(rng.random() < 0.7),
        slot_mapping_enabled=[bool(rng.random() < 0.9) for _ in sizes],
    )
    N = case["settings"]["kv_indices_capacity"]
    if N is not None and rng.random() < 0.3:  # too few kv_indices entries: bit 512, the rest dropped
        case["settings"]["kv_indices_capacity"] = max(1, N // 2 - int(rng.integers(0, 8)))
    label = "clean"
    if bad:
        label = corrupt(case, rng)
    check_case(case, label)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    cp=st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (3, 1)]),
    attention=st.sampled_from([None, "flashinfer,varlen"]),
)
def test_dcp_ranks(emu, seed, cp, attention):
    cp_size, il = cp
    rng = np.random.default_rng(seed)
    for rank in range(cp_size):
        case = draft_case(
            np.random.default_rng(seed),
            num_reqs=int(rng.integers(1, 9)),
            k=3,
            block_sizes=(4, 8),
            max_model_len=50,
            cp_size=cp_size,
            cp_rank=rank,
            cp_interleave=il,
            dcp_sharded=[True, bool(seed % 2)],
            attention=attention,
        )
        check_case(case, f"rank {rank}")


def test_num_rejected_past_drafts_is_recorded(emu):
    case = draft_case(np.random.default_rng(3), num_reqs=4, prefill_share=0.0, dummy_share=0.0)
    case["inputs"]["num_rejected"][2] = 9
    _, want = check_case(case)
    assert want.error_mask & VERR_NUM_REJECTED
    assert want.first_bad[1] == 2


def test_positions_reach_max_model_len(emu):
    case = draft_case(np.random.default_rng(4), num_reqs=6, k=4, near_end_share=1.0, prefill_share=0.0)
    _, want = check_case(case)
    assert want.positions.max() == case["settings"]["max_model_len"] - 1


def test_many_requests(emu):
    case = draft_case(
        np.random.default_rng(5), num_reqs=1100, max_num_reqs=1300, k=3, max_model_len=40, attention="flashinfer,varlen"
    )
    check_case(case)


def test_every_element_written_again(emu):
    """A second call with a smaller batch leaves nothing of the first."""
    from kvaddr.engines.vllm_draft import VllmDraftPlanner

    rng = np.random.default_rng(6)
    big = draft_case(rng, num_reqs=9, max_num_reqs=10, attention="flashinfer,varlen", max_tokens=60)
    planner = VllmDraftPlanner(**big["settings"])
    run(planner, big)
    small = draft_case(rng, num_reqs=2, max_num_reqs=10, attention="flashinfer,varlen", max_tokens=60)
    small["settings"] = big["settings"]
    small["inputs"]["block_tables"] = [
        np.pad(t, ((0, 0), (0, w - t.shape[1])), constant_values=-1)[:, :w]
        for t, w in zip(small["inputs"]["block_tables"], big["settings"]["widths"])
    ]
    compare(run(planner, small), reference(small), "second call")


@pytest.mark.parametrize("k", [6, 9, 10])
@pytest.mark.parametrize("bad", [False, True])
def test_many_draft_steps_of_three_groups(emu, k, bad):
    """(k - 1) * 3 request slices (a thread per (draft step, group, row)), groups of power-of-two
    and other block sizes, rows reaching max_model_len."""
    rng = np.random.default_rng(1000 + k)
    case = draft_case(rng, num_reqs=9, max_num_reqs=12, k=k, block_sizes=(4, 3, 1), max_model_len=3 * k + 20)
    label = corrupt(case, rng) if bad else "clean"
    check_case(case, label)


@pytest.mark.parametrize(
    "num_reqs, max_num_reqs, k, block_sizes",
    [(200, 255, 3, (4, 3)), (256, 256, 2, (4, 1, 16)), (300, 511, 4, (2, 5)), (40, 300, 1, (4, 3, 8))],
)
@pytest.mark.parametrize("bad", [False, True])
def test_request_block_boundaries(emu, num_reqs, max_num_reqs, k, block_sizes, bad):
    """Slices of one and of several request blocks (max_num_reqs + 1 at and past a block's 256
    threads), several groups, and no draft step (k = 1: one slice writes last_token_indices and
    records the request errors), clean and with bad inputs."""
    rng = np.random.default_rng(num_reqs + 7 * k)
    case = draft_case(rng, num_reqs=num_reqs, max_num_reqs=max_num_reqs, k=k, block_sizes=block_sizes)
    label = corrupt(case, rng) if bad else "clean"
    check_case(case, label)
