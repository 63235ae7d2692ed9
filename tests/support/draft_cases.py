"""Random verify steps for the draft-addressing kernel's tests (CPU emulation and GPU): inputs as
NumPy arrays, the planner's keyword arguments, the reference's, and a comparison of every output."""

from __future__ import annotations

import numpy as np

from kvaddr.engines.spec_reference import vllm_draft_reference


def draft_case(
    rng: np.random.Generator,
    *,
    num_reqs: int,
    max_num_reqs: int | None = None,
    k: int = 3,
    block_sizes=(4,),
    max_model_len: int = 64,
    max_tokens: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    prefill_share: float = 0.2,
    dummy_share: float = 0.1,
    near_end_share: float = 0.2,
    idx64: bool = False,
    mask_rejected: bool = True,
    attention=None,
    slot_mapping_enabled=True,
    dcp_sharded=True,
) -> dict:
    """A verify step with k drafts per decode request, random acceptance 0..k, chunked-prefill rows
    (num_rejected = num_sampled = 0), dummy rows and requests near ``max_model_len``; every table
    holds the blocks the scheduler allocates (``min(seq_lens + k, max_model_len)`` positions)."""
    M = max_num_reqs or max(num_reqs, 1)
    G = len(block_sizes)
    qlens, seqs, rej, smp = [], [], [], []
    for _ in range(num_reqs):
        if rng.random() < prefill_share:
            q = int(rng.integers(1, 6))
            s = int(rng.integers(q, max_model_len + 1))
            r, a = 0, int(rng.integers(0, 2))  # a chunk, or a prefill's last chunk (samples one token)
        else:
            q = k + 1
            if rng.random() < near_end_share:
                s = int(rng.integers(max(q, max_model_len - k - 1), max_model_len + 1))
            else:
                s = int(rng.integers(q, max_model_len + 1))
            acc = int(rng.integers(0, k + 1))
            r, a = k - acc, acc + 1
        qlens.append(q)
        seqs.append(s)
        rej.append(r)
        smp.append(a)
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(qlens)
    T = max_tokens or max(int(qsl[-1]) + int(rng.integers(0, 8)), 1)
    rows = rng.permutation(M)[:num_reqs].astype(np.int64)
    dummy = rng.random(num_reqs) < dummy_share
    rows[dummy] = -1
    span = cp_size if cp_size > 1 else 1
    widths = [-(-max_model_len // (B * span)) + int(rng.integers(0, 3)) for B in block_sizes]
    tables, nbs = [], []
    next_id = 1
    for g, B in enumerate(block_sizes):
        t = np.full((M, widths[g]), -1, dtype=np.int32)
        nb = np.zeros(M, dtype=np.int32)
        for b in range(num_reqs):
            if rows[b] < 0:
                continue
            need = -(-min(seqs[b] + k, max_model_len) // (B * span))
            t[rows[b], :need] = np.arange(next_id, next_id + need, dtype=np.int32)[rng.permutation(need)]
            next_id += need
            nb[rows[b]] = need
        tables.append(t)
        nbs.append(nb)
    vsm = rng.integers(0, 1 << 40, size=(G, T)).astype(np.int64)
    x = dict(
        idx_mapping=rows.astype(np.int64 if idx64 else np.int32),
        query_start_loc=qsl,
        seq_lens=np.array(seqs, dtype=np.int32).reshape(num_reqs),
        num_rejected=np.array(rej, dtype=np.int32).reshape(num_reqs),
        num_sampled=np.array(smp, dtype=np.int32).reshape(num_reqs),
        block_tables=tables,
        num_blocks=nbs,
        verify_slot_mappings=vsm,
    )
    N = None
    if attention and "flashinfer" in attention:
        N = max(sum(-(-min(s + k, max_model_len) // B) for s in seqs) for B in block_sizes) + 8
    settings = dict(
        max_num_reqs=M,
        max_num_batched_tokens=T,
        num_speculative_steps=k,
        block_sizes=list(block_sizes),
        widths=widths,
        max_model_len=max_model_len,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        mask_rejected=mask_rejected,
        attention=attention,
        kv_indices_capacity=N,
        slot_mapping_enabled=slot_mapping_enabled,
        dcp_sharded=dcp_sharded,
    )
    return dict(inputs=x, settings=settings)


def _flags(v, G):
    return list(v) if isinstance(v, (list, tuple)) else [v] * G


def reference(case: dict):
    """The reference's result for a case (its inputs as they are now)."""
    x, s = case["inputs"], case["settings"]
    G = len(s["block_sizes"])
    return vllm_draft_reference(
        x["idx_mapping"],
        x["query_start_loc"],
        x["seq_lens"],
        x["num_rejected"],
        x["num_sampled"],
        x["block_tables"],
        s["block_sizes"],
        x["verify_slot_mappings"],
        s["max_model_len"],
        s["num_speculative_steps"],
        num_blocks=x["num_blocks"],
        max_num_reqs=s["max_num_reqs"],
        mask_rejected=s["mask_rejected"],
        slot_mapping_enabled=_flags(s["slot_mapping_enabled"], G),
        dcp_sharded=_flags(s["dcp_sharded"], G),
        cp_size=s["cp_size"],
        cp_rank=s["cp_rank"],
        cp_interleave=s["cp_interleave"],
        attention=s["attention"],
        kv_indices_capacity=s["kv_indices_capacity"],
    )


def planner_kwargs(case: dict) -> dict:
    s = dict(case["settings"])
    return s


def compare(got: dict, want, label: str = "") -> None:
    """Every output of the planner (``got``: field -> NumPy array or None) equals the reference's."""
    pairs = {
        "last_token_indices": want.last_token_indices,
        "positions": want.positions,
        "seq_lens": want.seq_lens,
        "dcp_local_seq_lens": want.dcp_local_seq_lens,
        "query_start_loc": want.query_start_loc,
        "slot_mappings": want.slot_mappings,
        "kv_indptr": want.kv_indptr,
        "kv_indices": want.kv_indices,
        "kv_last_page_len": want.kv_last_page_len,
        "cu_seqlens_k": want.cu_seqlens_k,
        "max_seqlen_k": want.max_seqlen_k,
    }
    for name, w in pairs.items():
        g = got.get(name)
        if w is None:
            assert g is None, f"{label}: {name} written but not asked for"
            continue
        assert g is not None, f"{label}: {name} missing"
        assert g.shape == w.shape, f"{label}: {name} shape {g.shape} != {w.shape}"
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{label}: {name} differs at {bad[:5].tolist()}: {g[tuple(bad[0])]} != {w[tuple(bad[0])]}"
    if got.get("first_slot_mappings") is not None:
        g, w = got["first_slot_mappings"], want.first_slot_mappings
        T = w.shape[1]
        assert np.array_equal(g[:, :T], w), f"{label}: first_slot_mappings differ"
        assert (g[:, T:] == -1).all(), f"{label}: first_slot_mappings past the verify columns"


def corrupt(case: dict, rng: np.random.Generator) -> str:
    """Put one bad value into a case's inputs (in place); returns what was done."""
    x = case["inputs"]
    n = x["idx_mapping"].shape[0]
    if n == 0:
        return "none"
    b = int(rng.integers(0, n))
    what = rng.choice(["row", "rejected", "sampled", "negative", "num_blocks", "qsl", "seq"])
    if what == "row":
        x["idx_mapping"][b] = case["settings"]["max_num_reqs"] + 3 if rng.random() < 0.5 else -5
    elif what == "rejected":
        x["num_rejected"][b] = int(x["query_start_loc"][b + 1] - x["query_start_loc"][b]) + int(rng.integers(0, 3))
    elif what == "sampled":
        x["num_sampled"][b] = -1
    elif what == "negative":
        g = int(rng.integers(0, len(x["block_tables"])))
        r = x["idx_mapping"][b]
        if r >= 0:
            x["block_tables"][g][r, :] = -7
    elif what == "num_blocks":
        g = int(rng.integers(0, len(x["num_blocks"])))
        r = x["idx_mapping"][b]
        if r >= 0:
            x["num_blocks"][g][r] = max(int(x["num_blocks"][g][r]) - 1 - int(rng.integers(0, 3)), 0)
    elif what == "qsl":
        x["query_start_loc"][b + 1] = x["query_start_loc"][b] - 1
    else:
        x["seq_lens"][b] = 0
    return str(what)
