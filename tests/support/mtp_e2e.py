"""A toy MTP draft loop end to end through kvaddr's outputs (docs/spec-decode.md).

Each cycle the target model verifies 1 + k tokens per running request (positions ``L_b ..
L_b + k``) and writes their K/V into its paged caches through the verify step's
``slot_mapping``; a random number a_b in 0..k of the drafts is accepted, so the draft model's
substep 0 runs ``accept_num = a_b + 1`` tokens over ``seq_lens_decoder = L_b`` and substeps
1..k-1 one token each. Rows that are idle (or still in a chunked prefill) run no tokens
(``accept_num = 0``). Every draft substep writes its K/V through its own ``slot_mapping`` into the
draft model's caches, then every request with tokens reads the draft cache back through that
substep's metadata (``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``, and ``page_table`` /
``seqused_k``) and attention over what was read equals attention over the contiguous K/V kept on
the host (causal by position). Every slot a draft substep writes lies in a block allocated to
its request (the slot is the request's block at ``pos // B``, and that block is allocated), and
the verify step's attention is checked the same way through the target caches.

``verify(dec, q, tables)`` returns a step's outputs (with attention: "flashinfer" and
"page_table"); ``draft(dec, accept_num, tables)`` returns a sequence of k such outputs, one per
substep (host NumPy or device arrays: the backend converts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tests.support.paged_attention import NumpyBackend

I32 = np.int32


@dataclass
class MtpReport:
    checks: int = 0
    writes: int = 0
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checks > 0 and self.writes > 0 and not self.failures


def _read_and_compare(backend, cache_k, cache_v, meta, g, b, B, q, q_pos, truth_k, truth_v, report, label):
    """Attention of queries ``q`` (positions ``q_pos``) of request b over cache g read through the
    FlashInfer arrays and through the page table, against the contiguous truth."""
    L = int(meta["seqused_k"][b])
    want = backend.attention(q, truth_k[:L], truth_v[:L], q_pos, np.arange(L))
    lo, hi = int(meta["kv_indptr"][g][b]), int(meta["kv_indptr"][g][b + 1])
    last = int(meta["kv_last_page_len"][g][b])
    n = (hi - lo - 1) * B + last if hi > lo else 0
    reads = {}
    if n != L:
        report.failures.append(f"{label}: flashinfer length {n} != {L}")
    else:
        pages = meta["kv_indices"][g][lo:hi]
        reads["flashinfer"] = (backend.gather_pages(cache_k, pages, L), backend.gather_pages(cache_v, pages, L))
    row = meta["page_table"][g][b][: -(-L // B)]
    reads["page_table"] = (backend.gather_pages(cache_k, row, L), backend.gather_pages(cache_v, row, L))
    for path, (k, v) in reads.items():
        got = backend.attention(q, k, v, q_pos, np.arange(L))
        report.checks += 1
        if not backend.close(got, want):
            report.failures.append(f"{label}: attention through {path} differs")


def run_mtp_e2e(
    verify,
    draft,
    *,
    k: int = 3,
    num_requests: int = 7,
    cycles: int = 6,
    block_sizes=(4, 3),
    heads: int = 2,
    dim: int = 8,
    seed: int = 0,
    backend=None,
) -> MtpReport:
    backend = backend or NumpyBackend()
    rng = np.random.default_rng(seed)
    R, H, D, G = num_requests, heads, dim, len(block_sizes)
    max_ctx = 8 + cycles * (k + 1) + 2 * k + 2
    width = [-(-max_ctx // B) for B in block_sizes]
    num_blocks = [R * W + 5 for W in width]
    pools = [list(rng.permutation(n)) for n in num_blocks]
    tables = [np.full((R, W), -1, I32) for W in width]
    owner = [np.full(n, -1, np.int64) for n in num_blocks]  # the request each block was allocated to

    def allocate(b, L):
        for g, B in enumerate(block_sizes):
            for j in range(-(-L // B)):
                if tables[g][b, j] < 0:
                    blk = pools[g].pop()
                    tables[g][b, j] = blk
                    owner[g][blk] = b

    def cache():
        return [backend.new_cache(n, B, H, D) for n, B in zip(num_blocks, block_sizes)]

    tk, tv, dk, dv = cache(), cache(), cache(), cache()  # target and draft caches, K and V
    truth = {name: np.zeros((R, max_ctx, H, D), np.float32) for name in ("tk", "tv", "dk", "dv")}
    length = rng.integers(1, 8, R).astype(np.int64)  # tokens in both models' caches (a prefix)
    for b in range(R):  # the prompt's K/V, written directly (both models)
        allocate(b, int(length[b]))
        for name, caches in (("tk", tk), ("tv", tv), ("dk", dk), ("dv", dv)):
            x = rng.standard_normal((int(length[b]), H, D), dtype=np.float32)
            truth[name][b, : length[b]] = x
            for g, B in enumerate(block_sizes):
                pos = np.arange(length[b])
                slots = tables[g][b, pos // B].astype(np.int64) * B + pos % B
                backend.write(caches[g], backend.asarray(slots), backend.asarray(x))
    report = MtpReport()

    def host_meta(out):
        a = out.attention
        return dict(
            kv_indptr=backend.host(a.kv_indptr),
            kv_indices=[backend.host(x) for x in a.kv_indices],
            kv_last_page_len=backend.host(a.kv_last_page_len),
            seqused_k=backend.host(out.seq_lens_kv),
            page_table=[backend.host(t) for t in a.page_table],
        )

    for c in range(cycles):
        running = rng.random(R) < 0.8
        for b in range(R):
            allocate(b, int(length[b]) + 2 * k + 2)  # the scheduler's room for verify and drafts
        # -- verify: 1 + k tokens per running request --
        dec = length.astype(I32)
        q = np.where(running, 1 + k, 0).astype(I32)
        out = verify(dec, q, [t.copy() for t in tables])
        T = int(q.sum())
        kx = rng.standard_normal((T, H, D), dtype=np.float32)
        vx = rng.standard_normal((T, H, D), dtype=np.float32)
        qx = rng.standard_normal((T, H, D), dtype=np.float32)
        slots = backend.host(out.slot_mapping)
        for g in range(G):
            backend.write(tk[g], backend.asarray(slots[g][:T]), backend.asarray(kx))
            backend.write(tv[g], backend.asarray(slots[g][:T]), backend.asarray(vx))
        cu = np.concatenate([[0], np.cumsum(q)])
        for b in range(R):
            truth["tk"][b, dec[b] : dec[b] + q[b]] = kx[cu[b] : cu[b + 1]]
            truth["tv"][b, dec[b] : dec[b] + q[b]] = vx[cu[b] : cu[b + 1]]
        meta = host_meta(out)
        for b in np.flatnonzero(q):
            qpos = np.arange(dec[b], dec[b] + q[b])
            for g, B in enumerate(block_sizes):
                _read_and_compare(
                    backend,
                    tk[g],
                    tv[g],
                    meta,
                    g,
                    b,
                    B,
                    qx[cu[b] : cu[b + 1]],
                    qpos,
                    truth["tk"][b],
                    truth["tv"][b],
                    report,
                    f"cycle {c} verify req {b} cache {g}",
                )
        # -- acceptance, then the draft substeps --
        a = rng.integers(0, k + 1, R)
        accept = np.where(running, a + 1, 0).astype(I32)
        outs = draft(dec, accept, [t.copy() for t in tables])
        for j in range(k):
            o = outs[j]
            n_tok = int(backend.host(o.num_tokens))
            batch = backend.host(o.batch_id_per_token)[:n_tok]
            pos = backend.host(o.position_ids)[:n_tok].astype(np.int64)
            slots = backend.host(o.slot_mapping)
            want_tok = int(accept.sum()) if j == 0 else int((accept > 0).sum())
            if n_tok != want_tok:
                report.failures.append(f"cycle {c} substep {j}: {n_tok} tokens, want {want_tok}")
                continue
            kx = rng.standard_normal((n_tok, H, D), dtype=np.float32)
            vx = rng.standard_normal((n_tok, H, D), dtype=np.float32)
            qx = rng.standard_normal((n_tok, H, D), dtype=np.float32)
            for g, B in enumerate(block_sizes):
                s = slots[g][:n_tok]
                blk = s // B
                bad = (s < 0) | (owner[g][np.clip(blk, 0, num_blocks[g] - 1)] != batch) | (blk >= num_blocks[g])
                bad |= s != tables[g][batch, pos // B].astype(np.int64) * B + pos % B
                if bad.any():
                    t = int(np.flatnonzero(bad)[0])
                    report.failures.append(f"cycle {c} substep {j} cache {g}: token {t} slot {s[t]} outside its blocks")
                    continue
                report.writes += n_tok
                backend.write(dk[g], backend.asarray(s), backend.asarray(kx))
                backend.write(dv[g], backend.asarray(s), backend.asarray(vx))
            truth["dk"][batch, pos] = kx
            truth["dv"][batch, pos] = vx
            meta = host_meta(o)
            for b in np.unique(batch):
                sel = batch == b
                for g, B in enumerate(block_sizes):
                    _read_and_compare(
                        backend,
                        dk[g],
                        dv[g],
                        meta,
                        g,
                        b,
                        B,
                        qx[sel],
                        pos[sel],
                        truth["dk"][b],
                        truth["dv"][b],
                        report,
                        f"cycle {c} substep {j} req {b} cache {g}",
                    )
        length = length + accept
    return report
