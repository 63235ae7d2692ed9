"""A toy speculative-decoding loop over a paged KV cache, for the draft addressing's end-to-end
tests (NumPy on the CPU through the kernel emulator; torch on the GPU through the real kernel).

Each cycle: a verify step (a prompt's last prefill chunk, or one bonus token plus k drafts per
request) whose target model writes its K/V through the verify slots; random acceptance 0..k;
``VllmDraftPlanner`` (one launch) gives the draft model's addressing; the first draft forward
writes its K/V through ``first_slot_mappings`` (rejected tokens at -1), then every draft step j
writes one token's K/V through its slots and reads the paged cache back through its FlashInfer
metadata (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) and its varlen ``cu_seqlens_k``:
attention over what was read equals attention over the request's contiguous history. Every write
is checked to land in a block the request owns (``num_blocks`` of its row, allocated as a
scheduler does: ``min(seq_lens + k, max_model_len)`` positions). Requests reach
``max_model_len`` (the clamps), finish, and new ones take their rows.
"""

from __future__ import annotations

import numpy as np


class NumpyOps:
    """The loop's array operations on NumPy arrays."""

    def asarray(self, a):
        return np.asarray(a)

    def host(self, a):
        return np.asarray(a)

    def cache(self, blocks, B, D):
        return np.full((blocks * B, D), np.nan, dtype=np.float64)

    def write(self, cache, slots, vals):
        cache[slots] = vals

    def gather(self, cache, slots):
        return cache[slots]

    def attention(self, q, K, V):
        s = K @ q / np.sqrt(q.shape[0])
        w = np.exp(s - s.max())
        return (w / w.sum()) @ V

    def close(self, a, b):
        return bool(np.allclose(a, b, rtol=1e-12, atol=1e-12))


