"""The vLLM step's attention metadata: the worked example's values by hand, a
per-request loop oracle written independently of the vectorised reference, and the
bad-value rows (device bits and keys), shared by the CPU and GPU tests."""

from __future__ import annotations

import numpy as np

from kvaddr.engines import vllm_errors as E
from kvaddr.engines.vllm_config import VllmStepConfig

I32 = np.int32
INT32_MAX = 2**31 - 1
FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")

#: docs/vllm.md's worked example (B = 4, M = 4; gathered rows [[7,2,0,0], [1,3,8,0], 0, 0],
#: seq_lens [6, 11, 0, 0]) with N = 8, computed by hand: pages ceil(6/4) = 2 and
#: ceil(11/4) = 3; last pages (6-1)%4+1 = 2 and (11-1)%4+1 = 3.
WORKED = dict(
    qo_indptr=[0, 1, 3, 3, 3],
    kv_indptr=[[0, 2, 5, 5, 5]],
    kv_indices=[[7, 2, 1, 3, 8, -1, -1, -1]],
    kv_last_page_len=[[2, 3, 0, 0]],
    cu_seqlens_k=[[0, 6, 17, 17, 17]],
    max_seqlen_q=2,
    max_seqlen_k=[11],
)
#: The same with DCP (cp_size 2, I = 1): local lengths rank 0: [3, 6] (s = 6: 3 + 0;
#: s = 11: 5 + 1), rank 1: [3, 5]; pages ceil(L/4).
WORKED_DCP = {
    0: dict(
        kv_indptr=[[0, 1, 3, 3, 3]],
        kv_indices=[[7, 1, 3, -1, -1, -1, -1, -1]],
        kv_last_page_len=[[3, 2, 0, 0]],
        cu_seqlens_k=[[0, 3, 9, 9, 9]],
        max_seqlen_k=[6],
    ),
    1: dict(
        kv_indptr=[[0, 1, 3, 3, 3]],
        kv_indices=[[7, 1, 3, -1, -1, -1, -1, -1]],
        kv_last_page_len=[[3, 1, 0, 0]],
        cu_seqlens_k=[[0, 3, 8, 8, 8]],
        max_seqlen_k=[5],
    ),
}


def attention_loop(cfg: VllmStepConfig, inputs: dict, seq_lens, dcp_local_seq_lens, gathered, N: int) -> dict:
    """Request by request, group by group (valid or bad inputs): the metadata and, per
    bit, the smallest (token, request, group) key."""
    M, G = cfg.max_num_reqs, cfg.num_groups
    qsl = [int(x) for x in inputs["query_start_loc"]]
    n = len(qsl) - 1
    nct_all = [int(x) for x in inputs["num_computed_tokens"]]
    idx = [int(x) for x in inputs["idx_mapping"]]
    want = {"qo_indptr": qsl + [qsl[n]] * (M - n)}
    want["max_seqlen_q"] = max([min(max(qsl[b + 1] - qsl[b], 0), INT32_MAX) for b in range(n)], default=0)
    for k in ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen_k"):
        want[k] = []
    keys: dict = {}
    for g in range(G):
        B, W, R = cfg.block_sizes[g], cfg.widths[g], cfg.sliding_window_reach[g]
        Ls = [int(x) for x in (dcp_local_seq_lens if cfg.sharded(g) else seq_lens)]
        indptr, cuk, last, indices = [0], [0], [], []
        for b in range(M):
            L = Ls[b]
            P = (L + B - 1) // B
            indptr.append(min(indptr[-1] + P, INT32_MAX))
            cuk.append(min(cuk[-1] + L, INT32_MAX))
            last.append((L - 1) % B + 1 if L > 0 else 0)
            if P == 0:
                continue
            r = idx[b]  # a request with pages is a real one with good inputs
            nbc = min(max(int(inputs["num_blocks"][g][r]), 0), W)
            first = max(nct_all[r] - R, 0) // B if R > 0 else 0
            tok = max(qsl[b], 0)

            def rec(bit, tok=tok, b=b, g=g):
                keys[bit] = min(keys.get(bit, (tok, b, g)), (tok, b, g))

            if P > W:
                rec(E.VERR_BLOCK_INDEX)
            elif nbc < P:
                rec(E.VERR_PAST_NUM_BLOCKS)
            start = indptr[-2]
            if start <= N < start + P:
                rec(E.VERR_KV_INDICES_CAPACITY)
            for j in range(P):
                if start + j >= N:
                    break
                if j >= W:
                    v = -1
                elif first <= j < nbc:
                    v = int(inputs["block_tables"][g][r, j])
                    if v < 0:
                        rec(E.VERR_NEGATIVE_BLOCK)
                        v = -1
                else:
                    v = 0
                if j < W and v >= 0:  # the gathered row's entry
                    assert v == int(gathered[g][b, j]), (g, b, j)
                indices.append(v)
        want["kv_indptr"].append(indptr)
        want["kv_indices"].append(indices[:N] + [-1] * (N - min(len(indices), N)))
        want["kv_last_page_len"].append(last)
        want["cu_seqlens_k"].append(cuk)
        want["max_seqlen_k"].append(max(Ls))
    want["keys"] = keys
    return want


