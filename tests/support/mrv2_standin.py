"""A stand-in for vLLM Model Runner V2 (MRV2) around :class:`~kvaddr.engines.vllm_mrv2.Mrv2Addressing`.

* :class:`StandInBlockTables`: the attributes and methods of MRV2's ``BlockTables`` that the
  adapter and MRV2 use (per-group block tables with staged writes, ``num_blocks`` with a host
  copy, ``input_block_tables``, ``slot_mappings``, ``gather_block_tables``,
  ``compute_slot_mappings``, the dummy getters), its per-call methods written here in torch from
  the contract (docs/vllm.md), independently of kvaddr's reference;
* :func:`standin_prepare_pos_seq_lens`: MRV2's free function of that name, in torch;
* :class:`Mrv2StandIn`: MRV2's persistent buffers and a scheduler: requests arrive, grow block
  by block, finish, and their rows are reused; each step's batch is a permuted subset of the
  live rows with dummy rows (-1), written into slices of persistent ``idx_mapping`` /
  ``query_start_loc`` buffers; :meth:`Mrv2StandIn.run_step` makes MRV2's three calls, in its order;
* :func:`expected` / :func:`check_step`: MRV2's own three calls on separate buffers, and every
  buffer of a step served by the adapter compared with them;
* :class:`ReferenceStep`: the NumPy reference standing in for the bound kernel launch (the CPU
  tests), writing MRV2's buffers as the launch does.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import torch

from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_reference import vllm_step_reference


class _Staged:
    """One group's block table: the device tensor and the writes staged on the host."""

    def __init__(self, rows: int, width: int, device):
        self.gpu = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.writes: list = []

    def stage_write(self, row: int, start: int, ids) -> None:
        self.writes.append((row, start, list(ids)))

    def apply_write(self) -> None:
        for row, start, ids in self.writes:
            if ids:
                self.gpu[row, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int32, device=self.gpu.device)
        self.writes.clear()


