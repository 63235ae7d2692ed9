"""End-to-end paged attention through kvaddr's outputs (docs/attention.md, "Testing").

A simulated batch runs several steps. Each step, random K/V for every token the step
carries are written into a paged cache ``[num_blocks, B, heads, dim]`` per cache through
that step's ``slot_mapping`` (tokens of earlier steps were written through earlier
steps' mappings). Then, for every request, the cache is read back through
``kv_indptr``/``kv_indices``/``kv_last_page_len`` and, separately, through
``page_table`` and ``seqused_k``, and attention on what was read (causal by position)
is compared with attention on the contiguous K/V the simulation kept. This shows that
the slots written and the indices read agree.

The simulation and the ground truth are NumPy on the host; a *backend* holds the
caches and computes attention: :class:`NumpyBackend` (a NumPy softmax, in CI) or
:class:`TorchBackend` (PyTorch ``scaled_dot_product_attention`` on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

I32 = np.int32
ALL_GROUPS = ("flashinfer", "varlen", "page_table")


@dataclass
class Step:
    """One step's inputs and its new data (host NumPy)."""

    seq_lens_decoder: np.ndarray  # int32 [bsz]
    seq_lens_this_time: np.ndarray  # int32 [bsz]
    block_tables: list  # int32 [bsz, W_g] per cache
    k: np.ndarray  # float32 [tokens, heads, dim]: the step's new keys, batch order
    v: np.ndarray  # float32 [tokens, heads, dim]
    q: np.ndarray  # float32 [tokens, heads, dim]: one query per token
    probe: np.ndarray  # float32 [bsz, heads, dim]: a query for idle requests, at position L_b - 1


