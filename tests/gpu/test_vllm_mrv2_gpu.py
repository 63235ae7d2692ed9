"""Mrv2Addressing on the GPU, driven as vLLM Model Runner V2 drives its block tables.

The MRV2 stand-in (tests/support/mrv2_standin.py) keeps MRV2's buffers as torch CUDA tensors
(positions, seq_lens, slot mappings, input_block_tables, the request state with staged block
writes) and makes MRV2's three calls, in its order, over many steps: requests arrive, grow,
finish and give their rows to new ones; batches are permuted subsets with dummy rows (-1);
1-3 KV-cache groups, a sliding-window group, more than 1024 requests. After every step every
buffer is compared with the three-launch re-implementation (``VllmThreeLaunch``) run on the
same inputs, and the slices the calls return with MRV2's own per-call functions. A "model
part" captured once in a CUDA graph reads the buffers (copies, a KV write through the slot
mappings and a read through the gathered tables) and is replayed after every step: its results
must be those of the same ops run eagerly on the three-launch outputs. Skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import assert_same, planner_kwargs, to_numpy

pytestmark = requires_gpu


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _setup(torch, block_sizes, *, M, T, max_model_len, seed, reach=None, debug=False, **kw):
    from kvaddr.engines.vllm_mrv2 import Mrv2Addressing
    from tests.support.mrv2_standin import Mrv2StandIn, standin_prepare_pos_seq_lens

    mrv2 = Mrv2StandIn(
        max_num_reqs=M, max_num_batched_tokens=T, block_sizes=list(block_sizes), max_model_len=max_model_len,
        device="cuda", seed=seed, sliding_window_reach=reach, max_block_id=4096,
    )  # fmt: skip
    addr = Mrv2Addressing(
        mrv2.block_tables,
        mrv2.num_computed_tokens,
        mrv2.positions,
        mrv2.seq_lens,
        sliding_window_reach=reach,
        prepare_pos_seq_lens=standin_prepare_pos_seq_lens,
        debug=debug,
        **kw,
    )
    return mrv2, addr


def _three_launch(torch, mrv2, batch, three):
    bt = mrv2.block_tables
    out = three.compute(
        batch.idx_mapping,
        batch.query_start_loc,
        mrv2.num_computed_tokens,
        [t.gpu for t in bt.block_tables],
        bt.num_blocks.gpu,
        num_reqs_padded=batch.num_reqs_padded,
        stream=torch.cuda.current_stream(),
    )
    return {
        k: (tuple(to_numpy(t) for t in v) if isinstance(v, tuple) else to_numpy(v)) for k, v in out.as_dict().items()
    }


def _buffers(mrv2, addr) -> dict:
    bt = mrv2.block_tables
    return dict(
        positions=mrv2.positions[: mrv2.T],
        seq_lens=mrv2.seq_lens,
        slot_mappings=bt.slot_mappings,
        input_block_tables=tuple(bt.input_block_tables),
        dcp_local_seq_lens=addr.outputs.dcp_local_seq_lens,
    )


class ModelPart:
    """What a captured forward reads of the step: every buffer copied out, a KV write of each
    token's position through its slot (counted per slot, so duplicate slots are deterministic)
    and a read of each batch row's pages through the gathered tables."""

    def __init__(self, torch, mrv2, max_block_id):
        bt = mrv2.block_tables
        self.torch, self.sizes = torch, bt.block_sizes
        self.caches = [torch.zeros(max_block_id * B + 1, dtype=torch.int64, device="cuda") for B in bt.block_sizes]
        self.out = {
            "pos": torch.zeros(mrv2.T, dtype=torch.int64, device="cuda"),
            "seq": torch.zeros_like(mrv2.seq_lens),
        }
        self.slots = torch.zeros_like(bt.slot_mappings)
        self.tables = [torch.zeros_like(t) for t in bt.input_block_tables]
        self.reads = [torch.zeros(t.shape, dtype=torch.int64, device="cuda") for t in bt.input_block_tables]

    def __call__(self, positions, seq_lens, slot_mappings, tables):
        torch = self.torch
        self.out["pos"].copy_(positions)
        self.out["seq"].copy_(seq_lens)
        self.slots.copy_(slot_mappings)
        T = slot_mappings.shape[1]
        for g, (cache, B) in enumerate(zip(self.caches, self.sizes)):
            s = slot_mappings[g]
            trash = cache.shape[0] - 1
            cache.index_add_(0, torch.where(s >= 0, s, trash), positions[:T] + 1)
            self.tables[g].copy_(tables[g])
            self.reads[g].copy_(cache[tables[g].long() * B])


def _eager_replica(torch, part, want):
    """The model part's ops on the three-launch outputs (a CPU copy of its caches advanced)."""
    for g, (cache, B) in enumerate(zip(part.replica, part.sizes)):
        s = want["slot_mappings"][g]
        trash = cache.shape[0] - 1
        np.add.at(cache, np.where(s >= 0, s, trash), want["positions"] + 1)
        part.want_reads[g] = cache[want["input_block_tables"][g].astype(np.int64) * B]


