"""Batches for the vLLM engine profile and benchmark: decode and mixed shapes, 1-4
KV-cache groups, DCP, dummy (CUDA-graph padding) requests, permuted sparse rows.

A shape is ``decode:N`` (N requests, one token each) or ``mixed:N:T`` (N requests
carrying about T tokens: a sixteenth of them prefill chunks, the rest decodes).
Every input set of a shape shares one :class:`~kvaddr.engines.vllm_config.VllmStepConfig`
(one planner serves them all) and the same request state; the sets differ in which
rows the batch picks (``idx_mapping``, a random permutation of a sparse subset of
the ``max_num_reqs`` rows) and in their query lengths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from kvaddr.engines.vllm_config import VllmStepConfig

I32 = np.int32

#: The shapes the issue's speed targets name.
DEFAULT_SHAPES = ("decode:64", "decode:1024", "decode:4096", "mixed:256:16384")


@dataclass(frozen=True)
class VllmShape:
    """One batch shape: ``kind`` "decode" or "mixed", requests and (mixed) tokens."""

    kind: str
    num_reqs: int
    num_tokens: int

    @property
    def name(self) -> str:
        return f"decode:{self.num_reqs}" if self.kind == "decode" else f"mixed:{self.num_reqs}:{self.num_tokens}"


def parse_shape(text: str) -> VllmShape:
    """``decode:N``, ``mixed:N:T`` or a bare ``N`` (decode)."""
    s = str(text).strip()
    m = re.fullmatch(r"(?:decode:)?(\d+)", s)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ValueError(f"shape must have at least one request, got {text!r}")
        return VllmShape("decode", n, n)
    m = re.fullmatch(r"mixed:(\d+):(\d+)", s)
    if m:
        n, t = int(m.group(1)), int(m.group(2))
        if n < 2 or t < n:
            raise ValueError(f"shape mixed:N:T needs N >= 2 and T >= N, got {text!r}")
        return VllmShape("mixed", n, t)
    raise ValueError(f"shape must be decode:N, mixed:N:T or N, got {text!r}")


@dataclass(frozen=True)
class VllmWorkload:
    """What the engine profile's batches look like (all shapes).

    Parameters
    ----------
    block_sizes : tuple of int
        One KV-cache group per entry (1 to 4).
    context : (int, int)
        Range of ``num_computed_tokens`` (log-uniform).
    dummy_fraction : float
        Share of the padded batch that is dummy requests (``idx_mapping = -1``)
        added on top of the shape's requests (rounded down).
    rows_factor : int
        ``max_num_reqs`` = this times the padded batch: the batch picks a sparse,
        permuted subset of the rows.
    cp_size, cp_rank, cp_interleave : int
        DCP (``cp_size = 1``: off); the first group is sharded, the others not.
    sliding_window_reach : int
        R of the last group when there are two or more groups (0: none).
    input_sets : int
        Input sets per shape (rotated while timing).
    seed : int
    """

    block_sizes: tuple = (16,)
    context: tuple = (128, 2048)
    dummy_fraction: float = 0.0
    rows_factor: int = 2
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    sliding_window_reach: int = 0
    input_sets: int = 4
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {
            "block_sizes": list(self.block_sizes),
            "context": list(self.context),
            "dummy_fraction": self.dummy_fraction,
            "rows_factor": self.rows_factor,
            "cp_size": self.cp_size,
            "cp_rank": self.cp_rank,
            "cp_interleave": self.cp_interleave,
            "sliding_window_reach": self.sliding_window_reach,
            "input_sets": self.input_sets,
            "seed": self.seed,
        }


@dataclass
class VllmBatchSet:
    """A shape's config, request state and input sets (NumPy)."""

    shape: VllmShape
    config: VllmStepConfig
    num_reqs: int  # idx_mapping entries (requests + dummies)
    num_reqs_padded: int
    inputs: list  # dicts: idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks

    def stats(self, i: int) -> dict:
        x = self.inputs[i]
        idx, qsl = x["idx_mapping"], x["query_start_loc"]
        q = np.diff(qsl)
        return {
            "num_reqs": int(idx.shape[0]),
            "dummies": int((idx < 0).sum()),
            "num_tokens": int(qsl[-1]),
            "max_query": int(q.max()) if q.size else 0,
        }