@dataclass
class Simulation:
    """A batch of ``num_requests`` slots driven through ``steps`` steps.

    Every step each slot is one of: empty (L = 0, never started), prefill / chunked
    prefill continuation, decode, speculative decode (1 + k tokens, of which a random
    number is accepted: the rejected positions are rewritten later), or idle (no
    tokens, KV kept). Blocks are allocated from a shuffled pool per cache as the
    requests grow; tables hold -1 past the allocated blocks.
    """

    num_requests: int = 6
    steps: int = 6
    block_sizes: tuple = (4, 3)
    heads: int = 2
    dim: int = 8
    max_ctx: int = 48
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.width = [-(-self.max_ctx // B) + 1 for B in self.block_sizes]
        self.num_blocks = [self.num_requests * W + 3 for W in self.width]
        self.pools = [list(self.rng.permutation(n)) for n in self.num_blocks]
        self.tables = [np.full((self.num_requests, W), -1, I32) for W in self.width]
        self.length = np.zeros(self.num_requests, np.int64)  # tokens in the cache (accepted)
        self.truth_k = np.zeros((self.num_requests, self.max_ctx, self.heads, self.dim), np.float32)
        self.truth_v = np.zeros_like(self.truth_k)
        self.empty = self.rng.random(self.num_requests) < 0.2  # slots that never start
        self.kv_indices_capacity = sum(int(t.size) for t in self.tables)

    def _allocate(self, b: int, L: int) -> None:
        for g, B in enumerate(self.block_sizes):
            need = -(-L // B)
            row = self.tables[g][b]
            for j in range(need):
                if row[j] < 0:
                    row[j] = self.pools[g].pop()

    def next_step(self) -> tuple[Step, np.ndarray]:
        """The next step, and each request's accepted length after it (for :meth:`accept`)."""
        dec = self.length.astype(I32)
        q = np.zeros(self.num_requests, I32)
        accepted = self.length.copy()
        for b in range(self.num_requests):
            room = self.max_ctx - int(self.length[b])
            if self.empty[b] or room <= 0:
                continue
            kind = self.rng.choice(["prefill", "decode", "speculative", "idle"] if self.length[b] else ["prefill"])
            if kind == "prefill":
                q[b] = int(self.rng.integers(1, min(room, 13) + 1))
                accepted[b] += q[b]
            elif kind == "decode":
                q[b] = 1
                accepted[b] += 1
            elif kind == "speculative":
                q[b] = min(1 + int(self.rng.integers(1, 4)), room)
                accepted[b] += 1 + int(self.rng.integers(0, q[b]))  # the rest is rejected
        L = dec.astype(np.int64) + q
        for b in range(self.num_requests):
            self._allocate(b, int(L[b]))
        T = int(q.sum())
        shape = (T, self.heads, self.dim)
        step = Step(
            seq_lens_decoder=dec,
            seq_lens_this_time=q,
            block_tables=[t.copy() for t in self.tables],
            k=self.rng.standard_normal(shape, dtype=np.float32),
            v=self.rng.standard_normal(shape, dtype=np.float32),
            q=self.rng.standard_normal(shape, dtype=np.float32),
            probe=self.rng.standard_normal((self.num_requests, self.heads, self.dim), dtype=np.float32),
        )
        t = 0
        for b in range(self.num_requests):  # the truth: token t of request b is at position dec + i
            for i in range(int(q[b])):
                self.truth_k[b, dec[b] + i] = step.k[t]
                self.truth_v[b, dec[b] + i] = step.v[t]
                t += 1
        return step, accepted

    def accept(self, accepted: np.ndarray) -> None:
        self.length = accepted


def causal_attention_numpy(q, k, v, q_pos, k_pos):
    """softmax(q k^T / sqrt(d), masked to k_pos <= q_pos) v; q [nq, H, D], k, v [nk, H, D] -> [nq, H, D]."""
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    s = np.where(k_pos[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v.astype(np.float64))


class NumpyBackend:
    """Caches and attention in NumPy (float64 attention, exact comparison up to rounding)."""

    rtol, atol = 1e-12, 1e-12

    def host(self, x):
        return np.asarray(x)

    def new_cache(self, num_blocks, B, heads, dim):
        return np.full((num_blocks, B, heads, dim), np.nan, np.float32)  # unwritten = NaN: reading it shows

    def write(self, cache, slots, x):
        """cache.view(-1, H, D)[slots[t]] = x[t] for every token (slots >= 0)."""
        flat = cache.reshape(-1, *cache.shape[2:])
        ok = slots >= 0
        flat[slots[ok]] = x[ok]

    def gather_pages(self, cache, pages, length):
        """Concatenate the pages' tokens and keep the first ``length``."""
        return cache[np.asarray(pages, dtype=np.int64)].reshape(-1, *cache.shape[2:])[:length]

    def attention(self, q, k, v, q_pos, k_pos):
        return causal_attention_numpy(q, k, v, q_pos, k_pos)

    def asarray(self, x):
        return np.asarray(x)

    def close(self, a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=self.rtol, atol=self.atol))


class TorchBackend(NumpyBackend):
    """Caches on a GPU in PyTorch; attention by ``torch.nn.functional.scaled_dot_product_attention``."""

    rtol, atol = 1e-5, 1e-5

    def __init__(self, device="cuda"):
        import torch

        self.torch = torch
        self.device = device

    def host(self, x):
        if hasattr(x, "detach"):
            return x.detach().cpu().numpy()
        if hasattr(x, "get"):  # CuPy
            return x.get()
        return np.asarray(x)

    def asarray(self, x):
        torch = self.torch
        if isinstance(x, np.ndarray):
            return torch.as_tensor(x, device=self.device)
        return torch.as_tensor(x, device=self.device)  # CuPy / CUDA array interface

    def new_cache(self, num_blocks, B, heads, dim):
        return self.torch.full((num_blocks, B, heads, dim), float("nan"), device=self.device)

    def write(self, cache, slots, x):
        flat = cache.view(-1, *cache.shape[2:])
        slots = self.asarray(slots).long()
        x = self.asarray(x)
        ok = slots >= 0
        flat[slots[ok]] = x[ok]

    def gather_pages(self, cache, pages, length):
        pages = self.asarray(pages).long()
        return cache[pages].reshape(-1, *cache.shape[2:])[: int(length)]

    def attention(self, q, k, v, q_pos, k_pos):
        torch = self.torch
        q, k, v = (self.asarray(x).float().permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
        mask = self.asarray(k_pos)[None, :] <= self.asarray(q_pos)[:, None]  # [nq, nk], True = attend
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.squeeze(0).permute(1, 0, 2)

    def close(self, a, b):
        torch = self.torch
        a, b = self.asarray(a), self.asarray(b)
        return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=self.rtol, atol=self.atol))


@dataclass
class Report:
    """What :func:`run_e2e` compared: ``checks`` comparisons, ``failures`` descriptions."""

    checks: int = 0
    failures: list = field(default_factory=list)
    kinds: set = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.checks > 0 and not self.failures


Compute = Callable[[np.ndarray, np.ndarray, list], object]  # (dec, q, tables) -> StepOutputs with .attention


def run_e2e(
    sim: Simulation,
    compute: Compute,
    backend=None,
    *,
    corrupt: Callable | None = None,
    paths=("flashinfer", "page_table"),
) -> Report:
    """Drive ``sim`` through its steps with ``compute`` (a step's addressing + attention metadata).

    ``corrupt(step_index, attention)`` may edit the (backend) metadata before it is read
    (a negative test). Every request with tokens compares attention for each of its
    query tokens; an idle request compares a probe query at its last position.
    """
    backend = backend or NumpyBackend()
    H, D = sim.heads, sim.dim
    caches = [backend.new_cache(n, B, H, D) for n, B in zip(sim.num_blocks, sim.block_sizes)]
    caches_v = [backend.new_cache(n, B, H, D) for n, B in zip(sim.num_blocks, sim.block_sizes)]
    report = Report()
    for s in range(sim.steps):
        step, accepted = sim.next_step()
        out = compute(step.seq_lens_decoder, step.seq_lens_this_time, step.block_tables)
        T = int(step.seq_lens_this_time.sum())
        num_tokens = int(backend.host(out.num_tokens))
        if num_tokens != T:
            report.failures.append(f"step {s}: num_tokens {num_tokens} != {T}")
            continue
        att = out.attention
        meta = {
            name: backend.asarray(getattr(att, name))
            for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "seqused_k")
            if getattr(att, name) is not None
        }
        meta["page_table"] = [backend.asarray(t) for t in att.page_table] if att.page_table is not None else None
        if corrupt is not None:
            corrupt(s, meta)
        for g in range(len(sim.block_sizes)):
            slots = backend.asarray(out.slot_mapping)[g][:T]
            backend.write(caches[g], slots, step.k)
            backend.write(caches_v[g], slots, step.v)
        dec = step.seq_lens_decoder.astype(np.int64)
        L = dec + step.seq_lens_this_time
        cu = np.concatenate([[0], np.cumsum(step.seq_lens_this_time)])
        host_meta = {k: backend.host(v) for k, v in meta.items() if k != "page_table"}
        for b in range(sim.num_requests):
            Lb = int(L[b])
            if Lb == 0:
                report.kinds.add("empty")
                continue
            if step.seq_lens_this_time[b]:
                qs = step.q[cu[b] : cu[b + 1]]
                q_pos = np.arange(dec[b], Lb)
                report.kinds.add("tokens")
            else:
                qs = step.probe[b : b + 1]
                q_pos = np.array([Lb - 1])
                report.kinds.add("idle")
            k_pos = np.arange(Lb)
            want = backend.attention(qs, sim.truth_k[b, :Lb], sim.truth_v[b, :Lb], q_pos, k_pos)
            for g, B in enumerate(sim.block_sizes):
                reads = {}
                if "flashinfer" in paths:
                    lo, hi = int(host_meta["kv_indptr"][g, b]), int(host_meta["kv_indptr"][g, b + 1])
                    last = int(host_meta["kv_last_page_len"][g, b])
                    n = (hi - lo - 1) * B + last if hi > lo else 0
                    pages = meta["kv_indices"][g][lo:hi]
                    reads["flashinfer"] = (pages, n)
                if "page_table" in paths:
                    used = int(host_meta["seqused_k"][b])
                    pages = meta["page_table"][g][b][: -(-used // B)]
                    reads["page_table"] = (pages, used)
                for path, (pages, n) in reads.items():
                    report.checks += 1
                    if n != Lb:
                        report.failures.append(f"step {s} request {b} cache {g} {path}: read {n} tokens, want {Lb}")
                        continue
                    if bool((backend.host(pages) < 0).any()):
                        report.failures.append(f"step {s} request {b} cache {g} {path}: a negative page id")
                        continue
                    k = backend.gather_pages(caches[g], pages, n)
                    v = backend.gather_pages(caches_v[g], pages, n)
                    got = backend.attention(qs, k, v, q_pos, k_pos)
                    if not backend.close(got, want):
                        report.failures.append(f"step {s} request {b} cache {g} {path}: attention differs")
        sim.accept(accepted)
    return report
