"""Mrv2Addressing on the CPU: MRV2's call order over many steps, its buffers as torch CPU
tensors, the NumPy reference standing in for the one launch (tests/support/mrv2_standin.py),
every buffer compared with MRV2's own per-call functions (written independently in the
stand-in). Also: the switch, the debug checks, the fallbacks and the zeroing after them. The
same drive runs on a GPU against the three-launch baseline in tests/gpu/test_vllm_mrv2_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvaddr.engines.vllm_mrv2 import Mrv2Addressing, Mrv2ArgumentError  # noqa: E402
from tests.support.mrv2_standin import (  # noqa: E402
    Mrv2StandIn,
    ReferenceStep,
    check_step,
    expected,
    standin_prepare_pos_seq_lens,
)


def make(block_sizes=(16,), *, seed=0, M=24, T=96, max_model_len=200, reach=None, debug=True, **kw):
    mrv2 = Mrv2StandIn(
        max_num_reqs=M,
        max_num_batched_tokens=T,
        block_sizes=list(block_sizes),
        max_model_len=max_model_len,
        device="cpu",
        seed=seed,
        sliding_window_reach=reach,
    )
    step = ReferenceStep.of(mrv2)
    addr = Mrv2Addressing(
        mrv2.block_tables,
        mrv2.num_computed_tokens,
        mrv2.positions,
        mrv2.seq_lens,
        prepare_pos_seq_lens=standin_prepare_pos_seq_lens,
        debug=debug,
        step=step,
        **kw,
    )
    return mrv2, addr, step


@pytest.mark.parametrize("block_sizes", [(16,), (16, 64), (4, 13, 16)])
@pytest.mark.parametrize("max_query", [1, 9])
def test_mrv2_call_order_over_many_steps(block_sizes, max_query):
    mrv2, addr, step = make(block_sizes, seed=len(block_sizes) * 10 + max_query)
    bt = mrv2.block_tables
    for k in range(25):
        batch = mrv2.schedule(max_query)
        tables, slots = mrv2.run_step(addr, batch)
        assert step.launches == k + 1
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)
    # every step's gather and slot mapping came from the launch: vLLM's own ran only in expected()
    assert bt.calls == {"gather_block_tables": 25, "compute_slot_mappings": 25}


def test_sliding_window_groups():
    mrv2, addr, _step = make((16, 16), seed=3, reach=[0, 40], max_model_len=300)
    for k in range(15):
        batch = mrv2.schedule(5)
        tables, slots = mrv2.run_step(addr, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)


def test_int64_idx_mapping_and_longer_query_start_loc():
    mrv2, addr, _step = make((16,), seed=4)
    mrv2.idx_mapping_buf = mrv2.idx_mapping_buf.to(torch.int64)
    for k in range(6):
        batch = mrv2.schedule(3)
        # newer MRV2 passes query_start_loc[:num_reqs_padded + 1]: the launch reads num_reqs + 1
        batch.query_start_loc = mrv2.query_start_loc_buf[: batch.num_reqs_padded + 1]
        tables, slots = mrv2.run_step(addr, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)


def test_switched_off_runs_vllms_own_calls():
    mrv2, addr, step = make((16, 64), seed=5, enabled=False)
    bt = mrv2.block_tables
    for k in range(8):
        batch = mrv2.schedule(4)
        if k == 4:
            addr.enabled = True  # and back on: the next launch first zeroes the tables vLLM wrote
        tables, slots = mrv2.run_step(addr, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}", launched=k >= 4)
        mrv2.advance(batch)
    assert step.launches == 4
    # steps 0-3 ran vLLM's gather and slot mapping (and expected() every step)
    assert bt.calls == {"gather_block_tables": 12, "compute_slot_mappings": 12}
    assert all(not t.any() for t in step.seen[0]), "switching on zeroes the tables before the first launch"


def test_switching_off_needs_vllms_function():
    mrv2 = Mrv2StandIn(
        max_num_reqs=4, max_num_batched_tokens=8, block_sizes=[4], max_model_len=16, device="cpu", seed=0
    )
    addr = Mrv2Addressing(
        mrv2.block_tables, mrv2.num_computed_tokens, mrv2.positions, mrv2.seq_lens, step=ReferenceStep.of(mrv2)
    )
    with pytest.raises(TypeError, match="prepare_pos_seq_lens"):
        addr.enabled = False
    with pytest.raises(TypeError, match="prepare_pos_seq_lens"):
        Mrv2Addressing(mrv2.block_tables, mrv2.num_computed_tokens, mrv2.positions, mrv2.seq_lens, enabled=False)


def _one_step(seed=6, **kw):
    mrv2, addr, step = make((16,), seed=seed, **kw)
    batch = mrv2.schedule(3)
    while batch.num_reqs < 2:
        batch = mrv2.schedule(3)
    addr.prepare_pos_seq_lens(
        batch.idx_mapping, batch.query_start_loc, mrv2.num_computed_tokens, mrv2.positions, mrv2.seq_lens
    )
    return mrv2, addr, step, batch


def test_debug_names_a_later_call_that_does_not_match_the_launch():
    mrv2, addr, _step, batch = _one_step()
    other = batch.idx_mapping.clone()
    with pytest.raises(Mrv2ArgumentError, match="gather_block_tables: idx_mapping"):
        addr.gather_block_tables(other, batch.num_reqs_padded)
    mrv2, addr, _step, batch = _one_step()
    with pytest.raises(Mrv2ArgumentError, match="num_reqs_padded"):
        addr.gather_block_tables(batch.idx_mapping, batch.num_reqs - 1)
    mrv2, addr, _step, batch = _one_step()
    batch.idx_mapping[0] = -1 if int(batch.idx_mapping[0]) != -1 else 0
    with pytest.raises(Mrv2ArgumentError, match="idx_mapping's contents changed"):
        addr.gather_block_tables(batch.idx_mapping, batch.num_reqs_padded)
    mrv2, addr, _step, batch = _one_step()
    addr.gather_block_tables(batch.idx_mapping, batch.num_reqs_padded)
    with pytest.raises(Mrv2ArgumentError, match="positions must be a slice"):
        addr.compute_slot_mappings(
            batch.idx_mapping, batch.query_start_loc, mrv2.positions.clone()[: batch.num_tokens], batch.num_tokens
        )
    mrv2, addr, _step, batch = _one_step()
    with pytest.raises(Mrv2ArgumentError, match="query_start_loc"):
        addr.compute_slot_mappings(
            batch.idx_mapping, batch.query_start_loc.clone(), mrv2.positions[: batch.num_tokens], batch.num_tokens
        )
    mrv2, addr, _step, batch = _one_step()
    with pytest.raises(Mrv2ArgumentError, match="num_tokens_padded"):
        addr.compute_slot_mappings(
            batch.idx_mapping, batch.query_start_loc, mrv2.positions[: batch.num_tokens], mrv2.T + 1
        )
    mrv2, addr, _step, batch = _one_step()
    with pytest.raises(Mrv2ArgumentError, match="num_computed_tokens"):
        addr.gather_block_tables(
            batch.idx_mapping, batch.num_reqs_padded, num_computed_tokens=mrv2.num_computed_tokens.clone()
        )


def test_without_debug_a_call_that_is_not_the_steps_runs_vllms_own():
    mrv2, addr, step, batch = _one_step(debug=False)
    bt = mrv2.block_tables
    other = batch.idx_mapping.clone()
    got = addr.gather_block_tables(other, batch.num_reqs_padded)  # not the launch's object
    assert bt.calls["gather_block_tables"] == 1
    want = expected(mrv2, batch)["tables"]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the fallback wrote into the gathered tables: the next launch zeroes them first
    step.seen.clear()
    bt.input_block_tables[0][-1, -1] = 12345
    mrv2.run_step(addr, mrv2.schedule(2))
    assert all(not t.any() for t in step.seen[0])
    # out= buffers of another owner are vLLM's business, also for the step's own batch
    mrv2.advance(batch)
    batch = mrv2.schedule(2)
    addr.prepare_pos_seq_lens(
        batch.idx_mapping, batch.query_start_loc, mrv2.num_computed_tokens, mrv2.positions, mrv2.seq_lens
    )
    mine = [torch.zeros_like(t) for t in bt.input_block_tables]
    calls = bt.calls["gather_block_tables"]
    got = addr.gather_block_tables(batch.idx_mapping, batch.num_reqs_padded, out=mine, out_ptrs=None)
    assert bt.calls["gather_block_tables"] == calls + 1 and got[0].data_ptr() == mine[0].data_ptr()
    # ... and the step's own gather is still served from the launch
    got = addr.gather_block_tables(batch.idx_mapping, batch.num_reqs_padded)
    assert bt.calls["gather_block_tables"] == calls + 1
    assert got[0].data_ptr() == bt.input_block_tables[0].data_ptr()


def test_a_second_call_in_a_step_runs_vllms_own():
    mrv2, addr, step = make((16,), seed=8)
    bt = mrv2.block_tables
    batch = mrv2.schedule(2)
    _tables, _slots = mrv2.run_step(addr, batch)
    calls = dict(bt.calls)
    addr.compute_slot_mappings(
        batch.idx_mapping, batch.query_start_loc, mrv2.positions[: batch.num_tokens], batch.num_tokens_padded
    )
    assert bt.calls["compute_slot_mappings"] == calls["compute_slot_mappings"] + 1
    assert step.launches == 1


def test_prepare_with_other_buffers_runs_vllms_own():
    mrv2, addr, step = make((16,), seed=9)
    batch = mrv2.schedule(2)
    pos, seq = torch.zeros_like(mrv2.positions), torch.zeros_like(mrv2.seq_lens)
    addr.prepare_pos_seq_lens(batch.idx_mapping, batch.query_start_loc, mrv2.num_computed_tokens, pos, seq)
    assert step.launches == 0
    assert torch.equal(seq, expected(mrv2, batch)["seq_lens"])


def test_the_rest_of_block_tables_is_the_wrapped_objects():
    mrv2, addr, step = make((16, 64), seed=10)
    bt = mrv2.block_tables
    assert addr.num_blocks is bt.num_blocks and addr.input_block_tables is bt.input_block_tables
    assert addr.append_block_ids.__self__ is bt and addr.block_sizes == [16, 64]
    assert addr.get_dummy_block_tables(3)[1].shape == (3, bt.input_block_tables[1].shape[1])
    assert addr.planner is step.planner and addr.step is step


def test_every_step_of_a_long_run_matches_with_random_configurations():
    rng = np.random.default_rng(11)
    for case in range(6):
        G = int(rng.integers(1, 4))
        sizes = [int(x) for x in rng.choice([1, 4, 13, 16, 64], G)]
        mrv2, addr, _step = make(sizes, seed=100 + case, M=int(rng.integers(1, 40)), T=int(rng.integers(8, 120)))
        for k in range(10):
            batch = mrv2.schedule(int(rng.choice([1, 6])))
            tables, slots = mrv2.run_step(addr, batch)
            check_step(mrv2, batch, tables, slots, f"case {case} step {k}")
            mrv2.advance(batch)