def _pad(n: int) -> int:
    """The CUDA-graph size a batch of n rounds up to (8, then multiples of 8)."""
    return max(8, -(-n // 8) * 8)


def _log_uniform(rng, lo: int, hi: int, n: int) -> np.ndarray:
    lo, hi = max(lo, 1), max(hi, 1)
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(np.int64).clip(lo, hi)


def _query_lengths(rng, shape: VllmShape, n_real: int) -> np.ndarray:
    if shape.kind == "decode":
        return np.ones(n_real, np.int64)
    n_pre = max(1, n_real // 16)
    rest = max(shape.num_tokens - (n_real - n_pre), n_pre)
    cuts = np.sort(rng.integers(0, rest + 1, n_pre - 1))
    pre = np.diff(np.concatenate([[0], cuts, [rest]])).astype(np.int64)
    pre = np.maximum(pre, 1)
    q = np.ones(n_real, np.int64)
    q[rng.permutation(n_real)[:n_pre]] = pre
    return q


def make_batch_set(workload: VllmWorkload, shape: VllmShape) -> VllmBatchSet:
    """A shape's input sets (deterministic in the workload's seed and the shape)."""
    rng = np.random.default_rng([workload.seed, shape.num_reqs, shape.num_tokens])
    G = len(workload.block_sizes)
    n_real = shape.num_reqs
    n_dummy = int(workload.dummy_fraction * n_real)
    n = n_real + n_dummy
    padded = _pad(n)
    M = padded * max(1, int(workload.rows_factor))
    qs = [_query_lengths(rng, shape, n_real) for _ in range(workload.input_sets)]
    max_q = int(max(q.max() for q in qs))
    T = _pad(int(max(q.sum() for q in qs)) + n_dummy)
    nct = _log_uniform(rng, workload.context[0], workload.context[1], M).astype(I32)
    cp = workload.cp_size
    sharded = [g == 0 for g in range(G)]
    reach = [0] * G
    if G > 1 and workload.sliding_window_reach:
        reach[-1] = int(workload.sliding_window_reach)
    widths, tables, nbs = [], [], []
    for g, B in enumerate(workload.block_sizes):
        span = B * (cp if (cp > 1 and sharded[g]) else 1)
        need = -(-(nct.astype(np.int64) + max_q) // span)
        W = int(need.max())
        widths.append(W)
        t = rng.integers(1, 1 << 22, (M, W)).astype(I32)
        t[np.arange(W)[None, :] >= need[:, None]] = -1
        tables.append(t)
        nbs.append(need.astype(I32))
    config = VllmStepConfig(
        M,
        T,
        list(workload.block_sizes),
        widths,
        dcp_sharded=sharded,
        sliding_window_reach=reach,
        cp_size=cp,
        cp_rank=workload.cp_rank,
        cp_interleave=workload.cp_interleave,
    )
    inputs = []
    for q in qs:
        rows = rng.permutation(M)[:n_real].astype(I32)
        idx = np.concatenate([rows, np.full(n_dummy, -1, I32)])
        qq = np.concatenate([q, np.ones(n_dummy, np.int64)])  # a dummy request carries one padding token
        perm = rng.permutation(n)
        idx, qq = idx[perm], qq[perm]
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(qq, out=qsl[1:])
        inputs.append(
            dict(
                idx_mapping=idx,
                query_start_loc=qsl.astype(I32),
                num_computed_tokens=nct,
                block_tables=tables,
                num_blocks=nbs,
            )
        )
    return VllmBatchSet(shape, config, n, padded, inputs)


def pinned_num_blocks(num_blocks, device: int | None = None) -> tuple:
    """``num_blocks`` as vLLM keeps it: one int32 ``[G, rows]`` array in pinned host memory that
    kernels read through UVA. Returns ``(host, view)``: the pinned NumPy array
    (``cupyx.empty_pinned``, holding ``num_blocks``) and a CuPy array over the same memory at its
    device pointer (as vLLM's CUDA view of its pinned tensor), on ``device`` (the current one by
    default). Keep ``host`` alive while ``view`` is used (``view`` holds it too)."""
    import cupy
    import cupyx

    from kvaddr.validation import mapped_pointer

    a = np.ascontiguousarray(np.asarray(num_blocks, dtype=I32))
    host = cupyx.empty_pinned(a.shape, I32)
    host[...] = a
    dev = cupy.cuda.runtime.getDevice() if device is None else int(device)
    addr = mapped_pointer("num_blocks", host.ctypes.data)
    mem = cupy.cuda.UnownedMemory(addr, max(host.nbytes, 1), host, dev)
    view = cupy.ndarray(a.shape, I32, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return host, view
