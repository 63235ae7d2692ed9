"""vLLM step cases shared by the CPU and GPU tests: the worked example, random
batches (permuted sparse idx_mapping, dummies, several groups, DCP) and a
per-token loop oracle written independently of the vectorised reference."""

from __future__ import annotations

import numpy as np

from kvaddr.engines.vllm_config import VllmStepConfig

I32 = np.int32
INT32_MAX = 2**31 - 1


def worked_example(**config_over):
    """The issue's worked example: B = 4, one group, max_num_reqs 4, 6 tokens."""
    cfg = dict(max_num_reqs=4, max_num_batched_tokens=6, block_sizes=[4], widths=[4])
    cfg.update(config_over)
    inputs = dict(
        idx_mapping=np.array([2, 0], I32),
        query_start_loc=np.array([0, 1, 3], I32),
        num_computed_tokens=np.array([9, 0, 5, 0], I32),
        block_tables=[np.array([[1, 3, 8, -1], [0, 0, 0, 0], [7, 2, -1, -1], [0, 0, 0, 0]], I32)],
        num_blocks=[np.array([3, 0, 2, 0], I32)],
    )
    return VllmStepConfig(**cfg), inputs


#: The outputs of :func:`worked_example` (docs/vllm.md), without DCP.
WORKED_EXAMPLE_OUTPUTS = dict(
    positions=np.array([5, 9, 10, 0, 0, 0], np.int64),
    seq_lens=np.array([6, 11, 0, 0], np.int32),
    slot_mappings=np.array([[9, 33, 34, -1, -1, -1]], np.int64),
    input_block_tables=(np.array([[7, 2, 0, 0], [1, 3, 8, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32),),
    dcp_local_seq_lens=np.array([6, 11, 0, 0], np.int32),
)


def random_case(
    rng: np.random.Generator,
    *,
    max_num_reqs: int,
    num_reqs: int,
    block_sizes=(16,),
    max_query: int = 1,
    max_context: int = 300,
    dummy_fraction: float = 0.1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    slot_mapping_enabled=None,
    dcp_sharded=None,
    sliding_window_reach=None,
    spare_tokens: int = 5,
    idx_dtype=np.int32,
    slot_dtype=np.int64,
    max_block_id: int = 1 << 20,
):
    """A valid random step: every real request's blocks allocated, in range."""
    G = len(block_sizes)
    ids = rng.permutation(max_num_reqs)[:num_reqs].astype(np.int64)  # permuted, sparse rows
    dummy = rng.random(num_reqs) < dummy_fraction
    idx = np.where(dummy, -1, ids).astype(idx_dtype)
    q = rng.integers(0, max_query + 1, num_reqs) if max_query > 1 else np.ones(num_reqs, np.int64)
    qsl = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    T = max(int(qsl[-1]) + spare_tokens, 1)
    nct = rng.integers(0, max_context + 1, max_num_reqs).astype(I32)
    reach = sliding_window_reach or [0] * G
    widths, tables, nbs = [], [], []
    for g, B in enumerate(block_sizes):
        span = B * (cp_size if (cp_size > 1 and (dcp_sharded is None or dcp_sharded[g])) else 1)
        need = -(-(nct.astype(np.int64) + max_query) // span)
        W = int(need.max()) + 2
        widths.append(W)
        t = rng.integers(0, max_block_id, (max_num_reqs, W)).astype(I32)
        nb = np.minimum(need + rng.integers(0, 2, max_num_reqs), W).astype(I32)
        t[np.arange(W)[None, :] >= nb[:, None]] = -1  # unallocated past num_blocks
        tables.append(t)
        nbs.append(nb)
    cfg = VllmStepConfig(
        max_num_reqs,
        T,
        list(block_sizes),
        widths,
        slot_mapping_enabled=slot_mapping_enabled,
        dcp_sharded=dcp_sharded,
        sliding_window_reach=reach,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        slot_dtype=slot_dtype,
    )
    inputs = dict(
        idx_mapping=idx,
        query_start_loc=qsl.astype(I32),
        num_computed_tokens=nct,
        block_tables=tables,
        num_blocks=nbs,
    )
    return cfg, inputs


def loop_reference(cfg: VllmStepConfig, inputs: dict) -> dict:
    """Token by token, request by request: the contract for valid inputs."""
    M, T, G = cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.num_groups
    idx = [int(x) for x in inputs["idx_mapping"]]
    qsl = [int(x) for x in inputs["query_start_loc"]]
    nct = [int(x) for x in inputs["num_computed_tokens"]]
    tables, nbs = inputs["block_tables"], inputs["num_blocks"]
    n = len(idx)
    positions = [0] * T
    slots = [[-1] * T for _ in range(G)]
    seq = [0] * M
    gathered = [np.zeros((M, cfg.widths[g]), I32) for g in range(G)]
    cp, c, il = cfg.cp_size, cfg.cp_rank, cfg.cp_interleave
    for b in range(n):
        r = idx[b]
        if r == -1:
            continue
        seq[b] = min(nct[r] + qsl[b + 1] - qsl[b], INT32_MAX)
        for g in range(G):
            B, W, R = cfg.block_sizes[g], cfg.widths[g], cfg.sliding_window_reach[g]
            k = min(max(int(nbs[g][r]), 0), W)
            first = max(nct[r] - R, 0) // B if R > 0 else 0
            for j in range(k):
                if j >= first:
                    gathered[g][b, j] = tables[g][r, j]
        for t in range(qsl[b], min(qsl[b + 1], T)):
            p = nct[r] + (t - qsl[b])
            positions[t] = p
            for g in range(G):
                if not cfg.slot_mapping_enabled[g]:
                    continue
                B = cfg.block_sizes[g]
                if cfg.sharded(g):
                    vb, vo = divmod(p, B * cp)
                    if (vo // il) % cp != c:
                        continue
                    blk_index, off = vb, (vo // (il * cp)) * il + vo % il
                else:
                    blk_index, off = divmod(p, B)
                if blk_index < cfg.widths[g] and blk_index < nbs[g][r]:
                    blk = int(tables[g][r, blk_index])
                    if blk >= 0:
                        s = blk * B + off
                        slots[g][t] = s if (cfg.slot_dtype == np.int64 or s <= INT32_MAX) else -1
    dcp = []
    for s in seq:
        if cp == 1:
            dcp.append(s)
        else:
            dcp.append((s // (il * cp)) * il + min(max(s % (il * cp) - c * il, 0), il))
    return dict(
        positions=np.array(positions, np.int64),
        seq_lens=np.array(seq, I32),
        slot_mappings=np.array(slots, cfg.slot_dtype).reshape(G, T),
        input_block_tables=tuple(gathered),
        dcp_local_seq_lens=np.array(dcp, I32),
    )


def assert_same(got, want: dict, label: str = "") -> None:
    """Compare a VllmStepOutputs (NumPy, CuPy or torch arrays) with a dict of NumPy arrays."""
    for name, w in want.items():
        g = getattr(got, name) if not isinstance(got, dict) else got[name]
        if name == "input_block_tables":
            assert len(g) == len(w), f"{label}: {name} has {len(g)} groups, want {len(w)}"
            pairs = [(f"{name}[{k}]", a, b) for k, (a, b) in enumerate(zip(g, w))]
        else:
            pairs = [(name, g, w)]
        for what, a, b in pairs:
            a = to_numpy(a)
            assert a.dtype == b.dtype, f"{label}: {what} dtype {a.dtype} != {b.dtype}"
            assert a.shape == b.shape, f"{label}: {what} shape {a.shape} != {b.shape}"
            if not np.array_equal(a, b):
                at = tuple(np.argwhere(a != b)[0])
                raise AssertionError(f"{label}: {what} differs at {at}: got {a[at]}, want {b[at]}")


def to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def planner_kwargs(cfg: VllmStepConfig) -> dict:
    """VllmStepPlanner's arguments for a config."""
    return dict(
        max_num_reqs=cfg.max_num_reqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_sizes=list(cfg.block_sizes),
        widths=list(cfg.widths),
        slot_mapping_enabled=list(cfg.slot_mapping_enabled),
        dcp_sharded=list(cfg.dcp_sharded),
        sliding_window_reach=list(cfg.sliding_window_reach),
        cp_size=cfg.cp_size,
        cp_rank=cfg.cp_rank,
        cp_interleave=cfg.cp_interleave,
        slot_dtype=cfg.slot_dtype,
    )


def new_batch(rng: np.random.Generator, cfg: VllmStepConfig, state: dict, num_reqs: int, max_query: int = 1):
    """Another step over the same request state (num_computed_tokens, tables, num_blocks):
    a new permuted sparse idx_mapping with dummies and new query lengths that fit both the
    token capacity and every request's allocated blocks."""
    M, T = cfg.max_num_reqs, cfg.max_num_batched_tokens
    ids = rng.permutation(M)[:num_reqs].astype(np.int64)
    idx = np.where(rng.random(num_reqs) < 0.1, -1, ids)
    nct = state["num_computed_tokens"].astype(np.int64)
    room = np.full(num_reqs, max_query, np.int64)
    for g in range(cfg.num_groups):
        span = cfg.block_sizes[g] * (cfg.cp_size if cfg.sharded(g) else 1)
        cap = state["num_blocks"][g].astype(np.int64) * span - nct  # tokens the allocated blocks still hold
        room = np.minimum(room, np.where(idx >= 0, cap[np.maximum(idx, 0)], max_query))
    q = np.minimum(rng.integers(1, max_query + 1, num_reqs), np.maximum(room, 0))
    qsl = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    assert qsl[-1] <= T, "new_batch: more tokens than the capacity"
    out = dict(state)
    out.update(idx_mapping=idx.astype(state["idx_mapping"].dtype), query_start_loc=qsl.astype(I32))
    return out


def corrupt(rng: np.random.Generator, cfg: VllmStepConfig, inputs: dict, rate: float = 0.1) -> dict:
    """Bad values everywhere the step checks: rows out of range, a decreasing or
    too-large query_start_loc, negative num_computed_tokens, negative block ids,
    num_blocks outside [0, width]. Shapes stay valid (those are host errors)."""
    M, T = cfg.max_num_reqs, cfg.max_num_batched_tokens
    out = {k: ([a.copy() for a in v] if isinstance(v, list) else v.copy()) for k, v in inputs.items()}
    idx, qsl, nct = out["idx_mapping"], out["query_start_loc"], out["num_computed_tokens"]
    n = idx.shape[0]
    hit = rng.random(n) < rate
    idx[hit] = rng.integers(-3, M + 3, int(hit.sum()))
    hit = rng.random(n + 1) < rate
    qsl[hit] = rng.integers(-2, T + 10, int(hit.sum()))
    hit = rng.random(M) < rate
    nct[hit] = rng.integers(-5, 0, int(hit.sum()))
    for g in range(cfg.num_groups):
        t, nb = out["block_tables"][g], out["num_blocks"][g]
        hit = rng.random(t.shape) < rate
        t[hit] = rng.integers(-3, 0, int(hit.sum()))
        hit = rng.random(M) < rate
        nb[hit] = rng.integers(-2, cfg.widths[g] + 3, int(hit.sum()))
    return out
