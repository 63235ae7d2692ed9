"""The NumPy reference: worked examples, hand-checked edge cases, and properties
against an independent per-token loop (tests/support/step_cases.py: naive_reference)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaddr.errors import NO_ERROR_KEY, AddressingError, decode_error_key
from kvaddr.reference import step_addressing
from tests.support.step_cases import WORKED_EXAMPLES, edge_cases, naive_reference, random_step


def run(case):
    kw = dict(case)
    return step_addressing(
        kw.pop("seq_lens_decoder"),
        kw.pop("seq_lens_this_time"),
        kw.pop("block_tables"),
        kw.pop("block_sizes"),
        kw.pop("capacity"),
        **kw,
    )


def assert_matches_naive(case):
    res = run(case)
    want = naive_reference(
        case["seq_lens_decoder"],
        case["seq_lens_this_time"],
        case["block_tables"],
        case["block_sizes"],
        case["capacity"],
    )
    o = res.outputs
    np.testing.assert_array_equal(o.cu_seqlens_q, want["cu_seqlens_q"])
    assert int(o.num_tokens) == want["num_tokens"]
    np.testing.assert_array_equal(o.seq_lens_kv, want["seq_lens_kv"])
    np.testing.assert_array_equal(o.batch_id_per_token, want["batch_id_per_token"])
    np.testing.assert_array_equal(o.position_ids, want["position_ids"])
    np.testing.assert_array_equal(
        o.slot_mapping, np.array(want["slot_mapping"], dtype=np.int64).reshape(o.slot_mapping.shape)
    )
    assert res.error_mask == want["error_mask"]
    assert res.error_key == want["error_key"]


@pytest.mark.parametrize("name,case,expected", WORKED_EXAMPLES, ids=[w[0] for w in WORKED_EXAMPLES])
def test_worked_examples(name, case, expected):
    res = run(case)
    for field, value in expected.items():
        got = res.error_mask if field == "error_mask" else getattr(res.outputs, field)
        np.testing.assert_array_equal(got, value, err_msg=field)


def test_example_2_error_names_token_request_and_reason():
    res = run(WORKED_EXAMPLES[1][1])
    with pytest.raises(AddressingError, match="token 3 of request 1, cache 0: block index beyond") as exc:
        res.check()
    assert (exc.value.token, exc.value.request, exc.value.bit) == (3, 1, 1)


@pytest.mark.parametrize("name", sorted(edge_cases()))
def test_edge_cases_match_naive_loop(name):
    assert_matches_naive(edge_cases()[name])


def test_empty_batch_is_all_padding():
    o = run(edge_cases()["empty-batch"]).outputs
    assert o.cu_seqlens_q.tolist() == [0] and int(o.num_tokens) == 0
    assert (o.batch_id_per_token == -1).all() and (o.position_ids == 0).all() and (o.slot_mapping == -1).all()


def test_idle_slots_take_no_tokens():
    o = run(edge_cases()["idle-between"]).outputs
    assert o.cu_seqlens_q.tolist() == [0, 1, 1, 1, 3, 3]
    assert o.batch_id_per_token.tolist() == [0, 3, 3, -1, -1, -1]
    assert o.position_ids.tolist() == [3, 40, 41, 0, 0, 0]
    assert o.slot_mapping[0].tolist() == [
        9 * 16 + 3,
        3 * 16 + 8,
        3 * 16 + 9,
        -1,
        -1,
        -1,
    ]  # pos 40: block index 2 of row 3
    assert o.seq_lens_kv.tolist() == [4, 0, 0, 42, 0]


def test_speculative_tokens_cross_a_block_boundary():
    o = run(edge_cases()["speculative"]).outputs
    assert o.position_ids.tolist() == [62, 63, 64, 127, 128]
    assert o.slot_mapping[0].tolist() == [5 * 64 + 62, 5 * 64 + 63, 8 * 64 + 0, 4 * 64 + 63, 6 * 64 + 0]


def test_chunked_prefill_continuation_starts_at_decoder_length():
    o = run(edge_cases()["chunked-prefill-continuation"]).outputs
    assert o.position_ids[0] == 96 and o.position_ids[99] == 195 and o.position_ids[100] == 10
    assert o.slot_mapping[0, 0] == 1 * 96 + 0 and o.slot_mapping[0, 99] == 4 * 96 + 3
    assert o.slot_mapping[0, 100] == 5 * 96 + 10


def test_block_id_2_31_minus_1_with_b_64_needs_int64():
    o = run(edge_cases()["block-id-2^31-1-B-64"]).outputs
    assert o.slot_mapping.dtype == np.int64
    assert o.slot_mapping[0].tolist() == [(2**31 - 1) * 64 + 63, (2**31 - 1) * 64 + 0]


def test_each_error_bit_and_its_first_bad_token():
    cases = edge_cases()
    r = run(cases["error-2-negative-block"])
    assert r.error_mask == 2 and decode_error_key(r.error_key) == (1, 1, 0, 2)
    assert r.outputs.slot_mapping[0].tolist() == [7 * 16 + 5, -1]
    r = run(cases["error-4-capacity"])
    assert r.error_mask == 4 and decode_error_key(r.error_key) == (5, 1, 0, 4)
    assert r.outputs.cu_seqlens_q.tolist() == [0, 3, 7] and int(r.outputs.num_tokens) == 5
    assert r.outputs.batch_id_per_token.tolist() == [0, 0, 0, 1, 1]
    r = run(cases["error-8-negative-length"])
    assert r.error_mask == 8 and decode_error_key(r.error_key) == (1, 1, 0, 8)
    assert r.outputs.cu_seqlens_q.tolist() == [0, 1, 1, 1] and r.outputs.seq_lens_kv.tolist() == [5, 0, 0]
    assert r.outputs.batch_id_per_token.tolist() == [0, -1, -1]
    assert run(WORKED_EXAMPLES[0][1]).error_key == NO_ERROR_KEY


def test_int32_positions_option():
    case = dict(WORKED_EXAMPLES[0][1], position_dtype=np.int32)
    o = run(case).outputs
    assert o.position_ids.dtype == np.int32 and o.position_ids.tolist() == [5, 0, 1, 2, 9, 10, 0, 0]


def test_positions_only():
    c = WORKED_EXAMPLES[0][1]
    o = step_addressing(c["seq_lens_decoder"], c["seq_lens_this_time"], [], [], 8).outputs
    assert o.slot_mapping.shape == (0, 8) and o.position_ids.tolist() == [5, 0, 1, 2, 9, 10, 0, 0]


def test_cu_seqlens_saturate_instead_of_wrapping():
    q = np.array([2**30, 2**30, 2**30], dtype=np.int32)
    r = step_addressing(np.zeros(3, np.int32), q, np.zeros((3, 1), np.int32), [2**31 - 1], 4)
    assert r.outputs.cu_seqlens_q.tolist() == [0, 2**30, 2**31 - 1, 2**31 - 1]
    assert r.error_mask == 4 and int(r.outputs.num_tokens) == 4


@given(seed=st.integers(0, 2**32 - 1), errors=st.booleans(), over=st.booleans())
def test_random_steps_match_naive_loop(seed, errors, over):
    rng = np.random.default_rng(seed)
    assert_matches_naive(random_step(rng, max_bsz=24, errors=errors, over_capacity=over))
