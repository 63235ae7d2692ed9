"""The attention-metadata reference (docs/attention.md): worked examples, host errors, and
hypothesis against an independent per-request loop; the CPU strategies against it."""

import numpy as np
import pytest
from hypothesis import given, settings

from kvaddr import attention_reference as ar
from kvaddr import errors
from kvaddr.errors import AddressingError
from kvaddr.outputs import ATTENTION_FIELDS, OUTPUT_FIELDS, PAD_PAGE_ID, AttentionOutputs
from kvaddr.reference import step_addressing
from kvaddr.strategies import cpu as cpu_strategies
from tests.support.attention_cases import ALL_GROUPS, make_case, mixed_cases
from tests.support.step_cases import naive_reference

I32 = np.int32


def _a(x):
    return np.asarray(x, dtype=I32)


def run(case, **over):
    kw = dict(case)
    kw.update(over)
    return step_addressing(
        kw.pop("seq_lens_decoder"),
        kw.pop("seq_lens_this_time"),
        kw.pop("block_tables"),
        kw.pop("block_sizes"),
        kw.pop("capacity"),
        **kw,
    )


EXAMPLE_1 = dict(
    seq_lens_decoder=_a([5, 0, 9]),
    seq_lens_this_time=_a([1, 3, 2]),
    block_tables=_a([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]]),
    block_sizes=[4],
    capacity=8,
)

TABLE0 = _a([[5, 6, -1], [9, -1, -1], [2, 0, -1], [-1, -1, -1]])
TABLE1 = _a([[10, 11, 12, 13], [14, 15, -1, -1], [16, 17, 18, -1], [-1, -1, -1, -1]])
EXAMPLE_2 = dict(
    seq_lens_decoder=_a([8, 0, 3, 0]),
    seq_lens_this_time=_a([0, 4, 2, 0]),
    block_tables=[TABLE0, TABLE1],
    block_sizes=[4, 2],
    capacity=8,
)


# -- worked examples (docs/attention.md) -------------------------------------------


def test_example_1_every_group():
    res = run(EXAMPLE_1, attention=ALL_GROUPS, kv_indices_capacity=8)
    a = res.outputs.attention
    assert res.error_mask == 0 and res.first_bad is None
    assert a.qo_indptr.tolist() == [0, 1, 4, 6]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 6]]
    assert a.kv_indices.tolist() == [[7, 2, 4, 1, 3, 8, -1, -1]]
    assert a.kv_last_page_len.tolist() == [[2, 3, 3]]
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20]
    assert a.seqused_k.tolist() == [6, 3, 11]
    assert int(a.max_seqlen_q) == 3 and int(a.max_seqlen_k) == 11
    assert len(a.page_table) == 1 and a.page_table[0].tolist() == EXAMPLE_1["block_tables"].tolist()
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "seqused_k"):
        assert getattr(a, f).dtype == np.int32, f
    assert a.max_seqlen_q.shape == () and a.max_seqlen_k.dtype == np.int32


def test_example_2_mixed_batch_two_caches():
    res = run(EXAMPLE_2, attention="flashinfer,varlen", kv_indices_capacity=9)
    a = res.outputs.attention
    assert res.error_mask == 0
    assert a.qo_indptr.tolist() == [0, 0, 4, 6, 6]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 5, 5], [0, 4, 6, 9, 9]]
    assert a.kv_last_page_len.tolist() == [[4, 4, 1, 0], [2, 2, 1, 0]]
    assert a.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1, -1, -1, -1], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    assert a.cu_seqlens_k.tolist() == [0, 8, 12, 17, 17]
    assert a.seqused_k.tolist() == [8, 4, 5, 0]
    assert int(a.max_seqlen_q) == 4 and int(a.max_seqlen_k) == 8
    assert a.page_table is None


