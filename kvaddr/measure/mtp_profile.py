"""The MTP draft substeps of ``kvaddr profile --spec-tokens k`` (core engine, GPU).

After each verify step (1 + k tokens per decode request, the profile's step) an MTP draft model
runs k substeps, each needing its own addressing. For every batch size this measures one
verify-plus-drafts cycle's draft addressing both ways, after checking them equal:

* FastDeploy's per-substep design (:class:`kvaddr.strategies.fastdeploy_mtp.FastDeployMtp`): per
  substep a one-block length kernel, the one-block step, a host synchronisation (2 k launches
  and k synchronisations; at most 512 requests);
* kvaddr: every substep in one launch (:meth:`kvaddr.planner.StepPlanner.compute_draft_steps`).

Time per cycle: CUDA events around the cycle, eager (FastDeploy synchronises with the host, so
no graph can hold its cycle), median over the samples. The report's ``draft_steps`` object holds
a row per batch size (docs/json-schema.md); :func:`render` prints them.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvaddr.errors import CheckFailed
from kvaddr.outputs import OUTPUT_FIELDS
from kvaddr.strategies.fastdeploy_mtp import MAX_REQUESTS as FASTDEPLOY_MAX_REQUESTS


def _inputs(workload, batch: int, rng):
    """The draft model's lengths after a verify step: context from the workload's range, each
    decode request accepting 1..k + 1 tokens (drafts plus the bonus token)."""
    lo, hi = workload.context
    k = workload.spec_tokens
    dec = np.exp(rng.uniform(np.log(max(lo, 1)), np.log(max(hi, 1)), batch))
    dec = np.clip(dec, lo, hi).astype(np.int32)
    acc = rng.integers(1, k + 2, batch).astype(np.int32)
    tables = []
    for B in dict.fromkeys(workload.block_sizes):
        width = -(-(hi + 2 * k + 2) // B)
        tables.append(rng.permutation(batch * width).astype(np.int32).reshape(batch, width))
    by_size = dict(zip(dict.fromkeys(workload.block_sizes), tables))
    return dec, acc, [by_size[B] for B in workload.block_sizes]


def _host(out, stream) -> dict:
    """``out``'s fields on the host once ``stream`` (the launches') is done: ``get()`` copies on
    CuPy's current stream, which does not wait for a non-blocking stream."""
    stream.synchronize()
    return {f: getattr(out, f).get() for f in OUTPUT_FIELDS}


def _event_time(fn, stream, samples: int) -> list:
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(5):
        fn()
    stream.synchronize()
    out = []
    for _ in range(samples):
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0)
    return out


def measure(workload, batches, budget_s: float = 1.0, device: int = 0) -> dict:
    """Check, then time, the draft addressing of one cycle per batch size (see the module)."""
    import cupy

    from kvaddr.planner import StepPlanner
    from kvaddr.strategies.fastdeploy_mtp import FastDeployMtp

    k, sizes = workload.spec_tokens, list(workload.block_sizes)
    rows = []
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        for batch in batches:
            rng = np.random.default_rng([workload.seed, batch, 7919])
            h_dec, h_acc, h_tables = _inputs(workload, batch, rng)
            dec, acc = cupy.asarray(h_dec), cupy.asarray(h_acc)
            tables = [cupy.asarray(t) for t in h_tables]
            C = max(int(h_acc.sum()), 1)
            planner = StepPlanner(max(batch, 1), C, sizes, draft_steps=k, device=device)
            row = {
                "batch": batch,
                "substeps": k,
                "kvaddr": {"launches": 1, "host_syncs": 0},
                "fastdeploy": {"launches": 2 * k, "host_syncs": k},
            }

            def one(planner=planner, dec=dec, acc=acc, tables=tables):
                return planner.compute_draft_steps(dec, acc, tables, stream=stream)

            if batch > FASTDEPLOY_MAX_REQUESTS:
                row["fastdeploy"]["not_run"] = f"one block of one thread per request: at most {FASTDEPLOY_MAX_REQUESTS}"
                fd = None
            else:
                fd = FastDeployMtp(max(batch, 1), C, sizes, k, device=device)
                want = _host(one(), stream)
                got = _host(fd.run(dec, acc, tables, stream=stream), stream)
                for f in OUTPUT_FIELDS:
                    if not np.array_equal(got[f], want[f]):
                        raise CheckFailed(f"FastDeploy's per-substep MTP design differs from the one launch in {f}")
            planner.check(stream)
            # samples: about budget_s per design, at least 10
            t0 = time.perf_counter()
            _event_time(one, stream, 3)
            per = max(time.perf_counter() - t0, 1e-6) / 3
            n = int(min(2000, max(10, budget_s / max(per, 1e-6))))
            row["kvaddr"]["us"] = statistics.median(_event_time(one, stream, n))
            if fd is not None:

                def run(fd=fd, dec=dec, acc=acc, tables=tables):
                    return fd.run(dec, acc, tables, stream=stream)

                row["fastdeploy"]["us"] = statistics.median(_event_time(run, stream, max(10, n // (2 * k))))
                row["saving_us"] = row["fastdeploy"]["us"] - row["kvaddr"]["us"]
            rows.append(row)
    return {"substeps": k, "rows": rows}


def render(console, section: dict) -> None:
    """Print the draft-substep rows of a report (:func:`measure`'s object)."""
    k = section["substeps"]
    console.print(f"MTP draft addressing, {k} substeps per verify step (one cycle, eager, CUDA events):")
    for r in section["rows"]:
        kv, fd = r["kvaddr"], r["fastdeploy"]
        if "us" not in fd:
            console.print(
                f"  batch {r['batch']}: kvaddr one launch {kv['us']:.2f} us; FastDeploy's per-substep design not run "
                f"({fd['not_run']})"
            )
            continue
        console.print(
            f"  batch {r['batch']}: FastDeploy per-substep {fd['us']:.2f} us ({fd['launches']} launches, "
            f"{fd['host_syncs']} host syncs), kvaddr one launch {kv['us']:.2f} us: saving "
            f"{r['saving_us']:.2f} us per cycle ({fd['us'] / kv['us']:.1f}x)"
        )
