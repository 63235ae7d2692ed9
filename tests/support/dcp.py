"""Decode context parallelism (DCP) in isolation: kvaddr's vLLM step on every rank, the
ranks' partial attentions merged by log-sum-exp, against attention over the whole context.

Shared by the CPU test (``tests/unit/test_dcp.py``: the NumPy reference stands in for the
kernel, a loop over ranks for the collective), the GPU test (``tests/gpu/test_dcp_gpu.py``)
and the GPU script (``scripts/gpu/dcp_check.py``: one process per GPU under ``torchrun``,
NCCL all-gathers). Everything framework-specific sits behind three small objects:

* a *backend* holds the paged caches and does the arithmetic: :class:`NumpyBackend`
  (float64 NumPy) or :class:`TorchBackend` (PyTorch on ``cuda`` or ``cpu``);
* an *addresser* computes a rank's vLLM step: :class:`ReferenceAddresser` (the NumPy
  reference, ``kvaddr.engines.vllm_reference``) or :class:`PlannerAddresser` (the kernel,
  ``VllmStepPlanner``, on torch tensors, each output also compared with the reference);
* a *ranks* object says which DCP ranks this process plays and gathers their arrays:
  :class:`LoopRanks` (all of them, in one process; the gather is a stack) or, in the GPU
  script, one rank per process with ``torch.distributed.all_gather``.

The simulation (:class:`DcpSimulation`) is NumPy on the host and deterministic from the
case's seed, so every process of a distributed run builds the same steps. Each step (a
mixed batch: fresh prefills, chunked-prefill continuations, decodes, speculative tokens
of which some are rejected and rewritten later, idle and finished requests whose blocks
are reused, a dummy padding request) every rank c:

1. builds kvaddr's vLLM step with ``cp_rank = c`` and writes the K/V of the tokens it owns
   into its own paged caches ``[num_blocks, B, heads, dim]`` (one per KV-cache group)
   through its ``slot_mappings`` (tokens of earlier steps were written by earlier steps);
2. reads its local KV back through its gathered block table and ``dcp_local_seq_lens``:
   local position j is slot ``row[j // B] * B + j % B``, and holds the global position
   ``p = (j // B) * B * cp + ((lo // I) * cp + c) * I + lo % I`` with ``lo = j % B``
   (the inverse of the contract's local offset rule, docs/vllm.md);
3. computes partial attention (causal by position) of the step's queries over that KV,
   with its log-sum-exp.

The partials are gathered and merged: ``lse = logsumexp_c(lse_c)``,
``out = sum_c exp(lse_c - lse) * out_c`` (a rank with no key: ``lse_c = -inf``, weight 0).
Checks: the merged output equals attention computed on one rank over the contiguous K/V
the simulation kept; for every real token and sharded group exactly one rank has a slot
(the owner ``(vo // I) % cp``), for an unsharded group every rank has the same slot, for
padding none; no two tokens of a step share a slot on a rank; the ranks' local lengths
add up to ``seq_lens``; ``positions`` and ``seq_lens`` are as the simulation expects. An
unsharded group is read whole on every rank (``seq_lens``, plain addressing) and its
attention compared on every rank.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_reference import vllm_step_reference

I32 = np.int32
I64 = np.int64
F64 = np.float64
FAULTS = ("slot", "partial", "length")
KINDS = ("prefill", "chunk", "decode", "spec", "idle", "finish", "reuse", "dummy")


# -- cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DcpCase:
    """One configuration: block sizes and DCP flags per KV-cache group, the interleave."""

    name: str
    block_sizes: tuple
    sharded: tuple
    interleave: int
    num_reqs: int = 16
    steps: int = 4
    heads: int = 2
    dim: int = 8
    seed: int = 0


def dcp_cases(
    block_sizes=(16, 64), *, num_reqs: int = 16, steps: int = 4, heads: int = 2, dim: int = 8, seed: int = 17
) -> list:
    """B in ``block_sizes`` x interleave 1 and B x groups: one sharded group (``g1``); a
    sharded group and an unsharded one of B / 2 (``g2u``); two sharded groups, B and 2B (``g2s``)."""
    out = []
    for B in block_sizes:
        for interleave in (1, B):
            for tag, bs, sh in (
                ("g1", (B,), (True,)),
                ("g2u", (B, max(B // 2, 1)), (True, False)),
                ("g2s", (B, 2 * B), (True, True)),
            ):
                name = f"B{B}-I{interleave}-{tag}"
                out.append(DcpCase(name, bs, sh, interleave, num_reqs, steps, heads, dim, seed + len(out)))
    return out


def global_positions(local_len: int, block_size: int, cp_size: int, cp_rank: int, interleave: int) -> np.ndarray:
    """The global position of each local position ``j < local_len`` of rank ``cp_rank`` (int64)."""
    j = np.arange(local_len, dtype=I64)
    vb, lo = j // block_size, j % block_size
    return vb * block_size * cp_size + ((lo // interleave) * cp_size + cp_rank) * interleave + lo % interleave


def owner_rank(pos: np.ndarray, block_size: int, cp_size: int, interleave: int) -> np.ndarray:
    """The rank holding each position of a sharded group: ``(vo // I) % cp``."""
    return ((pos % (block_size * cp_size)) // interleave) % cp_size


# -- the simulation -------------------------------------------------------------------


@dataclass
class DcpStep:
    """One step: the planner's inputs (host NumPy), what each token is, and its data."""

    index: int
    inputs: dict  # idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks
    rows: np.ndarray  # int64 [num_reqs]: -1 for the dummy
    kinds: list  # per batch index
    num_tokens: int
    token_row: np.ndarray  # int64 [num_tokens], -1 for the dummy's tokens
    token_pos: np.ndarray  # int64 [num_tokens], 0 for the dummy's tokens
    seq_lens: np.ndarray  # int64 [num_reqs]: expected
    k: np.ndarray  # float32 [num_tokens, H, D]
    v: np.ndarray
    q: np.ndarray
    queries: list  # per batch index: int64 token indices whose queries are checked
    accepted: dict  # row -> its length after the step
    others: list  # kinds of the running requests not in the batch: "idle", "finish"


class DcpSimulation:
    """Requests in ``num_reqs + 4`` rows driven through the case's steps.

    Step 0: most requests start with a fresh prefill; later steps mix decode, speculative
    (1 + k tokens, 1 + randint(0, k) accepted), chunked-prefill continuations, idle,
    finishing requests (blocks returned to the front of the pool, so a new request reuses
    them: stale K/V in them) and new requests; a dummy request ends every batch. Block
    ids come from a shuffled pool per group; tables hold -1 past ``num_blocks``.
    """

    def __init__(self, case: DcpCase, cp_size: int, max_queries: int | None = None):
        self.case, self.cp = case, cp_size
        self.max_queries = max_queries
        self.rng = rng = np.random.default_rng(case.seed * 1000 + cp_size)
        G = len(case.block_sizes)
        self.M = M = case.num_reqs + 4
        span0 = case.block_sizes[0] * cp_size
        self.prefill_max = 2 * span0 + 5
        self.chunk_max = span0 // 2 + 3
        self.max_ctx = self.prefill_max + case.steps * max(self.chunk_max, 4) + 1
        self.spans = [B * cp_size if (sh and cp_size > 1) else B for B, sh in zip(case.block_sizes, case.sharded)]
        self.widths = [-(-self.max_ctx // s) + 1 for s in self.spans]
        self.num_blocks_total = [M * w + 3 for w in self.widths]
        self.pools = [list(rng.permutation(n)) for n in self.num_blocks_total]
        self.tables = [np.full((M, w), -1, I32) for w in self.widths]
        self.nb = np.zeros((G, M), I32)
        self.length = np.zeros(M, I64)
        self.live = np.zeros(M, bool)
        self.reused = np.zeros(M, bool)
        self.truth_k = np.zeros((M, self.max_ctx, case.heads, case.dim), np.float32)
        self.truth_v = np.zeros_like(self.truth_k)
        self.max_tokens = case.num_reqs * self.prefill_max + 8
        self.step_index = 0
        start = rng.permutation(M)[: case.num_reqs - 2]
        self.pending = list(rng.permutation(np.setdiff1d(np.arange(M), start)))  # rows for later arrivals
        self.starting = {int(r) for r in start}

    def config(self, cp_rank: int) -> VllmStepConfig:
        c = self.case
        return VllmStepConfig(
            self.M,
            self.max_tokens,
            list(c.block_sizes),
            self.widths,
            dcp_sharded=list(c.sharded),
            cp_size=self.cp,
            cp_rank=cp_rank,
            cp_interleave=c.interleave,
        )

    def _allocate(self, r: int, L: int) -> None:
        for g, span in enumerate(self.spans):
            need = -(-L // span)
            row = self.tables[g][r]
            for j in range(int(self.nb[g, r]), need):
                row[j] = self.pools[g].pop()
            self.nb[g, r] = max(int(self.nb[g, r]), need)

    def _free(self, r: int) -> None:
        for g in range(len(self.spans)):
            n = int(self.nb[g, r])
            self.pools[g].extend(int(x) for x in self.tables[g][r, :n])  # popped next: reused at once
            self.tables[g][r] = -1
            self.nb[g, r] = 0
        self.length[r] = 0
        self.live[r] = False

    def next_step(self) -> DcpStep:
        rng, case = self.rng, self.case
        s = self.step_index
        sched: list = []  # (row, kind, q, accepted length)
        running = [int(r) for r in np.flatnonzero(self.live)]
        cycle = ["decode", "spec", "chunk", "decode", "spec", "idle", "chunk", "finish"]
        kinds = [cycle[i % len(cycle)] for i in range(len(running))]
        rng.shuffle(kinds)
        others = []
        for r, kind in zip(running, kinds):
            L = int(self.length[r])
            room = self.max_ctx - L
            if kind == "finish":
                self._free(r)
                self.pending.insert(0, r)  # the next arrival takes this row (and, from the pool, its blocks)
                others.append(kind)
                continue
            if kind == "idle" or room < 4:
                others.append("idle")
                continue
            if kind == "decode":
                q, acc = 1, L + 1
            elif kind == "spec":
                k = int(rng.integers(1, 4))
                q = 1 + k
                acc = L + 1 + int(rng.integers(0, k + 1))
            else:
                q = int(rng.integers(2, min(self.chunk_max, room) + 1))
                acc = L + q
            sched.append((r, kind, q, acc))
        arrivals = sorted(self.starting) if s == 0 else []
        if s > 0:
            for _ in range(2):
                if self.pending and rng.random() < 0.7:
                    arrivals.append(int(self.pending.pop(0)))
        for r in arrivals:
            q = int(rng.integers(1, self.prefill_max + 1))
            self.live[r] = True
            sched.append((r, "reuse" if self.reused[r] else "prefill", q, q))
        for r, _, _, _ in sched:
            self.reused[r] = True
        order = rng.permutation(len(sched))
        sched = [sched[i] for i in order]
        dummy_q = int(rng.integers(1, 3))

        rows = np.array([x[0] for x in sched] + [-1], I64)
        q = np.array([x[2] for x in sched] + [dummy_q], I64)
        qsl = np.zeros(len(rows) + 1, I64)
        np.cumsum(q, out=qsl[1:])
        T = int(qsl[-1])
        for r, _, qq, _ in sched:
            self._allocate(r, int(self.length[r]) + qq)
        nct = self.length.astype(I32)
        H, D = case.heads, case.dim
        shape = (T, H, D)
        k = rng.standard_normal(shape, dtype=np.float32)
        v = rng.standard_normal(shape, dtype=np.float32)
        qv = rng.standard_normal(shape, dtype=np.float32)
        token_row = np.repeat(rows, q)
        token_pos = np.zeros(T, I64)
        queries, seq = [], np.zeros(len(rows), I64)
        for b, r in enumerate(rows):
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            if r < 0:
                queries.append(np.zeros(0, I64))
                continue
            L = int(self.length[r])
            token_pos[lo:hi] = L + np.arange(hi - lo)
            self.truth_k[r, L : L + hi - lo] = k[lo:hi]
            self.truth_v[r, L : L + hi - lo] = v[lo:hi]
            seq[b] = L + hi - lo
            t = np.arange(lo, hi, dtype=I64)
            if self.max_queries is not None and t.size > self.max_queries:
                pick = rng.choice(t[1:-1], self.max_queries - 2, replace=False)
                t = np.sort(np.concatenate([t[:1], pick, t[-1:]]))
            queries.append(t)
        inputs = dict(
            idx_mapping=rows.astype(I32),
            query_start_loc=qsl.astype(I32),
            num_computed_tokens=nct,
            block_tables=[t.copy() for t in self.tables],
            num_blocks=self.nb.copy(),
        )
        self.step_index += 1
        return DcpStep(
            index=s,
            inputs=inputs,
            rows=rows,
            kinds=[x[1] for x in sched] + ["dummy"],
            num_tokens=T,
            token_row=token_row,
            token_pos=token_pos,
            seq_lens=seq,
            k=k,
            v=v,
            q=qv,
            queries=queries,
            accepted={x[0]: x[3] for x in sched},
            others=others,
        )

    def accept(self, step: DcpStep) -> None:
        for r, acc in step.accepted.items():
            self.length[r] = acc


# -- backends -------------------------------------------------------------------------


def partial_attention_numpy(q, k, v, q_pos, k_pos):
    """Causal attention of ``q`` [nq, H, D] over ``k``, ``v`` [nk, H, D] (positions ``k_pos`` <=
    ``q_pos``), float64, and its log-sum-exp: ``(out [nq, H, D], lse [nq, H])``; a query
    with no key: out 0, lse -inf."""
    nq, H, D = q.shape
    if k.shape[0] == 0:
        return np.zeros((nq, H, D), F64), np.full((nq, H), -np.inf)
    s = np.einsum("qhd,khd->hqk", q.astype(F64), k.astype(F64)) / math.sqrt(D)
    s = np.where((np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None])[None], s, -np.inf)
    m = s.max(axis=-1)
    safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - safe[..., None])
    den = p.sum(axis=-1)
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, safe + np.log(np.where(den > 0, den, 1.0)), -np.inf)
    out = np.einsum("hqk,khd->qhd", p, v.astype(F64)) / np.where(den > 0, den, 1.0).T[..., None]
    return out, lse.T


def merge_numpy(outs, lses):
    """Merge partials ``outs`` [R, n, H, D], ``lses`` [R, n, H] by log-sum-exp -> (out, lse)."""
    m = lses.max(axis=0)
    safe = np.where(np.isneginf(m), 0.0, m)
    w = np.exp(lses - safe)
    den = w.sum(axis=0)
    out = (w[..., None] * outs).sum(axis=0) / np.where(den > 0, den, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, safe + np.log(np.where(den > 0, den, 1.0)), -np.inf)
    return out, lse


def full_attention_numpy(q, k, v, q_pos, k_pos):
    """Plain softmax attention (no log-sum-exp), float64: the ground truth on the CPU."""
    s = np.einsum("qhd,khd->hqk", q.astype(F64), k.astype(F64)) / math.sqrt(q.shape[-1])
    s = np.where((np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None])[None], s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v.astype(F64))


class NumpyBackend:
    """Caches and attention in NumPy (float64 arithmetic); unwritten cache entries are NaN."""

    name = "numpy"
    rtol = atol = 1e-9

    def to(self, x):
        return np.asarray(x)

    def host(self, x):
        return np.asarray(x)

    def new_cache(self, num_blocks, B, H, D):
        return np.full((num_blocks, B, H, D), np.nan, np.float32)

    def write(self, cache, slots, x):
        flat = cache.reshape(-1, *cache.shape[2:])
        ok = slots >= 0
        flat[slots[ok]] = x[ok]

    def read(self, cache, slots):
        return cache.reshape(-1, *cache.shape[2:])[slots]

    def set_item(self, x, index, value):
        x[index] = value

    def stack(self, xs):
        return np.stack(xs)

    def concat(self, xs, width):
        return np.concatenate(xs) if xs else np.zeros((0, *width))

    partial_attention = staticmethod(partial_attention_numpy)
    full_attention = staticmethod(full_attention_numpy)
    merge = staticmethod(merge_numpy)


class TorchBackend:
    """Caches and attention in PyTorch (float64 arithmetic): the partials by hand with
    ``torch.logsumexp``, the whole-context attention by ``scaled_dot_product_attention``."""

    name = "torch"
    rtol = atol = 1e-9

    def __init__(self, device="cuda"):
        import torch

        self.torch = torch
        self.device = torch.device(device)

    def to(self, x):
        if isinstance(x, np.ndarray):
            return self.torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        return self.torch.as_tensor(x, device=self.device)

    def host(self, x):
        if hasattr(x, "detach"):
            return x.detach().cpu().numpy()
        return np.asarray(x)

    def new_cache(self, num_blocks, B, H, D):
        return self.torch.full((num_blocks, B, H, D), float("nan"), dtype=self.torch.float32, device=self.device)

    def write(self, cache, slots, x):
        flat = cache.view(-1, *cache.shape[2:])
        slots = self.to(slots).long()
        ok = slots >= 0
        flat[slots[ok]] = self.to(x)[ok]

    def read(self, cache, slots):
        return cache.view(-1, *cache.shape[2:])[self.to(slots).long()]

    def set_item(self, x, index, value):
        x[index] = value

    def stack(self, xs):
        return self.torch.stack(list(xs))

    def concat(self, xs, width):
        if not xs:
            return self.torch.zeros((0, *width), dtype=self.torch.float64, device=self.device)
        return self.torch.cat(list(xs))

    def partial_attention(self, q, k, v, q_pos, k_pos):
        torch = self.torch
        q, k, v = (self.to(x).double() for x in (q, k, v))
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        mask = self.to(k_pos)[None, :] <= self.to(q_pos)[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [H, nq]; -inf for a query with no key
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        out = torch.einsum("hqk,khd->qhd", torch.exp(s - safe[..., None]), v)
        return out, lse.transpose(0, 1).contiguous()

    def full_attention(self, q, k, v, q_pos, k_pos):
        torch = self.torch
        q, k, v = (self.to(x).double().permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
        mask = self.to(k_pos)[None, :] <= self.to(q_pos)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.squeeze(0).permute(1, 0, 2)

    def merge(self, outs, lses):
        torch = self.torch
        m = lses.max(dim=0).values
        safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        w = torch.exp(lses - safe)
        den = w.sum(dim=0)
        one = torch.ones_like(den)
        out = (w[..., None] * outs).sum(dim=0) / torch.where(den > 0, den, one)[..., None]
        lse = torch.where(den > 0, safe + torch.log(torch.where(den > 0, den, one)), torch.full_like(den, -math.inf))
        return out, lse


# -- addressers -----------------------------------------------------------------------


class ReferenceAddresser:
    """A rank's vLLM step by the NumPy reference (the CPU stand-in for the kernel)."""

    name = "reference"

    def __init__(self, backend):
        self.backend = backend

    def reset(self) -> None:
        pass

    def compute(self, config: VllmStepConfig, inputs: dict):
        """``(outputs dict of backend arrays, error mask, mismatches with the reference)``."""
        res = vllm_step_reference(config, **inputs)
        to = self.backend.to
        o = res.outputs.as_dict()
        out = {k: (tuple(to(t) for t in v) if k == "input_block_tables" else to(v)) for k, v in o.items()}
        return out, res.error_mask, []


class PlannerAddresser:
    """A rank's vLLM step by the kernel (``VllmStepPlanner``), on torch tensors on a GPU.

    One planner per rank (its ``cp_rank``), with its own persistent request-state tensors
    (updated in place every step, as an engine does) and caller-owned torch outputs; the
    launch is on torch's current stream. Each step's outputs are compared with the NumPy
    reference (the mismatches are returned).
    """

    name = "kernel"

    def __init__(self, backend, device_index: int = 0):
        self.backend = backend
        self.device_index = device_index
        self.reset()

    def reset(self) -> None:
        self._planners: dict = {}

    def _planner(self, config: VllmStepConfig):
        hit = self._planners.get(config)
        if hit is not None:
            return hit
        import torch

        from kvaddr.engines.vllm import VllmStepPlanner

        dev = self.backend.device
        M, T, G = config.max_num_reqs, config.max_num_batched_tokens, config.num_groups
        out = dict(
            positions=torch.zeros(T, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(M, dtype=torch.int32, device=dev),
            slot_mappings=torch.zeros((G, T), dtype=torch.int64, device=dev),
            input_block_tables=[torch.zeros((M, w), dtype=torch.int32, device=dev) for w in config.widths],
            dcp_local_seq_lens=torch.zeros(M, dtype=torch.int32, device=dev),
        )
        planner = VllmStepPlanner(
            M,
            T,
            list(config.block_sizes),
            list(config.widths),
            dcp_sharded=list(config.dcp_sharded),
            cp_size=config.cp_size,
            cp_rank=config.cp_rank,
            cp_interleave=config.cp_interleave,
            out=out,
            device=self.device_index,
        )
        state = dict(
            num_computed_tokens=torch.zeros(M, dtype=torch.int32, device=dev),
            block_tables=[torch.zeros((M, w), dtype=torch.int32, device=dev) for w in config.widths],
            num_blocks=torch.zeros((G, M), dtype=torch.int32, device=dev),
        )
        self._planners[config] = hit = (planner, state)
        return hit

    def compute(self, config: VllmStepConfig, inputs: dict):
        import torch

        planner, state = self._planner(config)
        to = self.backend.to
        state["num_computed_tokens"].copy_(to(inputs["num_computed_tokens"]))
        for dst, src in zip(state["block_tables"], inputs["block_tables"]):
            dst.copy_(to(src))
        state["num_blocks"].copy_(to(inputs["num_blocks"]))
        stream = torch.cuda.current_stream(self.backend.device)
        out = planner.compute(
            to(inputs["idx_mapping"]),
            to(inputs["query_start_loc"]),
            state["num_computed_tokens"],
            state["block_tables"],
            state["num_blocks"],
            stream=stream,
        )
        mask, _ = planner.errors(stream)
        ref = vllm_step_reference(config, **inputs).outputs.as_dict()
        got = out.as_dict()
        bad = []
        for k, want in ref.items():
            if k == "input_block_tables":
                same = all(np.array_equal(self.backend.host(a), w) for a, w in zip(got[k], want))
            else:
                same = np.array_equal(self.backend.host(got[k]), want)
            if not same:
                bad.append(f"{k} differs from the reference")
        return got, mask, bad


# -- ranks ----------------------------------------------------------------------------


class LoopRanks:
    """Every DCP rank in this process, one after the other; the gather is a stack."""

    def __init__(self, backend, cp_size: int):
        self.backend, self.cp_size = backend, cp_size
        self.local = list(range(cp_size))
        self.is_root = True
        self.name = f"loop over {cp_size} rank{'s' if cp_size > 1 else ''}"

    def gather(self, xs):
        return self.backend.stack(xs)


# -- the run --------------------------------------------------------------------------


@dataclass
class Report:
    """What :func:`run_case` compared (on this process)."""

    checks: int = 0
    failures: list = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)

    def fail(self, text: str) -> None:
        self.failures.append(text)

    @property
    def ok(self) -> bool:
        return self.checks > 0 and not self.failures


def _slices(step: DcpStep):
    """Per batch index: (row, the checked query token indices, their rows in the stacked queries)."""
    out, n = [], 0
    for b, r in enumerate(step.rows):
        t = step.queries[b]
        out.append((int(r), t, slice(n, n + t.size)))
        n += t.size
    return out, n


def run_case(
    case: DcpCase,
    cp_size: int,
    backend,
    addresser,
    ranks,
    *,
    fault: str | None = None,
    max_queries: int | None = None,
    corrupt: Callable | None = None,
) -> Report:
    """Drive one case through its steps on the ranks ``ranks.local``; returns this process's report.

    ``fault`` (one of :data:`FAULTS`) breaks one thing on purpose, at step 1 on the last
    rank, so that a run can show its checks fail: ``slot`` gives a real token the slot of
    another request's token, ``partial`` drops the rank's partial attention before the
    merge, ``length`` shortens request 0's local length. ``corrupt(step, rank, outputs)``
    may edit a rank's outputs (backend arrays) before they are used.
    """
    report = Report()
    sim = DcpSimulation(case, cp_size, max_queries)
    G, H, D = len(case.block_sizes), case.heads, case.dim
    addresser.reset()
    configs = {c: sim.config(c) for c in ranks.local}
    caches = {
        c: [
            (backend.new_cache(n, B, H, D), backend.new_cache(n, B, H, D))
            for n, B in zip(sim.num_blocks_total, case.block_sizes)
        ]
        for c in ranks.local
    }
    split = [bool(sh) for sh in case.sharded]  # read per rank and merged (one rank: cp_size 1)
    bad_rank = cp_size - 1
    for _ in range(case.steps):
        step = sim.next_step()
        s, T, n = step.index, step.num_tokens, len(step.rows)
        report.kinds.update(step.kinds + step.others)
        real = step.token_row >= 0
        outs, host = {}, {}
        for c in ranks.local:
            out, mask, mismatches = addresser.compute(configs[c], step.inputs)
            report.checks += 1
            if mask:
                report.fail(f"step {s} rank {c}: error bits {mask:#x}")
            for m in mismatches:
                report.fail(f"step {s} rank {c}: {m}")
            if fault and s == 1 and c == bad_rank:
                _inject(fault, step, out, backend, configs[c])
            if corrupt is not None:
                corrupt(s, c, out)
            outs[c] = out
            h = host[c] = {
                "positions": backend.host(out["positions"]),
                "seq_lens": backend.host(out["seq_lens"]),
                "dcp": backend.host(out["dcp_local_seq_lens"]),
                "tables": [backend.host(t) for t in out["input_block_tables"]],
            }
            report.checks += 2
            if not np.array_equal(h["positions"][:T], np.where(real, step.token_pos, 0)) or h["positions"][T:].any():
                report.fail(f"step {s} rank {c}: positions differ from the simulation's")
            want_seq = np.zeros(sim.M, I64)
            want_seq[:n] = step.seq_lens
            if not np.array_equal(h["seq_lens"], want_seq):
                report.fail(f"step {s} rank {c}: seq_lens differ from the simulation's")
            for g in range(G):
                kc, vc = caches[c][g]
                slots = out["slot_mappings"][g]
                backend.write(kc, slots[:T], step.k)
                backend.write(vc, slots[:T], step.v)

        # Ownership and lengths, over every rank's addressing (gathered).
        all_slots = backend.host(ranks.gather([outs[c]["slot_mappings"] for c in ranks.local]))  # [cp, G, Tcap]
        all_lens = backend.host(ranks.gather([outs[c]["dcp_local_seq_lens"] for c in ranks.local]))  # [cp, M]
        if ranks.is_root:
            _check_ownership(report, s, step, sim, all_slots, all_lens)

        # Attention: every rank's partials over its local KV, gathered and merged.
        sl, nq = _slices(step)
        want = {}
        need_want = ranks.is_root or not all(split)
        if need_want:
            for b, (r, t, _) in enumerate(sl):
                if r < 0 or t.size == 0:
                    continue
                L = int(step.seq_lens[b])
                want[b] = backend.full_attention(
                    step.q[t], sim.truth_k[r, :L], sim.truth_v[r, :L], step.token_pos[t], np.arange(L)
                )
        for g in range(G):
            B = case.block_sizes[g]
            il = case.interleave if (split[g] and cp_size > 1) else B
            parts, lses = [], []
            for c in ranks.local:
                h = host[c]
                kc, vc = caches[c][g]
                o_list, l_list = [], []
                for b, (_, t, _) in enumerate(sl):
                    if t.size == 0:
                        continue
                    L = int(h["dcp"][b]) if split[g] else int(h["seq_lens"][b])
                    cp_g, c_g = (cp_size, c) if split[g] else (1, 0)
                    table = h["tables"][g][b]
                    if table.shape[0] * B < L:
                        report.fail(f"step {s} rank {c} group {g} request {b}: local length {L} past the table")
                        L = table.shape[0] * B
                    j = np.arange(L, dtype=I64)
                    local_slots = table[j // B].astype(I64) * B + j % B
                    k_pos = global_positions(L, B, cp_g, c_g, il if split[g] else 1)
                    k = backend.read(kc, local_slots)
                    v = backend.read(vc, local_slots)
                    q_pos = h["positions"][t]
                    o, lse = backend.partial_attention(step.q[t], k, v, q_pos, k_pos)
                    if split[g]:
                        o_list.append(o)
                        l_list.append(lse)
                    else:  # an unsharded group: the whole context on every rank
                        report.checks += 1
                        if not _close(backend, o, want[b]):
                            report.fail(
                                f"step {s} rank {c} group {g} (unsharded) request {b} ({step.kinds[b]}): "
                                f"attention differs (max |diff| {_diff(backend, o, want[b]):.3g})"
                            )
                if split[g]:
                    parts.append(backend.concat(o_list, (H, D)))
                    lses.append(backend.concat(l_list, (H,)))
            if not split[g] or nq == 0:
                continue
            outs_all = ranks.gather(parts)  # [cp, nq, H, D]
            lses_all = ranks.gather(lses)  # [cp, nq, H]
            if fault == "partial" and s == 1 and g == 0:
                backend.set_item(outs_all, bad_rank, 0.0)
                backend.set_item(lses_all, bad_rank, -math.inf)
            merged, _ = backend.merge(outs_all, lses_all)
            if not ranks.is_root:
                continue
            for b, (r, t, rs) in enumerate(sl):
                if r < 0 or t.size == 0:
                    continue
                report.checks += 1
                if not _close(backend, merged[rs], want[b]):
                    report.fail(
                        f"step {s} group {g} request {b} ({step.kinds[b]}, {int(step.seq_lens[b])} tokens): merged "
                        f"attention differs from the whole context's (max |diff| {_diff(backend, merged[rs], want[b]):.3g})"
                    )
        sim.accept(step)
    return report


def _close(backend, a, b) -> bool:
    a, b = backend.host(a), backend.host(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=backend.rtol, atol=backend.atol))


def _diff(backend, a, b) -> float:
    a, b = backend.host(a), backend.host(b)
    if a.shape != b.shape:
        return math.inf
    d = np.abs(a.astype(F64) - b.astype(F64))
    return float(np.nanmax(d)) if not np.isnan(d).all() else math.nan


def _check_ownership(report: Report, s: int, step: DcpStep, sim: DcpSimulation, all_slots, all_lens) -> None:
    """Every real token's KV on exactly one rank (sharded) or on all with one slot (unsharded);
    padding on none; no slot shared by two tokens on a rank; local lengths add up to seq_lens."""
    case, cp = sim.case, sim.cp
    T, n = step.num_tokens, len(step.rows)
    real = step.token_row >= 0
    for g, B in enumerate(case.block_sizes):
        sl = all_slots[:, g, :]  # [cp, Tcap]
        has = sl[:, :T] >= 0
        count = has.sum(axis=0)
        report.checks += 1
        if (sl[:, T:] >= 0).any() or has[:, ~real].any():
            report.fail(f"step {s} group {g}: a padding or dummy token has a slot")
        if case.sharded[g] and cp > 1:
            owner = owner_rank(step.token_pos, B, cp, case.interleave)
            bad = real & ((count != 1) | ~has[owner, np.arange(T)])
            if bad.any():
                t = int(np.flatnonzero(bad)[0])
                report.fail(
                    f"step {s} group {g}: token {t} (position {int(step.token_pos[t])}) written by "
                    f"{int(count[t])} ranks {np.flatnonzero(has[:, t]).tolist()}, want exactly rank {int(owner[t])}"
                )
        else:
            bad = real & ((count != cp) | (sl[:, :T] != sl[:1, :T]).any(axis=0))
            if bad.any():
                t = int(np.flatnonzero(bad)[0])
                report.fail(f"step {s} group {g} (unsharded): token {t} not written by every rank at one slot")
        for c in range(cp):
            got = sl[c, :T][has[c]]
            report.checks += 1
            if np.unique(got).size != got.size:
                report.fail(f"step {s} group {g} rank {c}: two tokens of the step share a slot")
    report.checks += 1
    total = all_lens[:, :n].astype(I64).sum(axis=0)
    if not np.array_equal(total, step.seq_lens) or all_lens[:, n:].any():
        b = int(np.flatnonzero(total != step.seq_lens)[0]) if (total != step.seq_lens).any() else n
        report.fail(
            f"step {s}: local lengths add up to {total.tolist()[b : b + 1]}, seq_lens {step.seq_lens[b : b + 1]}"
        )


def _inject(fault: str, step: DcpStep, out: dict, backend, config: VllmStepConfig) -> None:
    if fault == "slot":
        slots = backend.host(out["slot_mappings"][0][: step.num_tokens])
        mine = np.flatnonzero((slots >= 0) & (step.token_row >= 0))
        rows = step.token_row[mine]
        other = np.flatnonzero(rows != rows[0])
        if mine.size and other.size:
            backend.set_item(out["slot_mappings"], (0, int(mine[0])), int(slots[mine[other[0]]]))
        elif mine.size:  # a single request owns this rank's tokens: send one to an unused slot
            backend.set_item(out["slot_mappings"], (0, int(mine[0])), -1)
    elif fault == "length":
        backend.set_item(out["dcp_local_seq_lens"], 0, int(backend.host(out["dcp_local_seq_lens"])[0]) - 1)
    elif fault != "partial":
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