def test_example_2_capacity_overflow_bit_16():
    res = run(EXAMPLE_2, attention="flashinfer", kv_indices_capacity=6)
    a = res.outputs.attention
    assert a.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1], [10, 11, 12, 13, 14, 15]]
    assert a.kv_indptr.tolist() == [[0, 2, 3, 5, 5], [0, 4, 6, 9, 9]]  # true sums
    assert res.error_mask == ar.ERR_KV_INDICES_CAPACITY
    assert res.first_bad == (4, 2, 1, 16)
    with pytest.raises(AddressingError, match=r"token 4 of request 2, cache 1: more kv_indices entries"):
        res.check()
    # the addressing outputs are those of the step without attention
    plain = run(EXAMPLE_2)
    for f in OUTPUT_FIELDS:
        np.testing.assert_array_equal(getattr(res.outputs, f), getattr(plain.outputs, f))
    assert plain.outputs.attention is None


def test_example_3_bad_rows():
    case = dict(
        seq_lens_decoder=_a([5, 12]),
        seq_lens_this_time=_a([0, 1]),
        block_tables=_a([[3, -1, -1], [1, 2, 4]]),
        block_sizes=[4],
        capacity=4,
    )
    res = run(case, attention="flashinfer", kv_indices_capacity=8)
    a = res.outputs.attention
    assert a.kv_indptr.tolist() == [[0, 2, 6]]
    assert a.kv_indices.tolist() == [[3, -1, 1, 2, 4, -1, -1, -1]]
    assert a.kv_last_page_len.tolist() == [[1, 1]]
    assert res.error_mask == 3 and res.first_bad == (0, 0, 0, 2)
    with pytest.raises(AddressingError, match="token 0 of request 0, cache 0: negative"):
        res.check()


def test_page_table_alone_flags_a_narrow_row_keyed_at_the_first_token():
    # request 1 is idle (no token to flag through the slot mapping) and needs 3 pages of a 2-wide row
    case = dict(
        seq_lens_decoder=_a([1, 9]),
        seq_lens_this_time=_a([2, 0]),
        block_tables=_a([[4, -1], [5, 6]]),
        block_sizes=[4],
        capacity=4,
    )
    assert run(case).error_mask == 0
    res = run(case, attention=["page_table"])
    assert res.error_mask == 1 and res.first_bad == (2, 1, 0, 1)
    assert res.outputs.attention.kv_indices is None
    assert run(case, attention="varlen").error_mask == 0  # varlen reads no table


def test_attention_off_changes_nothing():
    for att in (None, "", ()):
        res = run(EXAMPLE_1, attention=att)
        assert res.outputs.attention is None
        assert res.error_key == run(EXAMPLE_1).error_key


def test_negative_length_request_has_no_pages():
    case = dict(EXAMPLE_1, seq_lens_decoder=_a([5, -1, 9]))
    res = run(case, attention=ALL_GROUPS, kv_indices_capacity=8)
    a = res.outputs.attention
    assert res.error_mask == 8 and res.first_bad == (1, 1, 0, 8)
    assert a.seqused_k.tolist() == [6, 0, 11]
    assert a.kv_indptr.tolist() == [[0, 2, 2, 5]]
    assert a.kv_last_page_len.tolist() == [[2, 0, 3]]
    assert a.kv_indices.tolist() == [[7, 2, 1, 3, 8, -1, -1, -1]]


def test_empty_batch():
    case = dict(
        seq_lens_decoder=_a([]),
        seq_lens_this_time=_a([]),
        block_tables=np.zeros((0, 4), I32),
        block_sizes=[16],
        capacity=8,
    )
    a = run(case, attention=ALL_GROUPS, kv_indices_capacity=3).outputs.attention
    assert a.kv_indptr.tolist() == [[0]] and a.kv_indices.tolist() == [[-1, -1, -1]]
    assert a.cu_seqlens_k.tolist() == [0] and int(a.max_seqlen_q) == 0 and int(a.max_seqlen_k) == 0
    assert a.page_table[0].shape == (0, 4)


def test_saturating_sums():
    big = 2**31 - 1
    case = dict(
        seq_lens_decoder=_a([big - 1, big - 1]),
        seq_lens_this_time=_a([1, 1]),
        block_tables=_a([[0], [1]]),
        block_sizes=[1],
        capacity=2,
    )
    res = run(case, attention=ALL_GROUPS, kv_indices_capacity=4)
    a = res.outputs.attention
    assert a.cu_seqlens_k.tolist() == [0, big, big]
    assert a.kv_indptr.tolist() == [[0, big, big]]
    assert a.kv_indices.tolist() == [[0, -1, -1, -1]]  # request 0's page 1 is beyond its 1-wide row
    assert res.error_mask & (1 | 16) == (1 | 16)


