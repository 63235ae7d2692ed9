"""Benchmark of speculative decoding's draft addressing: one launch per verify+drafts cycle.

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_spec.py [--json out.json]

Sections (``--section NAME``, repeatable; all by default), each a function of SECTIONS:

``vllm``: after a verify step with k draft tokens per request (k = 3 by default), graph mode
(N copies of one call captured in one CUDA graph; time per copy = replay time / N, median of R
replays), on decode batches of 64, 1024 and 4096 requests and a mixed batch (chunked-prefill rows
among decodes), one KV-cache group (B = 16):

  * draft     VllmDraftPlanner.compute: every draft step's addressing in one launch;
  * draft+att the same with FlashInfer and varlen metadata for every draft step;
  * step      VllmStepPlanner.compute on the verify batch itself (one fused vLLM step);
  * floor     a kernel (CUDA source below) that only writes the same outputs as ``draft``
              (last_token_indices; per step positions, seq_lens, query_start_loc, slots) with
              no checks, no DCP and no mask: the floor of the draft launch;
  * per-step  VllmDraftPerStep (vLLM's per-draft-step design re-implemented: a launch for the
              sampled rows, then per step a prepare and a slot-mapping launch, plus a metadata
              kernel per group with attention).

Every implementation is first checked against the NumPy reference on the same batch. Printed
ratios: draft/step, draft/floor, per-step/draft (and with attention). Eager: host time per
call of ``BoundVllmDraft.launch(idx_mapping, query_start_loc)`` and of the batch-buffer binding's
``BoundVllmDraftBatch.launch(num_reqs)`` against an empty CuPy ``RawKernel`` launch, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr.engines.spec_reference import vllm_draft_reference
from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_draft import VllmDraftPlanner
from kvaddr.strategies.vllm_draft_per_step import VllmDraftPerStep

FLOOR_SOURCE = r"""
extern "C" __global__ void draft_floor(const int* __restrict__ idx,    // [n] int32, -1: dummy
                                       const int* __restrict__ qsl,    // [n + 1] int32
                                       const int* __restrict__ seq,    // [n] int32
                                       const int* __restrict__ rej,    // [n] int32
                                       const int* __restrict__ table,  // [rows, W] int32
                                       int W, int B, int n, int M, int S, int max_len,
                                       long long* __restrict__ last,   // [M] int64
                                       long long* __restrict__ pos,    // [S, M] int64
                                       int* __restrict__ lens,         // [S, M] int32
                                       int* __restrict__ qsl_out,      // [S, M + 1] int32
                                       long long* __restrict__ slots) {  // [S, M] int64
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b > M) return;
    for (int j = 0; j < S; ++j) qsl_out[j * (M + 1) + b] = b < n ? b : n;
    if (b == M) return;
    int r = -1, base = 0;
    long long lt = 0;
    if (b < n) {
        r = idx[b];
        const int rj = rej[b];
        base = seq[b] - rj;
        lt = qsl[b + 1] - rj - 1;
    }
    last[b] = lt;
    for (int j = 1; j <= S; ++j) {
        long long p = 0, s = -1;
        int l = 0;
        if (r >= 0) {
            p = min(base - 1 + j, max_len - 1);
            l = min(base + j, max_len);
            s = (long long)table[(long long)r * W + p / B] * B + p % B;
        }
        pos[(j - 1) * M + b] = p;
        lens[(j - 1) * M + b] = l;
        slots[(j - 1) * M + b] = s;
    }
}
"""

SHAPES = ("decode:64", "decode:1024", "decode:4096", "mixed:1024")


def verify_batch(rng, shape: str, k: int, B: int, max_len: int):
    """A verify step: ``decode:N`` (N requests with k drafts each) or ``mixed:N`` (a quarter of
    them chunked-prefill rows of 64 tokens); random acceptance; the tables hold every block the
    scheduler allocates. Returns (host inputs, settings)."""
    kind, n = shape.split(":")[0], int(shape.split(":")[1])
    prefill = rng.random(n) < (0.25 if kind == "mixed" else 0.0)
    q = np.where(prefill, 64, k + 1).astype(np.int32)
    seq = (rng.integers(256, max_len - 2 * k - 64, size=n) + q).astype(np.int32)
    acc = rng.integers(0, k + 1, size=n)
    rej = np.where(prefill, 0, k - acc).astype(np.int32)
    smp = np.where(prefill, 0, acc + 1).astype(np.int32)
    qsl = np.concatenate(([0], np.cumsum(q))).astype(np.int32)
    W = -(-max_len // B)
    rows = rng.permutation(n).astype(np.int32)
    table = np.full((n, W), -1, dtype=np.int32)
    nb = np.zeros(n, dtype=np.int32)
    pool = rng.permutation(n * W).astype(np.int32)
    for b in range(n):
        need = -(-min(int(seq[b]) + k, max_len) // B)
        table[rows[b], :need] = pool[rows[b] * W : rows[b] * W + need]
        nb[rows[b]] = need
    T = int(qsl[-1])
    pos = np.concatenate([np.arange(s - ql, s) for s, ql in zip(seq, q)])
    owner = np.repeat(np.arange(n), q)
    vsm = (table[rows[owner], pos // B].astype(np.int64) * B + pos % B)[None, :]
    x = dict(
        idx_mapping=rows,
        query_start_loc=qsl,
        seq_lens=seq,
        num_rejected=rej,
        num_sampled=smp,
        block_tables=[table],
        num_blocks=[nb],
        verify_slot_mappings=vsm,
        num_computed_tokens=(seq - q)[np.argsort(rows)].astype(np.int32),
    )
    N = int(sum(-(-min(int(s) + k, max_len) // B) for s in seq)) + 64
    settings = dict(
        max_num_reqs=n,
        max_num_batched_tokens=T,
        num_speculative_steps=k,
        block_sizes=[B],
        widths=[W],
        max_model_len=max_len,
    )
    return x, settings, N


def _dev(x):
    return {k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}


def _same(out, want, fields, label):
    for f in fields:
        got = getattr(out, f)
        got = got.get() if hasattr(got, "get") else got
        assert np.array_equal(got, getattr(want, f)), (label, f)


def host_times(calls: dict, stream, n: int, samples: int) -> dict:
    """Median host time per eager call of each function, samples interleaved (order rotating)."""
    got = {k: [] for k in calls}
    for fn in calls.values():
        fn()
    stream.synchronize()
    order = list(calls.items())
    for i in range(samples):
        j = i % len(order)
        for k, fn in order[j:] + order[:j]:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            stream.synchronize()
            got[k].append((t1 - t0) * 1e6 / n)
    return {k: statistics.median(v) for k, v in got.items()}


def section_vllm(a, stream) -> list:
    rng = np.random.default_rng(0)
    rows = []
    B, max_len, k = 16, 8192, a.spec_tokens
    floor_fn = cupy.RawModule(code=FLOOR_SOURCE).get_function("draft_floor")
    fields = ("last_token_indices", "positions", "seq_lens", "query_start_loc", "slot_mappings")
    att_fields = ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen_k")
    for shape in a.shape or SHAPES:
        x, s, N = verify_batch(rng, shape, k, B, max_len)
        d = _dev(x)
        args = (
            *(d[n] for n in ("idx_mapping", "query_start_loc", "seq_lens", "num_rejected", "num_sampled")),
            d["block_tables"],
            d["num_blocks"],
            d["verify_slot_mappings"],
        )
        want = vllm_draft_reference(
            x["idx_mapping"], x["query_start_loc"], x["seq_lens"], x["num_rejected"], x["num_sampled"],
            x["block_tables"], s["block_sizes"], x["verify_slot_mappings"], max_len, k, num_blocks=x["num_blocks"],
            max_num_reqs=s["max_num_reqs"], attention="flashinfer,varlen", kv_indices_capacity=N,
        )  # fmt: skip
        assert want.error_mask == 0
        draft = VllmDraftPlanner(**s)
        draft_att = VllmDraftPlanner(**s, attention="flashinfer,varlen", kv_indices_capacity=N)
        per_step = VllmDraftPerStep(**s)
        per_step_att = VllmDraftPerStep(**s, attention="flashinfer,varlen", kv_indices_capacity=N)
        step = VllmStepPlanner(s["max_num_reqs"], s["max_num_batched_tokens"], [B], [s["widths"][0]])
        n = x["idx_mapping"].shape[0]
        stream.synchronize()
        # correctness first: each implementation against the reference, twice
        for impl, fs, label in (
            (draft, fields, "draft"),
            (draft_att, fields + att_fields, "draft+att"),
            (per_step, fields, "per-step"),
            (per_step_att, fields + att_fields, "per-step+att"),
        ):
            for _ in range(2):
                out = impl.compute(*args, stream=stream)
                stream.synchronize()
                _same(out, want, fs, label)
            if not isinstance(impl, VllmDraftPerStep):
                assert impl.errors(stream)[0] == 0, label
        M, S, W = s["max_num_reqs"], k - 1, s["widths"][0]
        fo = dict(
            last=cupy.empty(M, cupy.int64),
            pos=cupy.empty((S, M), cupy.int64),
            lens=cupy.empty((S, M), cupy.int32),
            qsl=cupy.empty((S, M + 1), cupy.int32),
            slots=cupy.empty((S, M), cupy.int64),
        )
        fargs = (
            d["idx_mapping"], d["query_start_loc"], d["seq_lens"], d["num_rejected"], d["block_tables"][0],
            *(np.int32(v) for v in (W, B, n, M, S, max_len)),
            fo["last"], fo["pos"], fo["lens"], fo["qsl"], fo["slots"],
        )  # fmt: skip

        def run_floor():
            floor_fn(((M + 1 + 255) // 256,), (256,), fargs, stream=stream)

        run_floor()
        stream.synchronize()
        assert np.array_equal(fo["pos"].get(), want.positions) and np.array_equal(
            fo["slots"].get(), want.slot_mappings[:, 0]
        )
        assert np.array_equal(fo["last"].get(), want.last_token_indices), "floor"
        idx_d, qsl_d = d["idx_mapping"], d["query_start_loc"]
        nct, tables, nbs = cupy.asarray(x["num_computed_tokens"]), d["block_tables"], d["num_blocks"]
        step.compute(idx_d, qsl_d, nct, tables, nbs, stream=stream)
        stream.synchronize()
        assert step.errors(stream)[0] == 0, "step"
        t = {}
        for name, fn in (
            ("draft", lambda: draft.compute(*args, stream=stream)),
            ("draft+att", lambda: draft_att.compute(*args, stream=stream)),
            ("step", lambda: step.compute(idx_d, qsl_d, nct, tables, nbs, stream=stream)),
            ("floor", run_floor),
            ("per-step", lambda: per_step.compute(*args, stream=stream)),
            ("per-step+att", lambda: per_step_att.compute(*args, stream=stream)),
        ):
            t[name] = bench_step.graph_time_per_copy(fn, stream, a.copies, a.replays)[0]
        row = dict(shape=shape, k=k, **{f"us_{key}": v for key, v in t.items()})
        row["draft/step"] = t["draft"] / t["step"]
        row["draft/floor"] = t["draft"] / t["floor"]
        row["per-step/draft"] = t["per-step"] / t["draft"]
        row["per-step+att/draft+att"] = t["per-step+att"] / t["draft+att"]
        rows.append(row)
        print(
            f"{shape:>12} k={k}  draft {t['draft']:6.2f} us  step {t['step']:6.2f}  floor {t['floor']:6.2f}  "
            f"per-step {t['per-step']:6.2f}  | draft/step {row['draft/step']:.2f}  draft/floor "
            f"{row['draft/floor']:.2f}  per-step/draft {row['per-step/draft']:.2f}  | with metadata: draft "
            f"{t['draft+att']:6.2f}  per-step {t['per-step+att']:6.2f}  ratio {row['per-step+att/draft+att']:.2f}",
            flush=True,
        )
        if shape == (a.shape or SHAPES)[0]:
            seq_p = cupy.asarray(np.resize(x["seq_lens"], M))
            rej_p, smp_p = cupy.asarray(np.resize(x["num_rejected"], M)), cupy.asarray(np.resize(x["num_sampled"], M))
            bound = draft.bind(seq_p, rej_p, smp_p, tables, nbs, d["verify_slot_mappings"])
            batch = draft.bind(
                seq_p, rej_p, smp_p, tables, nbs, d["verify_slot_mappings"], idx_mapping=idx_d, query_start_loc=qsl_d
            )
            batch.launch(n, stream=stream.ptr)
            stream.synchronize()
            _same(draft.outputs, want, fields, "batch binding")
            empty = cupy.RawKernel('extern "C" __global__ void e() {}', "e")
            h = host_times(
                dict(
                    bound=lambda: bound.launch(idx_d, qsl_d, stream=stream.ptr),
                    batch=lambda: batch.launch(n, stream=stream.ptr),
                    empty=lambda: empty((1,), (1,), ()),  # (on the current stream: this one)
                ),
                stream,
                a.calls,
                a.host_samples,
            )
            rows.append(
                dict(
                    shape=shape,
                    host_us_bound=h["bound"],
                    host_us_batch=h["batch"],
                    host_us_empty=h["empty"],
                    ratio=h["bound"] / h["empty"],
                    batch_ratio=h["batch"] / h["empty"],
                )
            )
            print(
                f"{'eager host':>12}  bound launch(idx, qsl) {h['bound']:.2f} us  batch-bound launch(n) "
                f"{h['batch']:.2f} us  empty CuPy launch {h['empty']:.2f} us  bound/empty "
                f"{h['bound'] / h['empty']:.2f}  batch-bound/empty {h['batch'] / h['empty']:.2f}",
                flush=True,
            )
    return rows


#: The benchmark's sections by name (a section takes the parsed arguments and the stream, prints
#: its rows and returns them).
SECTIONS = {"vllm": section_vllm}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these sections")
    ap.add_argument("--spec-tokens", type=int, default=3, help="k, draft tokens per request")
    ap.add_argument("--shape", action="append", help="decode:N or mixed:N (repeatable)")
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--calls", type=int, default=1000, help="eager calls per host-time sample")
    ap.add_argument("--host-samples", type=int, default=15)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    stream = cupy.cuda.Stream(non_blocking=True)
    out = {}
    with stream:
        for name in a.section or list(SECTIONS):
            print(f"== {name}", flush=True)
            out[name] = SECTIONS[name](a, stream)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
