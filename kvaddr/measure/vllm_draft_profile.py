"""The draft forwards of ``kvaddr profile --engine vllm --spec-tokens k`` (GPU).

After each verify step (k draft tokens per decode request) vLLM's speculator runs k draft
forwards, each needing its own addressing. For every shape of the profile this measures one
verify-plus-drafts cycle's draft addressing both ways, after checking them equal (and equal to
the NumPy reference, :func:`~kvaddr.engines.spec_reference.vllm_draft_reference`):

* vLLM's per-draft-step design (:class:`~kvaddr.strategies.vllm_draft_per_step.VllmDraftPerStep`):
  a launch for the sampled rows, then per draft step a launch for positions and ``seq_lens`` and a
  slot-mapping launch (with attention metadata, a metadata kernel per group and step);
* kvaddr: every draft step in one launch (:class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner`).

Both run with and without the FlashInfer and varlen metadata of every draft step. Time per cycle:
GPU time under CUDA graphs (a graph holding several cycles, replayed; CUDA events, time per
cycle = replay time / cycles, median over replays). The report's ``draft_steps`` object holds a
row per shape (docs/json-schema.md); :func:`render` prints them.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvaddr.errors import CheckFailed

#: Cycles captured in one CUDA graph.
GRAPH_CYCLES = 20
#: The outputs compared, by attention setting.
ADDRESSING = ("last_token_indices", "positions", "seq_lens", "dcp_local_seq_lens", "query_start_loc", "slot_mappings")
METADATA = ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen_k")
ATTENTION = "flashinfer,varlen"


def verify_batch(shape, k: int, block_sizes, context, rng) -> tuple:
    """A verify step of ``shape`` (:class:`~kvaddr.measure.vllm_workload.VllmShape`): decode requests
    with k drafts each and random acceptance 0..k; a mixed shape's tokens beyond those go to
    chunked-prefill requests (``num_rejected = num_sampled = 0``). Context (tokens before the step)
    log-uniform in ``context``; each table holds the blocks the scheduler allocates for
    ``seq_lens + k`` positions, from a shuffled pool.

    Returns ``(inputs, settings, kv_indices_capacity)``: host arrays named as the planner's
    arguments, the planner's keyword arguments, and the FlashInfer capacity the batch needs.
    """
    n = int(shape.num_reqs)
    q = np.full(n, k + 1, dtype=np.int64)
    if shape.kind == "mixed" and shape.num_tokens > n * (k + 1):
        chunks = max(n // 16, 1)  # a sixteenth of the requests are prefill chunks
        per = max((shape.num_tokens - (n - chunks) * (k + 1)) // chunks, 1)
        q[:chunks] = per
    prefill = q != k + 1
    lo, hi = context
    ctx = np.exp(rng.uniform(np.log(max(lo, 1)), np.log(max(hi, 1)), n)).astype(np.int64)
    seq = (np.clip(ctx, lo, hi) + q).astype(np.int32)
    acc = rng.integers(0, k + 1, size=n)
    rej = np.where(prefill, 0, k - acc).astype(np.int32)
    smp = np.where(prefill, 0, acc + 1).astype(np.int32)
    qsl = np.concatenate(([0], np.cumsum(q))).astype(np.int32)
    max_len = int(seq.max()) + k + 1
    rows = rng.permutation(n).astype(np.int32)
    tables, nbs, widths = [], [], []
    for B in block_sizes:
        W = -(-max_len // B)
        need = -(-(seq.astype(np.int64) + k) // B)
        t = np.full((n, W), -1, dtype=np.int32)
        nb = np.zeros(n, dtype=np.int32)
        pool = rng.permutation(n * W).astype(np.int32)
        for b in range(n):
            t[rows[b], : need[b]] = pool[rows[b] * W : rows[b] * W + need[b]]
            nb[rows[b]] = need[b]
        tables.append(t)
        nbs.append(nb)
        widths.append(W)
    T = int(qsl[-1])
    vsm = rng.integers(0, 1 << 40, size=(len(block_sizes), T)).astype(np.int64)  # copied as they are
    inputs = dict(
        idx_mapping=rows,
        query_start_loc=qsl,
        seq_lens=seq,
        num_rejected=rej,
        num_sampled=smp,
        block_tables=tables,
        num_blocks=nbs,
        verify_slot_mappings=vsm,
    )
    settings = dict(
        max_num_reqs=n,
        max_num_batched_tokens=T,
        num_speculative_steps=k,
        block_sizes=list(block_sizes),
        widths=widths,
        max_model_len=max_len,
    )
    capacity = max(int(sum(int(-(-(seq.astype(np.int64) + k) // B).sum()) for B in block_sizes)), 1)
    return inputs, settings, capacity


def _graph_time(fn, stream, budget_s: float) -> float:
    """Median GPU time per call of ``fn`` (µs) replayed from a CUDA graph of GRAPH_CYCLES calls."""
    import cupy

    for _ in range(3):
        fn()
    stream.synchronize()
    with stream:
        stream.begin_capture()
        for _ in range(GRAPH_CYCLES):
            fn()
        graph = stream.end_capture()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    graph.launch(stream)
    stream.synchronize()
    out, t0 = [], time.perf_counter()
    while len(out) < 10 or (time.perf_counter() - t0 < budget_s and len(out) < 2000):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0 / GRAPH_CYCLES)
    return statistics.median(out)


def _host(out, fields, stream) -> dict:
    """``out``'s ``fields`` on the host once ``stream`` (the launches') is done: ``get()`` copies on
    CuPy's current stream, which does not wait for a non-blocking stream."""
    stream.synchronize()
    return {f: getattr(out, f).get() for f in fields}