@pytest.mark.parametrize(
    "block_sizes, max_query, debug",
    [((16,), 1, False), ((16,), 24, True), ((16, 64), 7, False), ((1, 16, 64), 5, True)],
)
def test_mrv2_steps_equal_the_three_launches_and_a_captured_model_part_reads_them(torch, block_sizes, max_query, debug):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch
    from tests.support.mrv2_standin import check_step

    mrv2, addr = _setup(
        torch, block_sizes, M=96, T=1024, max_model_len=1500, seed=len(block_sizes) + max_query, debug=debug
    )
    three = VllmThreeLaunch(**planner_kwargs(mrv2.config()))
    bt = mrv2.block_tables
    part = ModelPart(torch, mrv2, 4096)
    part.replica = [np.zeros(c.shape[0], np.int64) for c in part.caches]
    part.want_reads = [None] * len(block_sizes)
    graph = None
    for k in range(30):
        batch = mrv2.schedule(max_query, dummies=3)
        tables, slots = mrv2.run_step(addr, batch)  # MRV2's three calls: one launch
        want = _three_launch(torch, mrv2, batch, three)
        torch.cuda.synchronize()
        assert_same(_buffers(mrv2, addr), want, f"step {k}")
        check_step(mrv2, batch, tables, slots, f"step {k}")
        args = (mrv2.positions[: mrv2.T], mrv2.seq_lens, bt.slot_mappings, bt.input_block_tables)
        if graph is None:  # capture once (after a warm-up run on a side stream), replay every step
            s = torch.cuda.Stream()
            saved = [c.clone() for c in part.caches]  # before s waits: s's warm-up run writes the caches
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                part(*args)
            torch.cuda.current_stream().wait_stream(s)
            for c, v in zip(part.caches, saved):
                c.copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                part(*args)
        graph.replay()
        torch.cuda.synchronize()
        _eager_replica(torch, part, want)
        label = f"replay after step {k}"
        np.testing.assert_array_equal(to_numpy(part.out["pos"][: mrv2.T]), want["positions"], err_msg=label)
        np.testing.assert_array_equal(to_numpy(part.out["seq"]), want["seq_lens"], err_msg=label)
        np.testing.assert_array_equal(to_numpy(part.slots), want["slot_mappings"], err_msg=label)
        for g in range(len(block_sizes)):
            np.testing.assert_array_equal(to_numpy(part.tables[g]), want["input_block_tables"][g], err_msg=label)
            np.testing.assert_array_equal(to_numpy(part.caches[g]), part.replica[g], err_msg=label)
            np.testing.assert_array_equal(to_numpy(part.reads[g]), part.want_reads[g], err_msg=label)
        mrv2.advance(batch)
    addr.check()
    assert bt.calls == {"gather_block_tables": 30, "compute_slot_mappings": 30}  # check_step's own, no others


def test_more_than_1024_requests_a_sliding_window_and_int64_idx_mapping(torch):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch
    from tests.support.mrv2_standin import check_step

    mrv2, addr = _setup(torch, (16, 32), M=1500, T=4096, max_model_len=600, seed=3, reach=[0, 100], debug=True)
    mrv2.idx_mapping_buf = mrv2.idx_mapping_buf.to(torch.int64)
    three = VllmThreeLaunch(**planner_kwargs(mrv2.config()))
    for k in range(8):
        batch = mrv2.schedule(2, dummies=5)
        tables, slots = mrv2.run_step(addr, batch)
        want = _three_launch(torch, mrv2, batch, three)
        torch.cuda.synchronize()
        assert_same(_buffers(mrv2, addr), want, f"step {k}")
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)


def test_flashinfer_metadata_from_the_same_launch(torch):
    N = 8192
    mrv2, addr = _setup(
        torch, (16, 64), M=128, T=1024, max_model_len=1024, seed=5, attention="flashinfer", kv_indices_capacity=N
    )
    bt = mrv2.block_tables
    cfg = mrv2.config()
    for k in range(12):
        batch = mrv2.schedule(6)
        mrv2.run_step(addr, batch)
        torch.cuda.synchronize()
        ref = vllm_step_reference(
            cfg,
            to_numpy(batch.idx_mapping),
            to_numpy(batch.query_start_loc),
            to_numpy(mrv2.num_computed_tokens),
            [to_numpy(t.gpu) for t in bt.block_tables],
            to_numpy(bt.num_blocks.gpu),
            attention="flashinfer",
            kv_indices_capacity=N,
        )
        got, want = addr.attention_outputs, ref.outputs.attention
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            np.testing.assert_array_equal(
                to_numpy(getattr(got, name)), getattr(want, name), err_msg=f"step {k}: {name}"
            )
        mrv2.advance(batch)
    addr.check()


def test_switched_off_and_on_again(torch):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    mrv2, addr = _setup(torch, (16, 64), M=64, T=512, max_model_len=512, seed=8)
    three = VllmThreeLaunch(**planner_kwargs(mrv2.config()))
    for k in range(9):
        addr.enabled = k % 3 != 1  # every third step runs vLLM's own calls
        batch = mrv2.schedule(4)
        mrv2.run_step(addr, batch)
        if addr.enabled:
            want = _three_launch(torch, mrv2, batch, three)
            torch.cuda.synchronize()
            assert_same(_buffers(mrv2, addr), want, f"step {k}")
        mrv2.advance(batch)
