"""The vLLM step's attention metadata, NumPy reference (docs/vllm.md, "Attention metadata"):
the worked example by hand, DCP, a per-request loop oracle (hypothesis), bad values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.engines import vllm_errors as E
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.vllm_attention_cases import (
    DEVICE_ROWS,
    WORKED,
    WORKED_DCP,
    assert_attention,
    attention_loop,
)
from tests.support.vllm_cases import I32, corrupt, random_case, worked_example

BOTH = ("flashinfer", "varlen")


def run(cfg, inputs, attention=BOTH, N=8, **kw):
    return vllm_step_reference(cfg, **inputs, attention=attention, kv_indices_capacity=N, **kw)


def test_worked_example_by_hand():
    cfg, x = worked_example()
    res = run(cfg, x)
    a = res.outputs.attention
    assert_attention(a, WORKED)
    assert res.error_mask == 0
    # seqused_k is seq_lens itself; the page table is the gathered table itself
    assert a.seqused_k[0] is res.outputs.seq_lens
    assert run(cfg, x, attention=BOTH + ("page_table",)).outputs.attention.page_table[0].tolist() == [
        [7, 2, 0, 0],
        [1, 3, 8, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp_uses_the_local_lengths(rank):
    cfg, x = worked_example(cp_size=2, cp_rank=rank, cp_interleave=1)
    res = run(cfg, x)
    assert_attention(res.outputs.attention, {**WORKED, **WORKED_DCP[rank]})
    assert res.outputs.attention.seqused_k[0] is res.outputs.dcp_local_seq_lens


def test_unsharded_group_under_dcp_uses_seq_lens():
    cfg, x = worked_example(cp_size=2, cp_rank=1, dcp_sharded=[False])
    assert_attention(run(cfg, x).outputs.attention, WORKED)


def test_groups_asked_for_only():
    cfg, x = worked_example()
    a = run(cfg, x, attention="varlen", N=None).outputs.attention
    assert a.kv_indptr is None and a.kv_indices is None and a.cu_seqlens_k is not None
    assert a.qo_indptr.tolist() == WORKED["qo_indptr"]
    a = run(cfg, x, attention=["flashinfer"]).outputs.attention
    assert a.cu_seqlens_k is None and a.max_seqlen_q is None and a.kv_indptr is not None
    assert run(cfg, x, attention=None).outputs.attention is None
    with pytest.raises(ValueError, match="kv_indices_capacity must be an int"):
        run(cfg, x, attention="flashinfer", N=None)
    with pytest.raises(ValueError, match="attention must name groups"):
        run(cfg, x, attention="flashmla")


def test_dummy_and_padding_requests_have_zero_length():
    cfg, x = worked_example()
    x["idx_mapping"] = np.array([2, -1], I32)  # request 1 a dummy: its 2 query tokens, no KV
    a = run(cfg, x).outputs.attention
    assert a.qo_indptr.tolist() == [0, 1, 3, 3, 3]
    assert a.kv_indptr.tolist() == [[0, 2, 2, 2, 2]]
    assert a.kv_last_page_len.tolist() == [[2, 0, 0, 0]]
    assert a.cu_seqlens_k.tolist() == [[0, 6, 6, 6, 6]]
    assert int(a.max_seqlen_q) == 2 and a.max_seqlen_k.tolist() == [6]
    assert a.kv_indices.tolist() == [[7, 2, -1, -1, -1, -1, -1, -1]]


def test_empty_batch():
    cfg, x = worked_example()
    x["idx_mapping"] = np.zeros(0, I32)
    x["query_start_loc"] = np.array([0], I32)
    a = run(cfg, x).outputs.attention
    assert a.qo_indptr.tolist() == [0] * 5 and a.kv_indptr.tolist() == [[0] * 5]
    assert int(a.max_seqlen_q) == 0 and a.max_seqlen_k.tolist() == [0]
    assert (a.kv_indices == -1).all()


@pytest.mark.parametrize("row", DEVICE_ROWS, ids=[r[0] for r in DEVICE_ROWS])
def test_bad_values_set_bits_and_keys(row):
    _, make, N, bits, key = row
    cfg, x = make()
    res = run(cfg, x, N=N)
    assert res.attention_errors[0] == bits
    assert E.decode_vllm_error_key(res.attention_errors[1]) == key
    assert res.error_mask & bits and E.decode_vllm_error_key(res.error_key) == key
    with pytest.raises(E.VllmAddressingError):
        res.check()


def test_capacity_drops_entries_past_it():
    cfg, x = worked_example()
    a = run(cfg, x, N=4).outputs.attention
    assert a.kv_indices.tolist() == [[7, 2, 1, 3]]
    assert a.kv_indptr.tolist() == [[0, 2, 5, 5, 5]]  # the true sums


def test_error_message_names_the_capacity():
    cfg, x = worked_example()
    with pytest.raises(E.VllmAddressingError, match="kv_indices needs more entries than kv_indices_capacity"):
        run(cfg, x, N=4).check()


def _check_loop(cfg, x, N, label):
    res = run(cfg, x, N=N)
    o = res.outputs
    want = attention_loop(cfg, x, o.seq_lens, o.dcp_local_seq_lens, o.input_block_tables, N)
    assert_attention(o.attention, want, label=label)
    keys = want["keys"]
    mask = 0
    for bit in keys:
        mask |= bit
    assert res.attention_errors[0] == mask, label
    if keys:
        first = min((t, b, g, bit) for bit, (t, b, g) in keys.items())
        assert E.decode_vllm_error_key(res.attention_errors[1]) == first, label
    for g in range(cfg.num_groups):
        want_used = o.dcp_local_seq_lens if cfg.sharded(g) else o.seq_lens
        assert np.array_equal(o.attention.seqused_k[g], want_used)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_matches_the_per_request_loop(data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    G = data.draw(st.integers(1, 4))
    block_sizes = data.draw(st.lists(st.sampled_from([1, 3, 4, 16, 24, 64]), min_size=G, max_size=G))
    cp = data.draw(st.sampled_from([1, 1, 2, 4]))
    M = data.draw(st.integers(1, 40))
    n = data.draw(st.integers(0, M))
    sharded = [data.draw(st.booleans()) for _ in range(G)]
    il = 1
    if cp > 1 and data.draw(st.booleans()) and any(sharded):
        il = min(b for b, s in zip(block_sizes, sharded) if s)
        il = il if all(b % il == 0 for b, s in zip(block_sizes, sharded) if s) else 1
    reach = [0 if (cp > 1 and s) else data.draw(st.sampled_from([0, 0, 7, 64])) for s in sharded]
    cfg, x = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=n,
        block_sizes=block_sizes,
        max_query=data.draw(st.sampled_from([1, 3, 40])),
        max_context=data.draw(st.sampled_from([0, 5, 300])),
        dummy_fraction=data.draw(st.sampled_from([0.0, 0.3])),
        cp_size=cp,
        cp_rank=data.draw(st.integers(0, cp - 1)),
        cp_interleave=il,
        dcp_sharded=sharded,
        sliding_window_reach=reach,
    )
    if data.draw(st.booleans()):
        x = corrupt(rng, cfg, x, rate=0.15)
    N = data.draw(st.sampled_from([1, 7, 64, 5000]))
    _check_loop(cfg, x, N, f"seed {seed}")