def measure(options, spec_tokens: int, budget_s: float = 1.0, device: int = 0) -> dict:
    """Check, then time, one cycle's draft addressing per shape of ``options``
    (:class:`~kvaddr.measure.vllm_profile.VllmProfileOptions`), see the module."""
    import cupy

    from kvaddr.engines.spec_reference import vllm_draft_reference
    from kvaddr.engines.vllm_draft import VllmDraftPlanner
    from kvaddr.measure.vllm_workload import parse_shape
    from kvaddr.strategies.vllm_draft_per_step import VllmDraftPerStep

    k = int(spec_tokens)
    rows = []
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        for text in options.shapes:
            shape = parse_shape(text)
            rng = np.random.default_rng([options.seed, shape.num_reqs, shape.num_tokens, 104729])
            x, s, N = verify_batch(shape, k, options.block_sizes, options.context, rng)
            d = {
                key: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for key, v in x.items()
            }
            args = tuple(d[key] for key in x)
            want = vllm_draft_reference(
                *(x[key] for key in ("idx_mapping", "query_start_loc", "seq_lens", "num_rejected", "num_sampled")),
                x["block_tables"],
                s["block_sizes"],
                x["verify_slot_mappings"],
                s["max_model_len"],
                k,
                num_blocks=x["num_blocks"],
                max_num_reqs=s["max_num_reqs"],
                attention=ATTENTION,
                kv_indices_capacity=N,
            )
            row = {"shape": str(text), "requests": shape.num_reqs, "spec_tokens": k}
            for label, att, fields in (
                ("addressing", None, ADDRESSING),
                ("metadata", ATTENTION, ADDRESSING + METADATA),
            ):
                kw = dict(attention=att, kv_indices_capacity=N) if att else {}
                one = VllmDraftPlanner(**s, **kw, device=device)
                per = VllmDraftPerStep(**s, **kw, device=device)
                got_one = _host(one.compute(*args, stream=stream), fields, stream)
                got_per = _host(per.compute(*args, stream=stream), fields, stream)
                for f in fields:
                    if not np.array_equal(got_one[f], got_per[f]):
                        raise CheckFailed(f"vLLM's per-draft-step design differs from the one launch in {f} ({text})")
                    if not np.array_equal(got_one[f], getattr(want, f)):
                        raise CheckFailed(f"the one-launch draft addressing differs from the reference in {f} ({text})")
                one.check(stream)
                t_one = _graph_time(lambda one=one, a=args: one.compute(*a, stream=stream), stream, budget_s)
                t_per = _graph_time(lambda per=per, a=args: per.compute(*a, stream=stream), stream, budget_s)
                row[label] = {
                    "kvaddr": {"launches": 1, "us": t_one},
                    "per_step": {"launches": per.launches_per_cycle, "us": t_per},
                    "saving_us": t_per - t_one,
                    "ratio": t_per / t_one if t_one > 0 else None,
                }
            rows.append(row)
    return {"spec_tokens": k, "engine": "vllm", "rows": rows}


def render(console, section: dict) -> None:
    """Print the draft-step rows of a vLLM engine report (:func:`measure`'s object)."""
    k = section["spec_tokens"]
    console.print(
        f"vLLM draft addressing, {k} draft tokens per verify step (one cycle: {k - 1} draft steps after the "
        "first draft forward; GPU time under CUDA graphs):"
    )
    for r in section["rows"]:
        for label, what in (("addressing", "addressing"), ("metadata", "with attention metadata")):
            m = r[label]
            ratio = f" ({m['ratio']:.1f}x)" if m.get("ratio") else ""
            console.print(
                f"  {r['shape']} {what}: per-draft-step {m['per_step']['us']:.2f} us "
                f"({m['per_step']['launches']} launches), kvaddr one launch {m['kvaddr']['us']:.2f} us: "
                f"saving {m['saving_us']:.2f} us per cycle{ratio}"
            )