def assert_attention(got, want: dict, groups=("flashinfer", "varlen"), label: str = "") -> None:
    """Compare VllmAttentionOutputs (NumPy / CuPy) with a dict of lists (by field)."""
    from tests.support.vllm_cases import to_numpy

    names = ["qo_indptr"]
    if "flashinfer" in groups:
        names += ["kv_indptr", "kv_indices", "kv_last_page_len"]
    if "varlen" in groups:
        names += ["cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    for name in names:
        if name not in want:
            continue
        a = to_numpy(getattr(got, name))
        w = np.asarray(want[name], dtype=np.int32)
        assert a.dtype == np.int32, f"{label}: {name} dtype {a.dtype}"
        assert a.shape == w.shape, f"{label}: {name} shape {a.shape} != {w.shape}"
        if not np.array_equal(a, w):
            at = tuple(np.argwhere(a != w)[0]) if a.ndim else ()
            raise AssertionError(f"{label}: {name} differs at {at}: got {a[at]}, want {w[at]}")


def _worked(**over):
    from tests.support.vllm_cases import worked_example

    cfg, x = worked_example(**over.pop("cfg", {}))
    x.update(over)
    return cfg, x


#: (id, make() -> (cfg, inputs), N, mask, first key (token, request, group, bit), check of outputs)
DEVICE_ROWS = [
    # N = 4 < 5 entries: request 1 (entries [2, 5)) crosses the capacity
    ("capacity", lambda: _worked(), 4, E.VERR_KV_INDICES_CAPACITY, (1, 1, 0, E.VERR_KV_INDICES_CAPACITY)),
    # row 0 holds 3 blocks but num_blocks says 2: request 1's third page is past num_blocks
    (
        "past-num-blocks",
        lambda: _worked(num_blocks=[np.array([2, 0, 2, 0], I32)]),
        8,
        E.VERR_PAST_NUM_BLOCKS,
        (1, 1, 0, E.VERR_PAST_NUM_BLOCKS),
    ),
    # width 2: 3 pages do not fit the row (the slot mapping's bit 1 names token 2, later)
    (
        "pages-beyond-width",
        lambda: _worked(
            cfg=dict(widths=[2]),
            block_tables=[np.array([[1, 3], [0, 0], [7, 2], [0, 0]], I32)],
            num_blocks=[np.array([2, 0, 2, 0], I32)],
        ),
        8,
        E.VERR_BLOCK_INDEX,
        (1, 1, 0, E.VERR_BLOCK_INDEX),
    ),
    # a negative id inside num_blocks (row 2's second block): -1 in kv_indices, bit 2
    (
        "negative-block",
        lambda: _worked(
            block_tables=[np.array([[1, 3, 8, -1], [0, 0, 0, 0], [7, -5, -1, -1], [0, 0, 0, 0]], I32)],
            query_start_loc=np.array([0, 1, 3], I32),
        ),
        8,
        E.VERR_NEGATIVE_BLOCK,
        (0, 0, 0, E.VERR_NEGATIVE_BLOCK),
    ),
]
