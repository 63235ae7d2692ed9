"""Batches for the vLLM step's DSA outputs (tests/unit/test_vllm_dsa.py, tests/gpu/test_vllm_dsa_gpu.py):
decodes of n query tokens and prefill chunks in random batch order, dummy rows among them."""

from __future__ import annotations

import numpy as np

from kvaddr.engines.vllm_config import VllmStepConfig

I32 = np.int32


def dsa_batch(
    rng: np.random.Generator,
    cfg: VllmStepConfig,
    state: dict,
    num_reqs: int,
    *,
    n: int = 1,
    prefill: float = 0.2,
    max_chunk: int = 40,
    dummy: float = 0.1,
    queries=None,
) -> dict:
    """A step over ``state`` (tests.support.vllm_cases.random_case's): ``num_reqs`` requests of
    random rows, a ``dummy`` share of them dummy (-1), a ``prefill`` share running a chunk of
    ``n + 1`` to ``max_chunk`` tokens, the others n tokens (a decode), each within its allocated
    blocks and the whole within the token capacity. ``queries``: the requests' query lengths
    instead (``num_reqs`` of them), capped the same way."""
    M, T = cfg.max_num_reqs, cfg.max_num_batched_tokens
    ids = rng.permutation(M)[:num_reqs].astype(np.int64)
    idx = np.where(rng.random(num_reqs) < dummy, -1, ids)
    nct = state["num_computed_tokens"].astype(np.int64)
    q = np.where(rng.random(num_reqs) < prefill, rng.integers(n + 1, max(max_chunk, n + 1) + 1, num_reqs), n)
    if queries is not None:
        q = np.asarray(queries, np.int64)
    for g in range(cfg.num_groups):
        span = cfg.block_sizes[g] * (cfg.cp_size if cfg.sharded(g) else 1)
        cap = state["num_blocks"][g].astype(np.int64) * span - nct
        q = np.minimum(q, np.where(idx >= 0, cap[np.maximum(idx, 0)], q))
    q = np.maximum(q, 0)
    qsl = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    over = qsl > T
    if over.any():  # the rest runs no tokens
        qsl[over] = T
    out = dict(state)
    out.update(idx_mapping=idx.astype(state["idx_mapping"].dtype), query_start_loc=qsl.astype(I32))
    return out


EDGES = ("decodes", "prefills", "prefill_at_end", "prefill_first", "dummy_prefills", "few_tokens", "empty")


def edge_batch(rng: np.random.Generator, cfg: VllmStepConfig, state: dict, kind: str, num_reqs: int, *, n: int = 1):
    """One of the batches whose shape selects a path of the DSA blocks (``EDGES``): only decodes
    of n tokens (the vote finds no prefill), only prefills, decodes with one prefill last or first,
    prefill-long requests that are all dummies (the vote fires, no request is a prefill), two
    requests in a large token capacity (padding tokens past num_tokens), no request."""
    q = np.full(num_reqs, n, np.int64)
    chunk = rng.integers(n + 1, n + 30, num_reqs)
    dummy = 0.1
    if kind == "prefills":
        q = chunk
    elif kind == "prefill_at_end" and num_reqs:
        q[-1] = chunk[-1]
    elif kind == "prefill_first" and num_reqs:
        q[0] = chunk[0]
    elif kind == "dummy_prefills":
        q, dummy = chunk, 1.0
    elif kind == "few_tokens":
        num_reqs = min(num_reqs, 2)
        q = chunk[:num_reqs]
    elif kind == "empty":
        num_reqs, q = 0, q[:0]
    else:
        assert kind == "decodes", kind
    return dsa_batch(rng, cfg, state, num_reqs, n=n, dummy=dummy, queries=q)