def test_error_key_layout_orders_like_the_tuples():
    recs = [(0, 0, 0, 1), (0, 0, 0, 16), (0, 0, 1, 1), (0, 1, 0, 2), (3, 0, 3, 8), (2**31 - 1, 2**27 - 1, 3, 16)]
    keys = [errors.error_key(*r) for r in recs]
    assert keys == sorted(keys)
    assert [errors.decode_error_key(k) for k in keys] == recs
    assert errors.error_key(5, 3, 2, 16) == (5 << 32) | (3 << 5) | (2 << 3) | 4
    with pytest.raises(ValueError, match="cache must be in"):
        errors.error_key(0, 0, 4, 1)
    with pytest.raises(ValueError, match="bit must be one error bit"):
        errors.error_key(0, 0, 0, 3)
    # one layout: the reference module re-exports the bit, keeps no key of its own
    assert ar.ERR_KV_INDICES_CAPACITY == errors.ERR_KV_INDICES_CAPACITY == 16
    assert not hasattr(ar, "error_key") and not hasattr(ar, "AttentionAddressingError")


# -- host errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "exc", "msg"),
    [
        (dict(attention="flashinfer"), ValueError, r"kv_indices_capacity must be an int in \[1, 2147483647\]"),
        (dict(attention="flashinfer", kv_indices_capacity=0), ValueError, r"kv_indices_capacity must be an int"),
        (dict(attention="flashinfer,paged"), ValueError, r"attention must name groups among .*'paged'"),
        (dict(attention=5), TypeError, r"attention must be None, a comma-separated str"),
        (dict(attention="page_table", block_sizes=[]), ValueError, r"need at least one cache"),
    ],
)
def test_host_errors_name_the_argument(over, exc, msg):
    case = dict(EXAMPLE_1)
    if over.get("block_sizes") == []:
        case["block_tables"] = []
    with pytest.raises(exc, match=msg):
        run(case, **over)


def test_varlen_without_caches():
    case = dict(EXAMPLE_1, block_tables=[], block_sizes=[])
    a = run(case, attention="varlen").outputs.attention
    assert a.cu_seqlens_k.tolist() == [0, 6, 9, 20]


# -- hypothesis against the per-request loop ----------------------------------------


def _lengths(case):
    dec = case["seq_lens_decoder"].astype(np.int64)
    q = case["seq_lens_this_time"].astype(np.int64)
    bad = (dec < 0) | (q < 0)
    n = np.where(bad, 0, q)
    cu = np.concatenate([[0], np.cumsum(n)])
    L = np.where(bad, 0, dec + q)
    return cu, L


def assert_matches_naive(case):
    res = run(case)
    att = run(case, attention=case["attention"], kv_indices_capacity=case["kv_indices_capacity"])
    cu, L = _lengths(case)
    tables = case["block_tables"]
    want = ar.naive_attention_metadata(cu, L, tables, case["block_sizes"], case["kv_indices_capacity"])
    a = att.outputs.attention
    for f in ATTENTION_FIELDS:
        if f == "page_table":
            assert len(a.page_table) == len(tables)
            for t, got in zip(tables, a.page_table):
                np.testing.assert_array_equal(got, t[: L.shape[0]])
            continue
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(want[f]), err_msg=f)
    # addressing unchanged; errors = the step's plus the metadata's; the first record the smallest
    for f in OUTPUT_FIELDS:
        np.testing.assert_array_equal(getattr(att.outputs, f), getattr(res.outputs, f), err_msg=f)
    assert att.error_mask == res.error_mask | want["error_mask"]
    records = ([res.first_bad] if res.first_bad else []) + want["records"]
    assert att.first_bad == (min(records) if records else None)
    # the step-level naive oracle agrees on the lengths the metadata is built from
    step = naive_reference(
        case["seq_lens_decoder"], case["seq_lens_this_time"], tables, case["block_sizes"], case["capacity"]
    )
    np.testing.assert_array_equal(a.seqused_k, step["seq_lens_kv"])


