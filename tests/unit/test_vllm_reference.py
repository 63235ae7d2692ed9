"""The vLLM step's NumPy reference: worked examples, a per-token loop, DCP properties, bad values."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaddr.engines import vllm_errors as E
from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_reference import owner_search, vllm_step_reference
from tests.support.vllm_cases import I32, assert_same, loop_reference, random_case, worked_example


def run(cfg, inputs, **kw):
    return vllm_step_reference(cfg, **inputs, **kw)


def test_worked_example():
    cfg, inputs = worked_example()
    res = run(cfg, inputs)
    o = res.outputs
    assert o.positions.tolist() == [5, 9, 10, 0, 0, 0]
    assert o.seq_lens.tolist() == [6, 11, 0, 0]
    assert o.slot_mappings.tolist() == [[9, 33, 34, -1, -1, -1]]
    assert o.input_block_tables[0].tolist() == [[7, 2, 0, 0], [1, 3, 8, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert o.dcp_local_seq_lens.tolist() == [6, 11, 0, 0]
    assert res.num_tokens == 3 and res.error_mask == 0
    res.check()


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp(rank):
    cfg, inputs = worked_example(cp_size=2, cp_rank=rank, cp_interleave=1)
    o = run(cfg, inputs).outputs
    # request 0 (position 5, row [7, 2]): vb 0, vo 5, owner (5 // 1) % 2 = 1.
    if rank == 0:
        assert o.slot_mappings[0, 0] == -1
    else:
        assert o.slot_mappings[0, 0] == 7 * 4 + 2  # lo = (5 // 2) * 1 + 0 = 2
    assert o.dcp_local_seq_lens[0] == 3  # s = 6: 3 * 1 + clamp(0 - rank, 0, 1)
    # request 1: positions 9 (vb 1, vo 1: rank 1, lo 0) and 10 (vo 2: rank 0, lo 1), row [1, 3, 8]
    assert o.slot_mappings[0, 1:3].tolist() == ([-1, 3 * 4 + 1] if rank == 0 else [3 * 4 + 0, -1])


def test_worked_example_matches_the_loop():
    cfg, inputs = worked_example()
    assert_same(run(cfg, inputs).outputs, loop_reference(cfg, inputs))


def test_sliding_window_nulls_the_gathered_prefix():
    cfg, inputs = worked_example(sliding_window_reach=[4])
    g = run(cfg, inputs).outputs.input_block_tables[0]
    # request 0 (row 2, nct 5): max(5 - 4, 0) // 4 = 0 nulled; request 1 (row 0, nct 9): 5 // 4 = 1 nulled
    assert g[0].tolist() == [7, 2, 0, 0] and g[1].tolist() == [0, 3, 8, 0]


def test_disabled_group_and_dummy_request():
    cfg, inputs = worked_example(block_sizes=[4, 4], widths=[4, 4], slot_mapping_enabled=[True, False])
    inputs["block_tables"] = inputs["block_tables"] * 2
    inputs["num_blocks"] = inputs["num_blocks"] * 2
    inputs["idx_mapping"] = np.array([2, -1], I32)
    o = run(cfg, inputs).outputs
    assert o.slot_mappings.tolist() == [[9, -1, -1, -1, -1, -1], [-1] * 6]
    assert o.positions.tolist() == [5, 0, 0, 0, 0, 0]
    assert o.seq_lens.tolist() == [6, 0, 0, 0]
    assert o.input_block_tables[1][1].tolist() == [0, 0, 0, 0]


def test_int64_idx_mapping_and_stacked_num_blocks():
    cfg, inputs = worked_example()
    a = run(cfg, inputs).outputs
    inputs["idx_mapping"] = inputs["idx_mapping"].astype(np.int64)
    inputs["num_blocks"] = inputs["num_blocks"][0][None, :]
    assert_same(run(cfg, inputs).outputs, a.as_dict())


@given(st.data())
def test_matches_the_per_token_loop(data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    G = data.draw(st.integers(1, 4))
    block_sizes = data.draw(st.lists(st.sampled_from([1, 3, 4, 16, 24, 64]), min_size=G, max_size=G))
    cp = data.draw(st.sampled_from([1, 1, 2, 4, 8]))
    M = data.draw(st.integers(1, 40))
    n = data.draw(st.integers(0, M))
    sharded = [data.draw(st.booleans()) for _ in range(G)]
    il = 1
    if cp > 1 and data.draw(st.booleans()):
        il = min(b for b, s in zip(block_sizes, sharded) if s) if any(sharded) else 1
        il = il if all(b % il == 0 for b, s in zip(block_sizes, sharded) if s) else 1
    reach = [0 if (cp > 1 and s) else data.draw(st.sampled_from([0, 0, 7, 64])) for s in sharded]
    cfg, inputs = random_case(
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
        slot_mapping_enabled=[data.draw(st.booleans()) or g == 0 for g in range(G)],
        dcp_sharded=sharded,
        sliding_window_reach=reach,
        idx_dtype=data.draw(st.sampled_from([np.int32, np.int64])),
        spare_tokens=data.draw(st.integers(0, 9)),
    )
    res = run(cfg, inputs, num_reqs_padded=data.draw(st.integers(n, M)))
    assert res.error_mask == 0, hex(res.error_key)
    assert_same(res.outputs, loop_reference(cfg, inputs), f"seed {seed}")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("interleave", ["1", "B"])
@pytest.mark.parametrize("seed", range(3))
def test_dcp_ranks_partition_every_token_and_length(cp, interleave, seed):
    B = 16
    il = 1 if interleave == "1" else B
    rng = np.random.default_rng(seed)
    per_rank = []
    for rank in range(cp):
        cfg, inputs = random_case(
            np.random.default_rng(seed),
            max_num_reqs=30,
            num_reqs=20,
            block_sizes=[B],
            max_query=20,
            cp_size=cp,
            cp_rank=rank,
            cp_interleave=il,
        )
        per_rank.append((cfg, inputs, run(cfg, inputs).outputs))
    del rng
    cfg0, inputs, o0 = per_rank[0]
    # The global mapping: the same batch without DCP, on the "virtual" block table:
    # token p lives in virtual block p // (B*cp) at local offset lo on its owner rank.
    T = cfg0.max_num_batched_tokens
    owners = np.full(T, -1)
    for rank, (_, _, o) in enumerate(per_rank):
        local = o.slot_mappings[0] >= 0
        assert not (local & (owners >= 0)).any(), "a token is local on two ranks"
        owners[local] = rank
    real = o0.positions[: int(inputs["query_start_loc"][-1])]
    qsl = inputs["query_start_loc"]
    idx = inputs["idx_mapping"]
    is_real = np.zeros(T, bool)
    for b in range(len(idx)):
        if idx[b] >= 0:
            is_real[qsl[b] : qsl[b + 1]] = True
    assert (owners[is_real] >= 0).all(), "a real token is local on no rank"
    assert (owners[~is_real] == -1).all()
    pos = o0.positions
    expect_owner = (pos % (B * cp)) // il % cp
    assert (owners[is_real] == expect_owner[is_real]).all()
    assert real.shape[0] <= T
    total = sum(o.dcp_local_seq_lens.astype(np.int64) for _, _, o in per_rank)
    assert (total == o0.seq_lens).all()
    # Each rank's local lengths count exactly the positions < s it owns.
    for rank, (_, _, o) in enumerate(per_rank):
        for b in range(len(idx)):
            s = int(o.seq_lens[b])
            p = np.arange(s)
            assert o.dcp_local_seq_lens[b] == int(((p % (B * cp)) // il % cp == rank).sum())


def test_owner_search_is_the_interval_search_for_monotone_qsl():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        q = rng.integers(0, 4, n)
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(q, out=qsl[1:])
        t = np.arange(int(qsl[-1]), dtype=np.int64)
        b = owner_search(qsl, t, n)
        assert ((qsl[b] <= t) & (t < qsl[b + 1])).all()


def test_owner_search_stays_in_bounds_on_a_decreasing_qsl():
    qsl = np.array([0, 5, 3, 8, 2, 9], np.int64)
    b = owner_search(qsl, np.arange(9, dtype=np.int64), 5)
    assert ((b >= 0) & (b < 5)).all()


# -- bad values: error bits, first-bad keys, never out of bounds ---------------------------


def _bad(**over):
    cfg, inputs = worked_example(**over.pop("config", {}))
    for k, v in over.items():
        inputs[k] = v
    return cfg, inputs


BAD = {
    "row-index": (dict(idx_mapping=np.array([2, 4], I32)), E.VERR_ROW_INDEX, (1, 1, 0)),
    "row-below-minus-one": (dict(idx_mapping=np.array([-2, 0], I32)), E.VERR_ROW_INDEX, (0, 0, 0)),
    "qsl-decreasing": (dict(query_start_loc=np.array([0, 2, 1], I32)), E.VERR_QUERY_START_LOC, (2, 1, 0)),
    "qsl-past-capacity": (
        dict(
            query_start_loc=np.array([0, 1, 9], I32),
            block_tables=[np.array([[1, 3, 8, 6], [0] * 4, [7, 2, -1, -1], [0] * 4], I32)],
            num_blocks=[np.array([4, 0, 2, 0], I32)],
        ),
        E.VERR_CAPACITY,
        (6, 1, 0),
    ),
    "negative-computed": (
        dict(num_computed_tokens=np.array([9, 0, -5, 0], I32)),
        E.VERR_NEGATIVE_COMPUTED,
        (0, 0, 0),
    ),
    "block-index-past-width": (
        dict(num_computed_tokens=np.array([16, 0, 5, 0], I32)),
        E.VERR_BLOCK_INDEX,
        (1, 1, 0),
    ),
    "past-num-blocks": (
        dict(num_computed_tokens=np.array([11, 0, 5, 0], I32)),
        E.VERR_PAST_NUM_BLOCKS,
        (2, 1, 0),
    ),
    "negative-block": (
        dict(block_tables=[np.array([[1, 3, -1, -1], [0] * 4, [7, 2, -1, -1], [0] * 4], I32)]),
        E.VERR_NEGATIVE_BLOCK,
        (1, 1, 0),
    ),
    "num-blocks-past-width": (dict(num_blocks=[np.array([5, 0, 2, 0], I32)]), E.VERR_NUM_BLOCKS, (1, 1, 0)),
    "num-blocks-negative": (dict(num_blocks=[np.array([3, 0, -1, 0], I32)]), None, None),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_values_set_bits_and_keys(name):
    over, bit, where = BAD[name]
    cfg, inputs = _bad(**over)
    res = run(cfg, inputs)
    if name == "num-blocks-negative":
        # request 0 (row 2): num_blocks -1: bit 64 at its gather, bit 16 for its token
        assert res.error_mask == E.VERR_NUM_BLOCKS | E.VERR_PAST_NUM_BLOCKS
        assert res.outputs.input_block_tables[0][0].tolist() == [0, 0, 0, 0]
        assert res.outputs.slot_mappings[0, 0] == -1
        return
    assert res.error_mask & bit, res.error_mask
    token, request, group = where
    assert E.decode_vllm_error_key(res.error_key) == (token, request, group, bit)
    with pytest.raises(E.VllmAddressingError, match=re.escape(E.VLLM_ERROR_REASONS[bit])):
        res.check()


def test_skipped_request_is_padding():
    cfg, inputs = _bad(idx_mapping=np.array([2, 4], I32))
    o = run(cfg, inputs).outputs
    assert o.positions.tolist() == [5, 0, 0, 0, 0, 0]
    assert o.seq_lens.tolist() == [6, 0, 0, 0]
    assert o.slot_mappings.tolist() == [[9, -1, -1, -1, -1, -1]]
    assert o.input_block_tables[0][1].tolist() == [0, 0, 0, 0]


def test_capacity_drops_tokens_past_it():
    cfg, inputs = _bad(query_start_loc=np.array([0, 1, 9], I32))
    res = run(cfg, inputs)
    assert res.num_tokens == 6
    assert res.outputs.positions.tolist() == [5, 9, 10, 11, 12, 13]
    assert res.outputs.seq_lens.tolist() == [6, 17, 0, 0]


def test_int32_slot_overflow_is_refused_not_wrapped():
    cfg, inputs = worked_example(slot_dtype=np.int32, block_sizes=[64], widths=[4])
    inputs["block_tables"] = [np.array([[1, 3, 8, -1], [0] * 4, [2**30, 2, -1, -1], [0] * 4], I32)]
    res = run(cfg, inputs)
    assert res.outputs.slot_mappings.dtype == np.int32
    assert res.outputs.slot_mappings[0, 0] == -1  # 2**30 * 64 + 5 does not fit
    assert res.outputs.slot_mappings[0, 1] == 64 + 9
    assert res.error_mask == E.VERR_SLOT_INT32
    assert E.decode_vllm_error_key(res.error_key) == (0, 0, 0, E.VERR_SLOT_INT32)


def test_int64_slots_hold_the_largest_block_id():
    cfg, inputs = worked_example(block_sizes=[64], widths=[4])
    inputs["block_tables"] = [np.array([[1, 3, 8, -1], [0] * 4, [2**31 - 1, 2, -1, -1], [0] * 4], I32)]
    res = run(cfg, inputs)
    assert res.outputs.slot_mappings[0, 0] == (2**31 - 1) * 64 + 5 and res.error_mask == 0


def test_first_bad_key_is_the_smallest():
    cfg, inputs = _bad(
        idx_mapping=np.array([2, 4], I32), num_computed_tokens=np.array([9, 0, 16, 0], I32)
    )  # request 1: row index (token 1); request 0 token 0: block index past width
    res = run(cfg, inputs)
    assert res.error_mask == E.VERR_ROW_INDEX | E.VERR_BLOCK_INDEX
    assert E.decode_vllm_error_key(res.error_key) == (0, 0, 0, E.VERR_BLOCK_INDEX)


def test_empty_batch_pads_everything():
    cfg, inputs = worked_example()
    inputs.update(idx_mapping=np.zeros(0, I32), query_start_loc=np.zeros(1, I32))
    o = run(cfg, inputs).outputs
    assert (o.positions == 0).all() and (o.slot_mappings == -1).all() and (o.seq_lens == 0).all()
    assert (o.input_block_tables[0] == 0).all()


def test_config_rejects_sliding_window_on_a_sharded_group():
    with pytest.raises(ValueError, match=r"sliding_window_reach\[0\] must be 0 for a DCP-sharded group"):
        VllmStepConfig(4, 8, [16], [4], cp_size=2, sliding_window_reach=[32])
    VllmStepConfig(4, 8, [16], [4], cp_size=2, dcp_sharded=[False], sliding_window_reach=[32])


def test_request_error_key_is_the_smallest_not_the_first():
    # Requests 1 and 2 are both bad rows; request 2 starts at token 0 (a decreasing
    # query_start_loc), so its key (token 0) is smaller than request 1's (token 3).
    cfg = VllmStepConfig(4, 8, [4], [4])
    nct = np.zeros(4, I32)
    t = np.zeros((4, 4), I32)
    res = vllm_step_reference(cfg, np.array([0, 7, 9], I32), np.array([0, 3, 0, 2], I32), nct, t, np.ones(4, I32))
    assert res.error_mask == E.VERR_ROW_INDEX | E.VERR_QUERY_START_LOC
    assert E.decode_vllm_error_key(res.error_key) == (0, 2, 0, E.VERR_ROW_INDEX)


@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4]), st.sampled_from([np.int32, np.int64]))
def test_corrupted_inputs_never_raise_and_stay_in_bounds(seed, cp, slot_dtype):
    from tests.support.vllm_cases import corrupt

    rng = np.random.default_rng(seed)
    cfg, inputs = random_case(
        rng, max_num_reqs=30, num_reqs=25, block_sizes=(4, 16), max_query=6, cp_size=cp, slot_dtype=slot_dtype
    )
    bad = corrupt(rng, cfg, inputs, rate=0.2)
    res = run(cfg, bad)
    o = res.outputs
    T = cfg.max_num_batched_tokens
    assert o.positions.shape == (T,) and o.slot_mappings.shape == (2, T)
    assert ((o.slot_mappings == -1) | (o.slot_mappings >= 0)).all()
    assert (o.seq_lens >= 0).all() and (o.dcp_local_seq_lens >= 0).all()
    assert (o.input_block_tables[0].shape == (30, cfg.widths[0])) and (o.positions >= 0).all()
    if res.error_mask == 0:
        assert_same(o, loop_reference(cfg, bad))


def test_no_requests_but_tokens_are_all_padding():
    cfg, inputs = worked_example()
    inputs.update(idx_mapping=np.zeros(0, I32), query_start_loc=np.array([4], I32))
    res = run(cfg, inputs)
    assert res.num_tokens == 4 and res.error_mask == 0
    assert (res.outputs.slot_mappings == -1).all() and (res.outputs.positions == 0).all()
