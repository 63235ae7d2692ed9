"""Mrv2Addressing with its real planner and bound launch (no ``step=``), behind the fake CuPy,
the vLLM kernel emulated on the CPU (tests/support/vllm_emulator.py): MRV2's buffers are the
stand-in's torch CPU tensors seen as fake device arrays (the same memory), so every step's
buffers are compared with MRV2's own per-call functions as in tests/unit/test_vllm_mrv2.py. Here
the kernel's own zeroing of the gathered rows runs, so a gather of vLLM's in between (rows the
kernel does not know of) must be undone by the adapter. Skips without a C++ compiler."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvaddr.engines.vllm_mrv2 import Mrv2Addressing  # noqa: E402
from tests.support import vllm_emulator  # noqa: E402
from tests.support.mrv2_standin import Mrv2StandIn, check_step, standin_prepare_pos_seq_lens  # noqa: E402
from tests.support.vllm_fake_cupy import FakeArray, install  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


def dev(t) -> FakeArray:
    """A torch CPU tensor as a fake device array over the same memory."""
    return FakeArray(t.numpy())


def host(x):
    return torch.from_numpy(x.a)


class DeviceView:
    """The stand-in's BlockTables as the adapter sees a device one (fake CuPy arrays over its
    memory); its per-call methods are the stand-in's, on the same memory."""

    def __init__(self, bt):
        self.bt = bt
        self.block_sizes, self.max_num_reqs = bt.block_sizes, bt.max_num_reqs
        self.max_num_batched_tokens = bt.max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = bt.cp_size, bt.cp_rank, bt.cp_interleave
        self.block_tables = [types.SimpleNamespace(gpu=dev(t.gpu)) for t in bt.block_tables]
        self.num_blocks = types.SimpleNamespace(gpu=dev(bt.num_blocks.gpu))
        self.input_block_tables = [dev(t) for t in bt.input_block_tables]
        self.slot_mappings = dev(bt.slot_mappings)

    def gather_block_tables(self, idx_mapping, num_reqs_padded, **kw):
        return self.bt.gather_block_tables(host(idx_mapping), num_reqs_padded, **kw)


def _drive(addr, bufs, batch):
    i, q = dev(batch.idx_mapping), dev(batch.query_start_loc)  # one object per step, as MRV2's
    addr.prepare_pos_seq_lens(i, q, bufs.nct, bufs.pos, bufs.seq)
    tables = addr.gather_block_tables(i, batch.num_reqs_padded)
    slots = addr.compute_slot_mappings(i, q, bufs.pos[: batch.num_tokens], batch.num_tokens_padded)
    return tuple(host(t) for t in tables), host(slots)


def make(block_sizes, seed, dcp=False, **kw):
    mrv2 = Mrv2StandIn(
        max_num_reqs=20, max_num_batched_tokens=64, block_sizes=list(block_sizes), max_model_len=160,
        device="cpu", seed=seed, **kw,
    )  # fmt: skip
    bufs = types.SimpleNamespace(nct=dev(mrv2.num_computed_tokens), pos=dev(mrv2.positions), seq=dev(mrv2.seq_lens))
    addr = Mrv2Addressing(
        DeviceView(mrv2.block_tables),
        bufs.nct,
        bufs.pos,
        bufs.seq,
        sliding_window_reach=mrv2.block_tables.reach,
        prepare_pos_seq_lens=standin_prepare_pos_seq_lens,
        dcp_local_seq_lens=dev(mrv2.dcp_local_seq_lens) if dcp else None,
    )
    return mrv2, addr, bufs


@pytest.mark.parametrize("block_sizes", [(16,), (4, 16, 13)])
def test_the_real_launch_serves_mrv2s_calls(monkeypatch, block_sizes):
    fake = install(monkeypatch, on_launch=vllm_emulator.run)
    mrv2, addr, bufs = make(block_sizes, seed=len(block_sizes))
    for k in range(12):
        batch = mrv2.schedule(4)
        tables, slots = _drive(addr, bufs, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)
    assert len(fake.launches) == 12
    assert mrv2.block_tables.calls == {"gather_block_tables": 12, "compute_slot_mappings": 12}  # expected()'s
    addr.check()


def test_sliding_window(monkeypatch):
    install(monkeypatch, on_launch=vllm_emulator.run)
    mrv2, addr, bufs = make((16, 16), seed=7, sliding_window_reach=[0, 30])
    for k in range(10):
        batch = mrv2.schedule(4)
        tables, slots = _drive(addr, bufs, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)


def test_a_gather_of_vllms_in_between_is_undone_before_the_next_launch(monkeypatch):
    """vLLM's own gather (another batch: every live row, longest first) fills rows further than the
    kernel's record of them; the next launch must still leave no stale entry."""
    install(monkeypatch, on_launch=vllm_emulator.run)
    mrv2, addr, bufs = make((4, 16), seed=9)
    bt = mrv2.block_tables
    for k in range(10):
        batch = mrv2.schedule(3)
        tables, slots = _drive(addr, bufs, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        mrv2.advance(batch)
        live = np.array(sorted(mrv2.computed, key=lambda r: -mrv2.blocks[0, r]), dtype=np.int32)
        other = dev(torch.from_numpy(live))
        addr.gather_block_tables(other, len(live))  # not the step's: vLLM's gather, into the same tables
        assert bt.calls["gather_block_tables"] == 2 * k + 2


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_local_lengths_into_mrv2s_buffer(monkeypatch, rank):
    """cp_size 2 read from the tables: slots of this rank's tokens only, and the local lengths
    written into MRV2's ``dcp_local_seq_lens`` by the same launch."""
    install(monkeypatch, on_launch=vllm_emulator.run)
    mrv2, addr, bufs = make((16, 4), seed=20 + rank, dcp=True, cp_size=2, cp_rank=rank)
    for k in range(10):
        batch = mrv2.schedule(5)
        tables, slots = _drive(addr, bufs, batch)
        check_step(mrv2, batch, tables, slots, f"step {k}")
        s = mrv2.seq_lens.long()
        want = (s // 2) + torch.clamp(s % 2 - rank, 0, 1)  # interleave 1: every other token is this rank's
        assert torch.equal(mrv2.dcp_local_seq_lens.long(), want), f"step {k}"
        assert mrv2.dcp_local_seq_lens.data_ptr() == addr.outputs.dcp_local_seq_lens.a.ctypes.data
        mrv2.advance(batch)