def run_loop(planner_factory, ops, *, seed=0, rows=9, k=3, B=4, M=37, D=8, cycles=12, to_device=None):
    """Run ``cycles`` verify+drafts cycles; ``planner_factory(settings)`` builds the planner and
    ``to_device(x)`` moves a NumPy input to where the planner reads it. Returns the number of
    draft-step attention checks made."""
    rng = np.random.default_rng(seed)
    width = -(-M // B)
    pool_blocks = rows * width + 3
    free = list(rng.permutation(pool_blocks))
    table = np.full((rows, width), -1, dtype=np.int32)
    nblocks = np.zeros(rows, dtype=np.int32)
    owner = np.full(pool_blocks, -1)
    tcache, dcache = ops.cache(pool_blocks, B, D), ops.cache(pool_blocks, B, D)
    hist = {}  # row -> (M, D) the draft's contiguous K and V history
    computed = np.zeros(rows, dtype=np.int64)
    prompt = np.zeros(rows, dtype=np.int64)  # > 0: the row's next verify step is its prompt's prefill
    T = rows * max(k + 1, M)
    N = rows * width + 8
    planner = planner_factory(
        dict(
            max_num_reqs=rows + 2,
            max_num_batched_tokens=T,
            num_speculative_steps=k,
            block_sizes=[B],
            widths=[width],
            max_model_len=M,
            mask_rejected=True,
            attention="flashinfer,varlen",
            kv_indices_capacity=N,
        )
    )

    def start(r):
        for blk in table[r, : nblocks[r]]:
            owner[blk] = -1
            free.append(int(blk))
        table[r] = -1
        nblocks[r] = 0
        computed[r] = 0
        prompt[r] = int(rng.integers(1, M - k - 1))
        hist[r] = (np.full((M, D), np.nan), np.full((M, D), np.nan))

    def allocate(r, upto):
        need = -(-upto // B)
        while nblocks[r] < need:
            blk = free.pop()
            table[r, nblocks[r]] = blk
            owner[blk] = r
            nblocks[r] += 1

    def slot_of(r, p):
        return int(table[r, p // B]) * B + p % B

    def check_owned(r, slots):
        for s in np.asarray(slots).tolist():
            assert s >= 0 and owner[s // B] == r, f"row {r}: a write to slot {s} outside its blocks"

    for r in range(rows):
        start(r)
    checks = 0
    for _cycle in range(cycles):
        live = [r for r in range(rows) if computed[r] + k + 1 <= M or prompt[r]]
        for r in range(rows):
            if r not in live:
                start(r)
                live.append(r)
        order = [int(r) for r in rng.permutation(live)]
        idx, qlens, seqs, rej, smp, vslots = [], [], [], [], [], []
        for r in order:
            if prompt[r]:
                q, c = int(prompt[r]), 0
                nrej, nsmp = 0, 1
            else:
                q, c = k + 1, int(computed[r])
                a = int(rng.integers(0, k + 1))
                nrej, nsmp = k - a, a + 1
            allocate(r, min(c + q + k, M))
            positions = np.arange(c, c + q)
            slots = [slot_of(r, int(p)) for p in positions]
            check_owned(r, slots)
            vals = rng.standard_normal((q, D))
            ops.write(tcache, ops.asarray(slots), ops.asarray(vals))  # the target model's K/V
            idx.append(r)
            qlens.append(q)
            seqs.append(c + q)
            rej.append(nrej)
            smp.append(nsmp)
            vslots.extend(slots)
        idx.append(-1)  # a dummy (graph padding) request
        qlens.append(1)
        seqs.append(0)
        rej.append(0)
        smp.append(0)
        vslots.append(-1)
        qsl = np.concatenate(([0], np.cumsum(qlens))).astype(np.int32)
        seqs_a = np.array(seqs, dtype=np.int32)
        seqs_a[-1] = 1
        vsm = np.full((1, T), -1, dtype=np.int64)
        vsm[0, : len(vslots)] = vslots
        dev = to_device or (lambda x: x)
        out = planner.compute(
            dev(np.array(idx, dtype=np.int32)),
            dev(qsl),
            dev(seqs_a),
            dev(np.array(rej, dtype=np.int32)),
            dev(np.array(smp, dtype=np.int32)),
            [dev(table)],
            [dev(nblocks)],
            dev(vsm),
        )
        assert planner.errors()[0] == 0
        o = {name: (None if v is None else ops.host(v)) for name, v in out.as_dict().items()}
        # the first draft forward: the accepted tokens' K/V through first_slot_mappings
        for b, r in enumerate(order):
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            c = seqs[b] - qlens[b]
            L = qlens[b] - rej[b]
            assert int(o["last_token_indices"][b]) == lo + L - 1
            fs = o["first_slot_mappings"][0, lo:hi]
            assert (fs[L:] == -1).all()
            check_owned(r, fs[:L])
            kv = rng.standard_normal((2, L, D))
            ops.write(dcache, ops.asarray(fs[:L]), ops.asarray(kv[0]))
            ops.write(tcache, ops.asarray(fs[:L]), ops.asarray(kv[1]))  # (the draft's V: the target cache stands in)
            hist[r][0][c : c + L] = kv[0]
            hist[r][1][c : c + L] = kv[1]
        # draft steps 1..k-1
        for j in range(1, k):
            for b, r in enumerate(order):
                pos = int(o["positions"][j - 1, b])
                L = int(o["seq_lens"][j - 1, b])
                want_pos, want_len = min(seqs[b] - rej[b] - 1 + j, M - 1), min(seqs[b] - rej[b] + j, M)
                assert (pos, L) == (want_pos, want_len)
                s = int(o["slot_mappings"][j - 1, 0, b])
                assert s == slot_of(r, pos)
                check_owned(r, [s])
                kv = rng.standard_normal((2, 1, D))
                ops.write(dcache, ops.asarray([s]), ops.asarray(kv[0]))
                ops.write(tcache, ops.asarray([s]), ops.asarray(kv[1]))
                hist[r][0][pos] = kv[0][0]
                hist[r][1][pos] = kv[1][0]
            for b, r in enumerate(order):
                L = int(o["seq_lens"][j - 1, b])
                ip = o["kv_indptr"][j - 1, 0]
                pages = o["kv_indices"][j - 1, 0, ip[b] : ip[b + 1]]
                last = int(o["kv_last_page_len"][j - 1, 0, b])
                slots = (pages[:, None].astype(np.int64) * B + np.arange(B)).reshape(-1)[: (len(pages) - 1) * B + last]
                assert len(slots) == L
                cu = o["cu_seqlens_k"][j - 1, 0]
                assert int(cu[b + 1] - cu[b]) == L
                q = rng.standard_normal(D)
                K = ops.gather(dcache, ops.asarray(slots))
                V = ops.gather(tcache, ops.asarray(slots))
                got = ops.attention(ops.asarray(q), K, V)
                want = NumpyOps().attention(q, hist[r][0][:L], hist[r][1][:L])
                assert ops.close(ops.host(got), want), f"row {r}, draft step {j}"
                checks += 1
            b = len(order)  # the dummy row
            assert int(o["slot_mappings"][j - 1, 0, b]) == -1 and int(o["seq_lens"][j - 1, b]) == 0
        for b, r in enumerate(order):
            computed[r] = seqs[b] - rej[b]
            prompt[r] = 0
    return checks