@settings(max_examples=300, deadline=None)
@given(mixed_cases())
def test_reference_matches_the_per_request_loop(case):
    assert_matches_naive(case)


def test_more_than_4096_requests():
    rng = np.random.default_rng(14)
    case = make_case(rng, bsz=5000, block_sizes=[16, 64, 3], max_ctx=300, spare_capacity=0)
    assert_matches_naive(case)
    a = run(case, attention=ALL_GROUPS, kv_indices_capacity=case["kv_indices_capacity"]).outputs.attention
    assert a.kv_indptr.shape == (3, 5001)
    # and overflowing it by one entry drops exactly the last one
    res = run(case, attention="flashinfer", kv_indices_capacity=case["kv_indices_capacity"] - 1)
    assert res.error_mask & 16


def test_uniform_decode_L_multiple_of_B():
    rng = np.random.default_rng(3)
    case = make_case(rng, bsz=64, block_sizes=[64], kinds=("multiple",), spare_capacity=0)
    a = run(case, attention="flashinfer", kv_indices_capacity=case["kv_indices_capacity"]).outputs.attention
    assert (a.kv_last_page_len == 64).all()
    assert (a.kv_indices != PAD_PAGE_ID).all()  # capacity exactly filled
    assert_matches_naive(case)


# -- CPU strategies ------------------------------------------------------------------


def _strategy_outputs(case, name, attention=ALL_GROUPS):
    s = cpu_strategies.make_strategy(
        name,
        max_requests=max(len(case["seq_lens_decoder"]), 1),
        capacity=case["capacity"],
        block_sizes=case["block_sizes"],
        num_layers=2,
        attention=attention,
        kv_indices_capacity=case["kv_indices_capacity"],
    )
    return s, s.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"])


def _assert_attention_equal(got: AttentionOutputs, want: AttentionOutputs):
    for f in ATTENTION_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f
        if f == "page_table" and w is not None:
            for x, y in zip(g, w):
                np.testing.assert_array_equal(x, y)
        elif w is not None:
            np.testing.assert_array_equal(g, w, err_msg=f)


@settings(max_examples=60, deadline=None)
@given(mixed_cases(bad_inputs=False))
def test_cpu_strategies_build_the_same_metadata(case):
    want = run(case, attention=ALL_GROUPS, kv_indices_capacity=case["kv_indices_capacity"])
    for name in cpu_strategies.STRATEGY_NAMES:
        _s, out = _strategy_outputs(case, name)
        _assert_attention_equal(out.attention, want.outputs.attention)
        for f in OUTPUT_FIELDS:
            np.testing.assert_array_equal(getattr(out, f), getattr(want.outputs, f))


def test_cpu_launch_counts_and_default_off():
    case = dict(EXAMPLE_2, attention=ALL_GROUPS, kv_indices_capacity=9)
    s, _ = _strategy_outputs(case, "fused")
    assert s.launches_per_step == 1
    s, _out = _strategy_outputs(case, "hoisted")
    plain = cpu_strategies.make_strategy("hoisted", max_requests=4, capacity=8, block_sizes=[4, 2])
    assert plain.step(case["seq_lens_decoder"], case["seq_lens_this_time"], case["block_tables"]).attention is None
    assert s.launches_per_step == plain.launches_per_step + cpu_strategies.engine_launches(ALL_GROUPS, 2)
    assert cpu_strategies.engine_launches(ALL_GROUPS, 2) == 2 * 6 + 3


def test_fused_cpu_strategy_reports_the_capacity_error():
    case = dict(EXAMPLE_2, attention="flashinfer", kv_indices_capacity=6)
    s, out = _strategy_outputs(case, "fused", attention="flashinfer")
    with pytest.raises(AddressingError, match="more kv_indices entries"):
        s.check()
    s, out = _strategy_outputs(case, "per-layer", attention="flashinfer")
    assert out.attention.kv_indices.tolist() == [[5, 6, 9, 2, 0, -1], [10, 11, 12, 13, 14, 15]]
