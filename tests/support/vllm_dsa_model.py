"""A Python model of the vLLM step's DSA blocks (kvaddr/kernels/vllm_dsa.cuh's vllm_dsa_block):
the batch vote (a request running more than decode_len tokens), each block's candidates (its
tokens' owners by the token blocks' search) and its own vote, the tiles of VLLM_THREADS *
VLLM_DSA_R requests, each thread's VLLM_DSA_R consecutive requests, the block scan of the thread
sums (saturating), the carries from tile to tile, each candidate's ks read from its owner's tile
and block 0's cu_seq_lens. tests/unit/test_vllm_dsa.py checks it against the reference; the CPU
emulator runs the helpers themselves, and the GPU the block."""

from __future__ import annotations

import numpy as np

from kvaddr.engines.vllm_reference import owner_search

THREADS = 256
R = 8
INT_MAX = 2**31 - 1


def sat(a: int, b: int) -> int:
    return min(a + b, INT_MAX)


def model_cu_and_ks(idx, qsl, nct, M: int, T: int, decode_len: int):
    """``(cu_seq_lens [M + 1], ks [T])`` as the DSA blocks write them (ks -1 where they write none:
    the token blocks write a decode token's, an invalid one's, and every token's of a decode step)."""
    n = idx.shape[0]
    qsl = qsl.astype(np.int64)
    r = idx.astype(np.int64)
    cu = np.zeros(M + 1, np.int64)
    ks = np.full(T, -1, np.int64)
    if not (np.diff(qsl) > decode_len).any():  # the vote: a decode step
        return cu.astype(np.int32), ks

    def prefill_len(b):
        q0, q1, rr = int(qsl[b]), int(qsl[b + 1]), int(r[b])
        if rr < 0 or rr >= M or q0 < 0 or q1 < q0:
            return -1
        c = int(nct[rr])
        if c < 0 or q1 - q0 <= decode_len:
            return -1
        return min(c + q1 - q0, INT_MAX)

    # each token's owner as vllm_dsa_owner finds it, and whether it is a candidate
    num_tokens = int(np.clip(qsl[-1], 0, T)) if n else 0
    t = np.arange(T, dtype=np.int64)
    owner = np.zeros(T, np.int64)
    cand = np.zeros(T, bool)
    if n:
        owner[:num_tokens] = owner_search(qsl, t[:num_tokens], n)
        b = owner[:num_tokens]
        q0, q1 = qsl[b], qsl[b + 1]
        cand[:num_tokens] = (q0 >= 0) & (q0 <= t[:num_tokens]) & (t[:num_tokens] < q1) & (q1 - q0 > decode_len)
    # the blocks that go on: block 0 (cu_seq_lens) and those with a candidate
    blocks = np.zeros(-(-T // THREADS), bool)
    blocks[0] = True
    blocks[np.unique(t[cand] // THREADS)] = True
    cand &= blocks[t // THREADS]
    carry_len, carry_cnt = 0, 0
    for base in range(0, n, THREADS * R):
        lens = [
            [prefill_len(base + i * R + u) if base + i * R + u < n else -1 for u in range(R)] for i in range(THREADS)
        ]
        sums = [(min(sum(x for x in L if x >= 0), INT_MAX), sum(x >= 0 for x in L)) for L in lens]
        tile_ks = np.full(THREADS * R, -1, np.int64)
        run_len, run_cnt = carry_len, carry_cnt  # exclusive prefix of thread i
        for i in range(THREADS):
            rl, rc = run_len, run_cnt
            for u in range(R):
                if lens[i][u] >= 0:
                    tile_ks[i * R + u] = rl
                    if rc <= M:
                        cu[rc] = rl
                    rl = sat(rl, lens[i][u])
                    rc += 1
            run_len, run_cnt = sat(run_len, sums[i][0]), run_cnt + sums[i][1]
        inside = cand & (owner >= base) & (owner < base + THREADS * R)
        ks[inside] = tile_ks[owner[inside] - base]
        carry_len, carry_cnt = run_len, run_cnt
    cu[carry_cnt:] = carry_len
    return cu.astype(np.int32), ks