class StandInBlockTables:
    """MRV2's ``BlockTables``: request state by row, and its per-call gather and slot mapping."""

    def __init__(
        self, block_sizes, max_num_reqs, max_num_batched_tokens, widths, device, sliding_window_reach=None,
        cp_size=1, cp_rank=0, cp_interleave=1,
    ):  # fmt: skip
        self.block_sizes = list(block_sizes)
        self.max_num_reqs, self.max_num_batched_tokens = max_num_reqs, max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        self.num_kv_cache_groups = G = len(block_sizes)
        self.reach = list(sliding_window_reach or [0] * G)
        self.device = device
        self.block_tables = [_Staged(max_num_reqs, w, device) for w in widths]
        self.num_blocks = types.SimpleNamespace(
            np=np.zeros((G, max_num_reqs), np.int32),
            gpu=torch.zeros((G, max_num_reqs), dtype=torch.int32, device=device),
        )
        self.input_block_tables = [torch.zeros_like(b.gpu) for b in self.block_tables]
        self.slot_mappings = torch.zeros((G, max_num_batched_tokens), dtype=torch.int64, device=device)
        self.calls = {"gather_block_tables": 0, "compute_slot_mappings": 0}

    def append_block_ids(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        for g in range(self.num_kv_cache_groups):
            start = 0 if overwrite else int(self.num_blocks.np[g, req_index])
            self.block_tables[g].stage_write(req_index, start, new_block_ids[g])
            self.num_blocks.np[g, req_index] = start + len(new_block_ids[g])

    def apply_staged_writes(self) -> None:
        for t in self.block_tables:
            t.apply_write()
        self.num_blocks.gpu.copy_(torch.from_numpy(self.num_blocks.np))

    def gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None):
        self.calls["gather_block_tables"] += 1
        out = self.input_block_tables if out is None else out
        n = idx_mapping.shape[0]
        r = idx_mapping.long()
        real = r >= 0
        rr = torch.where(real, r, 0)
        for g, (src, dst) in enumerate(zip(self.block_tables, out)):
            W = src.gpu.shape[1]
            cols = torch.arange(W, device=src.gpu.device)[None, :]
            keep = real[:, None] & (cols < self.num_blocks.gpu[g].long()[rr][:, None])
            if self.reach[g] > 0 and num_computed_tokens is not None:
                first = torch.clamp(num_computed_tokens.long()[rr] - self.reach[g], min=0) // self.block_sizes[g]
                keep &= cols >= first[:, None]
            dst[:n] = torch.where(keep, src.gpu[rr], 0)
            dst[n:num_reqs_padded] = 0
        return tuple(t[:num_reqs_padded] for t in out)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        self.calls["compute_slot_mappings"] += 1
        out = self.slot_mappings if out is None else out
        n, num_tokens = idx_mapping.shape[0], positions.shape[0]
        qsl = query_start_loc[: n + 1].long()
        t = torch.arange(num_tokens, device=positions.device)
        b = torch.searchsorted(qsl[1:], t, right=True).clamp(max=max(n - 1, 0))
        r = idx_mapping.long()[b] if n else torch.zeros_like(t)
        real = r >= 0
        rr = torch.where(real, r, 0)
        pos = positions.long()
        cp, c, il = self.cp_size, self.cp_rank, self.cp_interleave
        for g, src in enumerate(self.block_tables):
            B = self.block_sizes[g]
            if cp > 1:
                vo = pos % (B * cp)
                blk, local = pos // (B * cp), (vo // il) % cp == c
                off = (vo // (il * cp)) * il + vo % il
            else:
                blk, off, local = pos // B, pos % B, torch.ones_like(real)
            slot = src.gpu[rr, blk.clamp(max=src.gpu.shape[1] - 1)].long() * B + off
            out[g, :num_tokens] = torch.where(real & local, slot, -1)
            out[g, num_tokens:] = -1
        return out[:, :num_tokens_padded]

    def get_dummy_block_tables(self, num_reqs: int):
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    def get_dummy_slot_mappings(self, num_tokens: int):
        self.slot_mappings.fill_(-1)
        return self.slot_mappings[:, :num_tokens]


def standin_prepare_pos_seq_lens(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens) -> None:
    """MRV2's ``prepare_pos_seq_lens``: ``pos[:num_tokens]`` and every ``seq_lens`` entry."""
    n = idx_mapping.shape[0]
    qsl = query_start_loc[: n + 1].long()
    num_tokens = int(qsl[-1]) if n else 0
    r = idx_mapping.long()
    real = r >= 0
    nct = torch.where(real, num_computed_tokens.long()[torch.where(real, r, 0)], 0)
    t = torch.arange(num_tokens, device=pos.device)
    b = torch.searchsorted(qsl[1:], t, right=True).clamp(max=max(n - 1, 0))
    if num_tokens:
        pos[:num_tokens] = torch.where(real[b], nct[b] + t - qsl[b], 0)
    seq_lens.zero_()
    seq_lens[:n] = torch.where(real, nct + qsl[1:] - qsl[:-1], 0).to(seq_lens.dtype)


@dataclass
class Batch:
    idx_mapping: torch.Tensor  # a slice [:num_reqs] of the persistent buffer
    query_start_loc: torch.Tensor  # a slice [:num_reqs + 1] of the persistent buffer
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int
    num_tokens_padded: int
    rows: np.ndarray  # host copy of idx_mapping
    query_lens: np.ndarray


class Mrv2StandIn:
    """MRV2's persistent buffers, request state and scheduler (see the module's docstring)."""

    def __init__(
        self, *, max_num_reqs, max_num_batched_tokens, block_sizes, max_model_len, device, seed,
        sliding_window_reach=None, idx_dtype=torch.int32, max_block_id=1 << 20, cp_size=1, cp_rank=0,
    ):  # fmt: skip
        M, T = max_num_reqs, max_num_batched_tokens
        self.M, self.T, self.max_model_len = M, T, max_model_len
        widths = [-(-max_model_len // B) for B in block_sizes]
        self.block_tables = StandInBlockTables(
            block_sizes, M, T, widths, device, sliding_window_reach, cp_size=cp_size, cp_rank=cp_rank
        )
        self.dcp_local_seq_lens = torch.zeros(M, dtype=torch.int32, device=device)
        self.num_computed_tokens = torch.zeros(M, dtype=torch.int32, device=device)
        self.positions = torch.zeros(T + 16, dtype=torch.int64, device=device)  # longer than T, as MRV2's may be
        self.seq_lens = torch.zeros(M, dtype=torch.int32, device=device)
        self.idx_mapping_buf = torch.zeros(M, dtype=idx_dtype, device=device)
        self.query_start_loc_buf = torch.zeros(M + 1, dtype=torch.int32, device=device)
        self.rng = np.random.default_rng(seed)
        self.max_block_id = max_block_id
        self.computed: dict = {}  # live row -> tokens in its KV cache (host mirror)
        self.blocks = np.zeros((len(block_sizes), M), np.int64)  # host mirror of num_blocks

    def _new_ids(self, k: int) -> list:
        return [int(x) for x in self.rng.integers(1, self.max_block_id, k)]

    def schedule(self, max_query: int, dummies: int = 2) -> Batch:
        """Finish some requests, add new ones on free rows, allocate blocks, pick the batch."""
        rng, M, T, bt = self.rng, self.M, self.T, self.block_tables
        for r in list(self.computed):
            if rng.random() < 0.15 or self.computed[r] >= self.max_model_len - 1:
                del self.computed[r]
        free = [r for r in range(M) if r not in self.computed]
        for r in rng.permutation(free)[: int(rng.integers(0, len(free) + 1))]:
            self.computed[int(r)] = int(rng.integers(0, self.max_model_len // 2))
            self.blocks[:, r] = 0
        live = rng.permutation(sorted(self.computed))
        live = live[: int(rng.integers(0, len(live) + 1))]
        n_dummy = min(int(rng.integers(0, dummies + 1)), M - len(live))
        rows = np.concatenate([live, np.full(n_dummy, -1)]).astype(np.int64)
        rng.shuffle(rows)
        q = np.ones(len(rows), np.int64)
        if max_query > 1:
            q = rng.integers(1, max_query + 1, len(rows))
        for b, r in enumerate(rows):
            if r >= 0:
                q[b] = min(q[b], self.max_model_len - self.computed[r])
        while q.sum() > T:
            q[int(np.argmax(q))] -= 1
        # blocks for every token of the step (new rows: overwrite from 0)
        for b, r in enumerate(rows):
            if r < 0:
                continue
            need = [-(-(self.computed[r] + int(q[b])) // B) for B in bt.block_sizes]
            have = self.blocks[:, r]
            overwrite = bool(have.sum() == 0)
            start = np.zeros_like(have) if overwrite else have
            new = tuple(self._new_ids(max(int(k - s), 0)) for k, s in zip(need, start))
            bt.append_block_ids(int(r), new, overwrite=overwrite)
            self.blocks[:, r] = np.maximum(need, start)
        bt.apply_staged_writes()
        self.num_computed_tokens.copy_(torch.from_numpy(self._nct_host()))
        n = len(rows)
        qsl = np.zeros(M + 1, np.int64)
        np.cumsum(q, out=qsl[1 : n + 1])
        num_tokens = int(qsl[n])
        qsl[n + 1 :] = num_tokens
        self.idx_mapping_buf[:n] = torch.from_numpy(rows).to(self.idx_mapping_buf.dtype)
        self.query_start_loc_buf.copy_(torch.from_numpy(qsl.astype(np.int32)))
        return Batch(
            idx_mapping=self.idx_mapping_buf[:n],
            query_start_loc=self.query_start_loc_buf[: n + 1],
            num_reqs=n,
            num_tokens=num_tokens,
            num_reqs_padded=min(M, n + int(rng.integers(0, 4))),
            num_tokens_padded=min(T, num_tokens + int(rng.integers(0, 8))),
            rows=rows,
            query_lens=q,
        )

    def _nct_host(self) -> np.ndarray:
        out = np.zeros(self.M, np.int32)
        for r, c in self.computed.items():
            out[r] = c
        return out

    def advance(self, batch: Batch) -> None:
        """After the forward: every real request's tokens are in its KV cache."""
        for r, k in zip(batch.rows, batch.query_lens):
            if r >= 0:
                self.computed[int(r)] += int(k)

    def run_step(self, addressing, batch: Batch) -> tuple:
        """MRV2's three calls, in its order, with its arguments: ``(block tables, slot mappings)``."""
        addressing.prepare_pos_seq_lens(
            batch.idx_mapping, batch.query_start_loc, self.num_computed_tokens, self.positions, self.seq_lens
        )
        tables = addressing.gather_block_tables(batch.idx_mapping, num_reqs_padded=batch.num_reqs_padded)
        slots = addressing.compute_slot_mappings(
            batch.idx_mapping,
            batch.query_start_loc,
            self.positions[: batch.num_tokens],
            num_tokens_padded=batch.num_tokens_padded,
        )
        return tables, slots

    def config(self, **over) -> VllmStepConfig:
        bt = self.block_tables
        kw = dict(sliding_window_reach=bt.reach, cp_size=bt.cp_size, cp_rank=bt.cp_rank)
        kw.update(over)
        return VllmStepConfig(self.M, self.T, bt.block_sizes, [t.gpu.shape[1] for t in bt.block_tables], **kw)


class ReferenceStep:
    """The NumPy reference standing in for ``BoundVllmStep`` (CPU torch tensors): each launch
    computes the step with :func:`~kvaddr.engines.vllm_reference.vllm_step_reference` over the
    request state of ``tables`` (MRV2's ``BlockTables`` or the stand-in's) and writes MRV2's
    buffers in place, as the launch does. ``seen`` records, per launch, the gathered tables as
    they were before it wrote them."""

    def __init__(
        self, tables, num_computed_tokens, positions, seq_lens, *, sliding_window_reach=None, attention=None,
        kv_indices_capacity=None,
    ):  # fmt: skip
        self.tables, self.nct, self.positions, self.seq_lens = tables, num_computed_tokens, positions, seq_lens
        self.M, self.T = tables.max_num_reqs, tables.max_num_batched_tokens
        widths = [t.gpu.shape[1] for t in tables.block_tables]
        kw = {} if sliding_window_reach is None else dict(sliding_window_reach=sliding_window_reach)
        self.cfg = VllmStepConfig(self.M, self.T, list(tables.block_sizes), widths, **kw)
        self.attention, self.capacity = attention, kv_indices_capacity
        self.launches = 0
        self.seen: list = []
        self.last = None
        self.planner = types.SimpleNamespace(attention_outputs=None, check=self._check)

    @classmethod
    def of(cls, mrv2: Mrv2StandIn, **kw) -> ReferenceStep:
        """The reference step over a :class:`Mrv2StandIn`'s buffers."""
        kw.setdefault("sliding_window_reach", mrv2.block_tables.reach)
        return cls(mrv2.block_tables, mrv2.num_computed_tokens, mrv2.positions, mrv2.seq_lens, **kw)

    def _check(self, stream=None) -> None:
        if self.last is not None and self.last.error_mask:
            raise AssertionError(f"reference step error mask {self.last.error_mask}")

    def launch(self, idx_mapping, query_start_loc, num_reqs_padded=None, *, stream=None):
        bt = self.tables
        self.launches += 1
        self.seen.append([t.clone() for t in bt.input_block_tables])
        res = vllm_step_reference(
            self.cfg,
            idx_mapping.numpy(),
            query_start_loc.numpy(),
            self.nct.numpy(),
            [t.gpu.numpy() for t in bt.block_tables],
            bt.num_blocks.gpu.numpy(),
            num_reqs_padded=num_reqs_padded,
            attention=self.attention,
            kv_indices_capacity=self.capacity,
        )
        o = res.outputs
        self.positions[: self.T].copy_(torch.from_numpy(o.positions))
        self.seq_lens[: self.M].copy_(torch.from_numpy(o.seq_lens))
        bt.slot_mappings.copy_(torch.from_numpy(o.slot_mappings))
        for dst, src in zip(bt.input_block_tables, o.input_block_tables):
            dst.copy_(torch.from_numpy(src))
        self.planner.attention_outputs = o.attention
        self.last = res


def expected(mrv2: Mrv2StandIn, batch) -> dict:
    """MRV2's own three calls on separate buffers (the stand-in's per-call functions)."""
    bt = mrv2.block_tables
    pos = torch.full_like(mrv2.positions, 7)
    seq = torch.full_like(mrv2.seq_lens, 7)
    standin_prepare_pos_seq_lens(batch.idx_mapping, batch.query_start_loc, mrv2.num_computed_tokens, pos, seq)
    tables = bt.gather_block_tables(
        batch.idx_mapping,
        batch.num_reqs_padded,
        out=[torch.full_like(t, 7) for t in bt.input_block_tables],
        out_ptrs=None,
        num_computed_tokens=mrv2.num_computed_tokens,
    )
    slots = bt.compute_slot_mappings(
        batch.idx_mapping,
        batch.query_start_loc,
        pos[: batch.num_tokens],
        batch.num_tokens_padded,
        out=torch.full_like(bt.slot_mappings, 7),
    )
    return dict(positions=pos[: batch.num_tokens], seq_lens=seq, tables=tables, slots=slots)


def same_buffer(view, buf) -> bool:
    """A slice starting at ``buf``'s first element (an empty one has no address)."""
    return view.numel() == 0 or view.data_ptr() == buf.data_ptr()


def check_step(mrv2, batch, tables, slots, label, launched=True):
    want = expected(mrv2, batch)
    bt = mrv2.block_tables
    n, nt = batch.num_reqs, batch.num_tokens
    assert torch.equal(mrv2.positions[:nt], want["positions"]), label
    if launched:  # kvaddr writes every position (vLLM leaves those past the step's tokens)
        assert not mrv2.positions[nt : mrv2.T].any(), label
    assert torch.equal(mrv2.seq_lens, want["seq_lens"]), label
    assert len(tables) == len(want["tables"])
    for g, (got, w) in enumerate(zip(tables, want["tables"])):
        assert got.shape == w.shape and same_buffer(got, bt.input_block_tables[g]), label
        assert torch.equal(got, w), f"{label}: group {g}"
        if launched:  # kvaddr zeroes every row past num_reqs (vLLM those up to num_reqs_padded)
            assert not bt.input_block_tables[g][n:].any(), f"{label}: group {g} rows past num_reqs"
    assert slots.shape == want["slots"].shape and same_buffer(slots, bt.slot_mappings), label
    assert torch.equal(slots, want["slots"]), label
    assert (bt.slot_mappings[:, nt:] == -1).all(), label  # (vLLM pads them too)
