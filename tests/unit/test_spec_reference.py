"""The draft-addressing references (docs/spec-decode.md): the worked example, a step-by-step
oracle, bad arguments and error bits."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr.engines import spec_reference as S
from kvaddr.engines.vllm_errors import (
    VERR_BLOCK_INDEX,
    VERR_NEGATIVE_BLOCK,
    VERR_NEGATIVE_COMPUTED,
    VERR_PAST_NUM_BLOCKS,
    VERR_QUERY_START_LOC,
    VERR_ROW_INDEX,
)
from kvaddr.errors import ERR_NEGATIVE_LENGTH
from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_draft_addressing, mtp_substep_lengths


def worked(**over):
    table = np.full((6, 5), -1, dtype=np.int32)
    table[5] = [7, 3, 9, 12, 4]
    table[2, :4] = [11, 0, 6, 8]
    args = dict(
        idx_mapping=np.array([5, 2], dtype=np.int32),
        query_start_loc=np.array([0, 4, 8], dtype=np.int32),
        seq_lens=np.array([14, 10], dtype=np.int32),
        num_rejected=np.array([0, 2], dtype=np.int32),
        num_sampled=np.array([4, 2], dtype=np.int32),
        block_tables=[table],
        block_sizes=[4],
        verify_slot_mappings=np.array([[38, 39, 48, 49, 2, 3, 24, 25]], dtype=np.int64),
        max_model_len=64,
        num_speculative_steps=3,
    )
    args.update(over)
    return args


def test_worked_example():
    r = S.vllm_draft_reference(**worked())
    assert r.error_mask == 0 and r.first_bad is None
    r.check()
    assert r.last_token_indices.dtype == np.int64
    assert r.last_token_indices.tolist() == [3, 5]
    assert r.first_slot_mappings.tolist() == [[38, 39, 48, 49, 2, 3, 24, 25]]
    assert r.positions.tolist() == [[14, 8], [15, 9]]
    assert r.seq_lens.tolist() == [[15, 9], [16, 10]]
    assert r.slot_mappings.tolist() == [[[50, 24]], [[51, 25]]]
    assert r.query_start_loc.tolist() == [[0, 1, 2], [0, 1, 2]]
    masked = S.vllm_draft_reference(**worked(mask_rejected=True))
    assert masked.first_slot_mappings.tolist() == [[38, 39, 48, 49, 2, 3, -1, -1]]


def test_padding_rows_past_num_reqs():
    r = S.vllm_draft_reference(**worked(max_num_reqs=4))
    assert r.last_token_indices.tolist() == [3, 5, 0, 0]
    assert r.positions.tolist() == [[14, 8, 0, 0], [15, 9, 0, 0]]
    assert r.seq_lens.tolist() == [[15, 9, 0, 0], [16, 10, 0, 0]]
    assert r.query_start_loc.tolist() == [[0, 1, 2, 2, 2]] * 2
    assert r.slot_mappings.tolist() == [[[50, 24, -1, -1]], [[51, 25, -1, -1]]]


def test_one_step_has_no_draft_steps():
    r = S.vllm_draft_reference(**worked(num_speculative_steps=1))
    assert r.positions.shape == (0, 2) and r.slot_mappings.shape == (0, 1, 2)
    assert r.query_start_loc.shape == (0, 3)


# ----------------------------------------------------------------------------- oracle


def loop_oracle(idx, qsl, seq_t, rej, tables, sizes, vsm, M, k, R, mask_rejected):
    """Draft step j computed from scratch per request with Python ints (valid inputs only)."""
    n = len(idx)
    last = [0] * R
    first = [list(row) for row in vsm]
    pos = [[0] * R for _ in range(k - 1)]
    lens = [[0] * R for _ in range(k - 1)]
    slots = [[[-1] * R for _ in sizes] for _ in range(k - 1)]
    for b in range(n):
        qs, qe = qsl[b], qsl[b + 1]
        accepted_len = qe - qs - rej[b]
        last[b] = qs + accepted_len - 1
        if mask_rejected:
            for t in range(qs + accepted_len, qe):
                for g in range(len(sizes)):
                    first[g][t] = -1
        before = seq_t[b] - (qe - qs)  # tokens in the cache before the verify step
        last_accepted_pos = before + accepted_len - 1
        for j in range(1, k):
            p = min(last_accepted_pos + j, M - 1)
            pos[j - 1][b] = p
            lens[j - 1][b] = min(before + accepted_len + j, M)
            for g, B in enumerate(sizes):
                slots[j - 1][g][b] = int(tables[g][idx[b]][p // B]) * B + p % B
    return last, first, pos, lens, slots


@st.composite
def draft_batches(draw):
    k = draw(st.integers(1, 4))
    G = draw(st.integers(1, 3))
    sizes = [draw(st.sampled_from([1, 2, 4, 16])) for _ in range(G)]
    M = draw(st.integers(2, 40))
    n = draw(st.integers(0, 5))
    R = n + draw(st.integers(0, 2))
    rows = max(R, 1) + 1
    idx = draw(st.permutations(list(range(rows))))[:n]
    qsl, seq_t, rej, smp = [0], [], [], []
    for _ in range(n):
        if draw(st.booleans()):  # decoding with k - 1 drafts, random acceptance
            qlen = k
            accepted = draw(st.integers(0, k - 1))
            rej.append(k - 1 - accepted)
            smp.append(accepted + 1)
        else:  # chunked prefill
            qlen = draw(st.integers(1, 5))
            rej.append(0)
            smp.append(0)
        before = draw(st.integers(0, M - qlen)) if qlen <= M else 0
        qsl.append(qsl[-1] + qlen)
        seq_t.append(before + qlen)
    T = qsl[-1] + draw(st.integers(0, 2))
    tables = []
    for B in sizes:
        width = -(-(M + 5) // B)
        tables.append(np.array(draw(st.permutations(list(range(rows * width)))), dtype=np.int32).reshape(rows, width))
    vsm = np.array([[draw(st.integers(0, 999)) for _ in range(T)] for _ in sizes], dtype=np.int64).reshape(G, T)
    return idx, qsl, seq_t, rej, smp, tables, sizes, vsm, M, k, R, draw(st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draft_batches())
def test_matches_the_step_by_step_loop(case):
    idx, qsl, seq_t, rej, smp, tables, sizes, vsm, M, k, R, mask_rejected = case
    r = S.vllm_draft_reference(
        np.array(idx, dtype=np.int32),
        np.array(qsl, dtype=np.int32),
        np.array(seq_t, dtype=np.int32),
        np.array(rej, dtype=np.int32),
        np.array(smp, dtype=np.int32),
        tables,
        sizes,
        vsm,
        M,
        k,
        max_num_reqs=R,
        mask_rejected=mask_rejected,
    )
    assert r.error_mask == 0, r.first_bad
    last, first, pos, lens, slots = loop_oracle(idx, qsl, seq_t, rej, tables, sizes, vsm, M, k, R, mask_rejected)
    assert r.last_token_indices.tolist() == last
    assert r.first_slot_mappings.tolist() == first
    assert r.positions.reshape(k - 1, R).tolist() == pos
    assert r.seq_lens.reshape(k - 1, R).tolist() == lens
    assert r.slot_mappings.reshape(k - 1, len(sizes), R).tolist() == slots
    assert r.query_start_loc.reshape(k - 1, R + 1).tolist() == [[min(i, len(idx)) for i in range(R + 1)]] * (k - 1)
    if not mask_rejected:  # a valid row never changes
        assert np.array_equal(r.first_slot_mappings, vsm)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("over", "exc", "name"),
    [
        ({"idx_mapping": np.array([5.0, 2.0])}, TypeError, "idx_mapping"),
        ({"query_start_loc": np.array([0, 4], dtype=np.int32)}, ValueError, "query_start_loc"),
        ({"seq_lens": np.array([14], dtype=np.int32)}, ValueError, "seq_lens"),
        ({"num_rejected": np.array([[0, 2]], dtype=np.int32)}, ValueError, "num_rejected"),
        ({"num_sampled": ["a", "b"]}, TypeError, "num_sampled"),
        ({"block_sizes": [0]}, ValueError, "block_sizes"),
        ({"block_sizes": [4, 4]}, ValueError, "block_tables"),
        ({"verify_slot_mappings": np.zeros((2, 8), dtype=np.int64)}, ValueError, "verify_slot_mappings"),
        ({"max_model_len": 0}, ValueError, "max_model_len"),
        ({"max_model_len": 64.0}, TypeError, "max_model_len"),
        ({"num_speculative_steps": 0}, ValueError, "num_speculative_steps"),
        ({"max_num_reqs": 1}, ValueError, "max_num_reqs"),
        ({"mask_rejected": 1}, TypeError, "mask_rejected"),
        ({"num_blocks": [np.array([5], dtype=np.int32)]}, ValueError, "num_blocks"),
    ],
)
def test_bad_arguments_name_the_argument(over, exc, name):
    with pytest.raises(exc, match=name):
        S.vllm_draft_reference(**worked(**over))


# ----------------------------------------------------------------------------- error bits


@pytest.mark.parametrize(
    ("over", "bit", "first_bad"),
    [
        (
            {"num_rejected": np.array([0, 4], dtype=np.int32), "num_sampled": np.array([4, 0], dtype=np.int32)},
            S.VERR_NUM_REJECTED,
            (0, 1, 0, S.VERR_NUM_REJECTED),
        ),
        ({"num_rejected": np.array([-1, 2], dtype=np.int32)}, S.VERR_NUM_REJECTED, (0, 0, 0, S.VERR_NUM_REJECTED)),
        ({"num_sampled": np.array([3, 2], dtype=np.int32)}, S.VERR_NUM_REJECTED, (0, 0, 0, S.VERR_NUM_REJECTED)),
        ({"num_sampled": np.array([4, 0], dtype=np.int32)}, S.VERR_NUM_REJECTED, (0, 1, 0, S.VERR_NUM_REJECTED)),
        ({"idx_mapping": np.array([5, 6], dtype=np.int32)}, VERR_ROW_INDEX, (0, 1, 0, VERR_ROW_INDEX)),
        (
            {"query_start_loc": np.array([0, 4, 3], dtype=np.int32)},
            VERR_QUERY_START_LOC,
            (0, 1, 0, VERR_QUERY_START_LOC),
        ),
        ({"seq_lens": np.array([3, 10], dtype=np.int32)}, VERR_NEGATIVE_COMPUTED, (0, 0, 0, VERR_NEGATIVE_COMPUTED)),
        ({"seq_lens": np.array([14, 22], dtype=np.int32)}, VERR_BLOCK_INDEX, (1, 1, 0, VERR_BLOCK_INDEX)),
        (
            {"num_blocks": [np.array([0, 0, 2, 0, 0, 5], dtype=np.int32)]},
            VERR_PAST_NUM_BLOCKS,
            (1, 1, 0, VERR_PAST_NUM_BLOCKS),
        ),
        ({"seq_lens": np.array([14, 18], dtype=np.int32)}, VERR_NEGATIVE_BLOCK, (1, 1, 0, VERR_NEGATIVE_BLOCK)),
    ],
)
def test_error_bits_and_first_bad(over, bit, first_bad):
    r = S.vllm_draft_reference(**worked(**over))
    assert r.error_mask == bit
    assert r.first_bad == first_bad
    with pytest.raises(S.DraftAddressingError, match=re.escape(S.DRAFT_ERROR_REASONS[bit])):
        r.check()


def test_a_skipped_request_gets_zeros_and_minus_one_and_keeps_its_rows():
    over = {"num_rejected": np.array([0, 4], dtype=np.int32), "num_sampled": np.array([4, 0], dtype=np.int32)}
    r = S.vllm_draft_reference(**worked(mask_rejected=True, **over))
    assert r.last_token_indices.tolist() == [3, 0]
    assert r.positions[:, 1].tolist() == [0, 0] and r.seq_lens[:, 1].tolist() == [0, 0]
    assert r.slot_mappings[:, 0, 1].tolist() == [-1, -1]
    assert r.first_slot_mappings.tolist() == [[38, 39, 48, 49, 2, 3, 24, 25]]
    assert r.positions[:, 0].tolist() == [14, 15]  # the other request is untouched


def test_a_dummy_request_owns_its_tokens_but_no_row():
    r = S.vllm_draft_reference(**worked(idx_mapping=np.array([5, -1], dtype=np.int32)))
    assert r.error_mask == 0
    assert r.last_token_indices.tolist() == [3, 5]
    assert r.positions[:, 1].tolist() == [0, 0] and r.slot_mappings[:, 0, 1].tolist() == [-1, -1]


def test_positions_clamp_at_max_model_len():
    # Request 0: P = 13, M = 15: positions 14, 14 (clamped), seq_lens 15, 15.
    r = S.vllm_draft_reference(**worked(max_model_len=15))
    assert r.positions[:, 0].tolist() == [14, 14]
    assert r.seq_lens[:, 0].tolist() == [15, 15]
    assert r.slot_mappings[:, 0, 0].tolist() == [50, 50]


# ----------------------------------------------------------------------------- FastDeploy MTP


def test_mtp_substeps_are_core_steps():
    dec = np.array([10, 0, 7, 3], dtype=np.int32)  # already rolled back
    acc = np.array([3, 0, 1, 2], dtype=np.int32)
    tables = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
    results = mtp_draft_addressing(dec, acc, tables, 4, 16, 3)
    assert len(results) == 3
    assert mtp_substep_lengths(dec, acc, 0)[1].tolist() == [3, 0, 1, 2]
    for j, res in enumerate(results):
        d_j, q_j = mtp_substep_lengths(dec, acc, j)
        want = step_addressing(d_j, q_j, tables, 4, 16)
        np.testing.assert_array_equal(res.outputs.position_ids, want.outputs.position_ids)
        np.testing.assert_array_equal(res.outputs.slot_mapping, want.outputs.slot_mapping)
        assert res.error_mask == 0
    # Substep 0 runs the accepted tokens from the rolled-back length; substep j one token.
    assert results[0].outputs.position_ids[:6].tolist() == [10, 11, 12, 7, 3, 4]
    assert results[1].outputs.position_ids[:3].tolist() == [13, 8, 5]
    assert results[2].outputs.position_ids[:3].tolist() == [14, 9, 6]
    assert results[2].outputs.seq_lens_kv.tolist() == [15, 0, 10, 7]
    assert results[2].outputs.cu_seqlens_q.tolist() == [0, 1, 1, 2, 3]


def test_mtp_negative_accept_num_sets_bit_8_at_every_substep():
    results = mtp_draft_addressing([5, 5], [-1, 2], np.zeros((2, 4), dtype=np.int32), 4, 8, 2)
    assert all(r.error_mask & ERR_NEGATIVE_LENGTH for r in results)


def test_mtp_bad_arguments():
    with pytest.raises(ValueError, match="accept_num"):
        mtp_substep_lengths([1, 2], [1], 0)
    with pytest.raises(ValueError, match="substep"):
        mtp_substep_lengths([1], [1], -1)
    with pytest.raises(ValueError, match="num_substeps"):
        mtp_draft_addressing([1], [1], np.zeros((1, 2), dtype=np.int32), 4, 8, 0)
    with pytest.raises(TypeError, match="accept_num"):
        mtp_substep_lengths([1], [1.5], 0)
