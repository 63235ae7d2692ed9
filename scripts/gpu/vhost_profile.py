"""Where the vLLM step's eager host time goes, against the core ``compute()`` (issue 13's host target).

Run on a GPU machine from the repository root (about 10-20 s):

    PYTHONPATH=. python scripts/gpu/vhost_profile.py [--json out.json] [--samples 25] [--calls 1000]

For each batch (default: decode 64 and decode 1024, one and two groups, the batches and inputs
of ``benchmarks/bench_vllm.py``), every row below is timed in the same process, interleaved
sample by sample with the order rotating every sample (each row in turn first), and reported
as the median and the best of ``--samples`` samples of ``--calls`` calls, in us per call:

  core compute() / vLLM compute()      the memo hit, exactly as bench_vllm.py calls them (v2)
  ... no driver                        the same call on a twin planner whose memo's launchKernel
                                       is a Python no-op: the Python of each fast path, real arrays
  core raw launch / vLLM raw launch    launchKernel(fn, grid, .., stream handle, params, 0) with
                                       the planner's own parameter block, grid and block size (no
                                       Python checks): what the driver costs for each kernel
  empty kernel 272 B / 392 B           an empty kernel taking a struct of KvStepParams' / VllmStepParams'
                                       size by value, one block, and 392 B with v2's grid: does the
                                       parameter block's size or the grid cost the host anything?
  core memo guard / vLLM memo guard    each memo's guard (validation.memo_guard) alone
  signature: 1-D array / table         validation's CuPy signature of one input (what the guard reads
                                       per distinct array: the vLLM step has 2-3 more than the core's)
  vLLM struct write                    ``params.num_reqs_padded = v`` (ctypes)
  stream_handle(...)                   kvaddr.validation.stream_handle of the stream objects the
                                       bench passes (the same cupy.cuda.Stream to both planners; both
                                       cache its handle) and of None (CuPy's current stream)
  planner stream branch                the cached-stream test both compute()s run first
  Python call, 11 args / empty loop    the floors (a no-op Python function; the loop itself)

Rows that launch are drained (untimed) after each sample; "drain" is the longest wait for the
queue to empty after a sample (a few us: the GPU kept up, so the time is the host's; ms: the
GPU was behind and the loop measured the GPU). Then the attribution of "vLLM - core":
python (no-driver rows), driver (raw launches), the rest (not additive: cache effects between
the Python and the driver call), and the guard's and the signatures' share of the Python.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))

SHAPES = ("decode:64", "decode:1024")
GROUPS = ((16,), (16, 64))
EMPTY_SOURCE = r"""
struct P272 { unsigned long long w[34]; };   // sizeof(KvStepParams)
struct P392 { unsigned long long w[49]; };   // sizeof(VllmStepParams)
extern "C" __global__ void vhost_empty272(P272 p) {}
extern "C" __global__ void vhost_empty392(P392 p) {}
"""


def time_rows(rows: dict, calls: int, samples: int, drain) -> dict:
    """Time each row (name -> (function, launches)) over ``samples`` samples of ``calls`` calls,
    interleaved, the order rotating every sample. ``drain()`` is called after each sample of a
    row that launches (untimed; its duration recorded). Returns name -> dict(median, best,
    samples, drain_max) in us per call (drain_max in us per sample)."""
    got = {k: [] for k in rows}
    drained = dict.fromkeys(rows, 0.0)
    order = list(rows.items())
    for _, (fn, _launches) in order:  # warm up
        fn()
    drain()
    perf = time.perf_counter
    for i in range(samples):
        j = i % len(order)
        for k, (fn, launches) in order[j:] + order[:j]:
            t0 = perf()
            for _ in range(calls):
                fn()
            t1 = perf()
            got[k].append((t1 - t0) * 1e6 / calls)
            if launches:
                drain()
                drained[k] = max(drained[k], (perf() - t1) * 1e6)
    return {
        k: dict(median=statistics.median(v), best=min(v), samples=v, drain_max=drained[k] if rows[k][1] else None)
        for k, v in got.items()
    }


#: (label, minuend, subtrahend): the attribution of the vLLM - core gap, medians.
ATTRIBUTION = (
    ("vLLM - core: compute() (the gap)", "vLLM compute()", "core compute()"),
    ("  of which Python (no-driver rows)", "vLLM compute(), no driver", "core compute(), no driver"),
    ("    Python: memo guard, vLLM - core", "vLLM memo guard", "core memo guard"),
    ("  of which driver (raw launches)", "vLLM raw launch", "core raw launch"),
    ("    driver: parameter block 392 B vs 272 B", "empty kernel 392 B, 1 block", "empty kernel 272 B, 1 block"),
    ("    driver: v2's grid vs 1 block", "empty kernel 392 B, v2's grid", "empty kernel 392 B, 1 block"),
    ("vector signature: vLLM - core", "vLLM compute(), vector signature", "core compute(), vector signature"),
    ("vector signature saves: core", "core compute()", "core compute(), vector signature"),
    ("vector signature saves: vLLM", "vLLM compute()", "vLLM compute(), vector signature"),
    ("core compute() - core raw launch (its Python, real)", "core compute()", "core raw launch"),
    ("vLLM compute() - vLLM raw launch (its Python, real)", "vLLM compute()", "vLLM raw launch"),
)
REST = "  the rest (gap - Python - driver)"


def attribute(res: dict, extra_arrays: int | None = None) -> list:
    """``[(label, value, unit)]``: the gap and its parts (medians, us), the rest of the gap that
    Python + driver do not explain (cache effects: the Python runs slower next to a real driver
    call), the signatures' estimate (extra distinct arrays x one table's signature) and the
    v2/core ratio."""
    med = {k: v["median"] for k, v in res.items()}
    out = [(label, med[a] - med[b], "us") for label, a, b in ATTRIBUTION if a in med and b in med]
    parts = {label: v for label, v, _ in out}
    gap, py, drv = (parts.get(ATTRIBUTION[i][0]) for i in (0, 1, 3))
    if None not in (gap, py, drv):
        labels = [lb for lb, _, _ in out]
        after = ATTRIBUTION[5][0] if ATTRIBUTION[5][0] in parts else ATTRIBUTION[3][0]
        out.insert(labels.index(after) + 1, (REST, gap - py - drv, "us"))
    if extra_arrays is not None and "signature: table" in med and ATTRIBUTION[2][0] in parts:
        label = f"    Python: {extra_arrays} more distinct arrays x one table's signature"
        at = [lb for lb, _, _ in out].index(ATTRIBUTION[2][0]) + 1
        out.insert(at, (label, extra_arrays * med["signature: table"], "us"))
    if "core compute()" in med and "vLLM compute()" in med:
        out.append(("v2/core (target <= 1.2)", med["vLLM compute()"] / med["core compute()"], "x"))
    a, b = "vLLM compute(), vector signature", "core compute(), vector signature"
    if a in med and b in med:
        out.append(("v2/core, both with the vector signature", med[a] / med[b], "x"))
    return out


def format_table(title: str, res: dict, attribution: list) -> str:
    lines = [title, f"  {'row':<44} {'median':>8} {'best':>8} {'drain max':>10}"]
    for k, v in res.items():
        drain = "" if v["drain_max"] is None else f"{v['drain_max']:8.1f}us"
        lines.append(f"  {k:<44} {v['median']:8.3f} {v['best']:8.3f} {drain:>10}")
    lines.append("  attribution (medians):")
    lines += [
        f"    {label:<60} {value:+8.3f} us" if unit == "us" else f"    {label:<60} {value:8.3f}"
        for label, value, unit in attribution
    ]
    return "\n".join(lines)


def _noop(*_args):
    return None


def _twin_without_driver(planner, call) -> None:
    """Memoise ``call`` on ``planner`` (a twin of a timed planner) and make its memo's launch a no-op."""
    call()
    call()
    m = planner._memo
    assert m is not None and m[4] is not None, "the twin planner did not memoise a launchKernel fast path"
    planner._memo = (*m[:4], _noop, *m[5:])


def profile_batch(shape_text: str, groups: tuple, stream, empties: dict, calls: int, samples: int) -> dict:
    import cupy
    import numpy as np

    sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
    import bench_vllm

    from kvaddr import StepPlanner, validation
    from kvaddr.engines import vllm as vllm_engine
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.engines.vllm_reference import vllm_step_reference
    from kvaddr.measure.vllm_workload import VllmWorkload, make_batch_set, parse_shape

    bs = make_batch_set(VllmWorkload(block_sizes=groups, input_sets=1), parse_shape(shape_text))
    x = bs.inputs[0]
    ref = vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded).outputs
    d = {k: ([cupy.asarray(t) for t in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}
    i_, s_, c_, t_, b_ = (d[k] for k in bench_vllm.NAMES)
    p_ = bs.num_reqs_padded
    kw = dict(
        max_num_reqs=bs.config.max_num_reqs,
        max_num_batched_tokens=bs.config.max_num_batched_tokens,
        block_sizes=list(groups),
        widths=list(bs.config.widths),
    )
    one, one_py = VllmStepPlanner(**kw, kernel="v2"), VllmStepPlanner(**kw, kernel="v2")
    dec, q, tables = bench_vllm.core_inputs(bs, x, ref)
    ckw = dict(max_requests=bs.num_reqs, capacity=bs.config.max_num_batched_tokens, block_sizes=list(groups))
    core, core_py = StepPlanner(**ckw), StepPlanner(**ckw)
    stream.synchronize()

    def run_one():
        one.compute(i_, s_, c_, t_, b_, p_, stream=stream)

    def run_core():
        core.compute(dec, q, tables, stream=stream)

    def run_one_py():
        one_py.compute(i_, s_, c_, t_, b_, p_, stream=stream)

    def run_core_py():
        core_py.compute(dec, q, tables, stream=stream)

    # the vLLM outputs once against the reference (the memo's launch is the one timed)
    for _ in range(2):
        run_one()
    stream.synchronize()
    out = one.outputs
    for f in ("positions", "seq_lens", "slot_mappings"):
        assert np.array_equal(getattr(out, f).get(), getattr(ref, f)), f
    assert one.errors(stream)[0] == 0
    run_core()
    run_core()
    _twin_without_driver(one_py, run_one_py)
    _twin_without_driver(core_py, run_core_py)
    # the same calls on twins whose memos were made with validation.CUPY_VECTOR_SIGNATURE on (the
    # candidate: CuPy's _shape/_strides lists read instead of the shape/strides tuples), if available
    ab = {}
    if not validation.CUPY_VECTOR_SIGNATURE and validation._has_vectors(t_[0]):
        one_vec, core_vec = VllmStepPlanner(**kw, kernel="v2"), StepPlanner(**ckw)
        validation.CUPY_VECTOR_SIGNATURE = True
        try:
            for _ in range(2):
                one_vec.compute(i_, s_, c_, t_, b_, p_, stream=stream)
                core_vec.compute(dec, q, tables, stream=stream)
        finally:
            validation.CUPY_VECTOR_SIGNATURE = False
        assert "_shape" in one_vec._memo[0].__code__.co_names and "_shape" in core_vec._memo[0].__code__.co_names
        ab = {
            "core compute(), vector signature": (lambda: core_vec.compute(dec, q, tables, stream=stream), True),
            "vLLM compute(), vector signature": (lambda: one_vec.compute(i_, s_, c_, t_, b_, p_, stream=stream), True),
            "core memo guard, vector signature": (lambda g=core_vec._memo[0]: g(dec, q, tables, None), False),
            "vLLM memo guard, vector signature": (lambda g=one_vec._memo[0]: g(i_, s_, c_, t_, b_), False),
        }
    mo, mc = one._memo, core._memo
    assert mo is not None and mc is not None and mo[4] is not None and mc[4] is not None, "no fast path memoised"
    assert mo[0](i_, s_, c_, t_, b_) and mc[0](dec, q, tables, None), "the memo guards do not hold"
    handle = validation.stream_handle(stream)
    threads = vllm_engine.THREADS

    def raw_one(launch=mo[4], f=mo[5], grid=mo[3], th=threads, h=handle, a=mo[6]):
        launch(f, grid, 1, 1, th, 1, 1, 0, h, a, 0)

    def raw_core(launch=mc[4], f=mc[5], grid=mc[2], th=mc[8], h=handle, a=mc[6]):
        launch(f, grid, 1, 1, th, 1, 1, 0, h, a, 0)

    def empty(name, grid):
        f, a = empties[name]

        def run(launch=mo[4], f=f, grid=grid, h=handle, a=a):
            launch(f, grid, 1, 1, 256, 1, 1, 0, h, a, 0)

        return run

    def guard_one(g=mo[0]):
        g(i_, s_, c_, t_, b_)

    def guard_core(g=mc[0]):
        g(dec, q, tables, None)

    sig = validation.signature_getter([i_])
    params = one._params

    def write(p=params, v=p_):
        p.num_reqs_padded = v

    current = cupy.cuda.get_current_stream()
    sh = validation.stream_handle
    obj, ptr = stream, handle

    def branch(s=stream):
        if s.__class__ is not int:
            if s is None:
                s = 0
            elif s is obj:
                s = ptr

    table = t_[0]
    # CuPy builds shape and strides per read (a list from its C++ vector, then a tuple); its public
    # _shape/_strides give the list alone: a candidate for a cheaper exact signature (timed only)
    vectors = {}
    if validation._has_vectors(table):
        vectors = {
            "  table._shape (candidate)": (lambda t=table: t._shape, False),
            "signature via _shape/_strides (candidate)": (
                lambda t=table: ((m := t.data).ptr, m.device_id, t._shape, t._strides, t.dtype),
                False,
            ),
        }
    rows = {
        "core compute()": (run_core, True),
        "vLLM compute()": (run_one, True),
        "core compute(), no driver": (run_core_py, False),
        "vLLM compute(), no driver": (run_one_py, False),
        **ab,
        "core raw launch": (raw_core, True),
        "vLLM raw launch": (raw_one, True),
        "empty kernel 272 B, 1 block": (empty("vhost_empty272", 1), True),
        "empty kernel 392 B, 1 block": (empty("vhost_empty392", 1), True),
        "empty kernel 392 B, v2's grid": (empty("vhost_empty392", mo[3]), True),
        "core memo guard": (guard_core, False),
        "vLLM memo guard": (guard_one, False),
        "signature: 1-D array": (lambda: sig(i_), False),
        "signature: table": (lambda t=t_[0]: sig(t), False),
        "  table.shape": (lambda t=t_[0]: t.shape, False),
        "  table.strides": (lambda t=t_[0]: t.strides, False),
        "  table.data.ptr": (lambda t=t_[0]: t.data.ptr, False),
        **vectors,
        "vLLM struct write": (write, False),
        "stream_handle(bench's Stream)": (lambda: sh(stream), False),
        "stream_handle(None)": (lambda: sh(None), False),
        "stream_handle(current Stream object)": (lambda: sh(current), False),
        "planner stream branch": (branch, False),
        "Python call, 11 args": (lambda: _noop(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), False),
        "empty loop": (_noop, False),
    }
    gc.disable()
    try:
        res = time_rows(rows, calls, samples, stream.synchronize)
    finally:
        gc.enable()
    assert one._memo is mo and core._memo is mc, "a timed call left the memoised path"
    core_arrays = 2 + len(groups)  # dec, q, the tables
    vllm_arrays = 3 + 2 * len(groups)  # idx, qsl, nct, the tables, the num_blocks
    info = dict(
        shape=shape_text,
        groups=list(groups),
        grid=dict(vllm=mo[3], core=mc[2]),
        threads=dict(vllm=threads, core=mc[8]),
        params_bytes=dict(vllm=ctypes.sizeof(one._params), core=ctypes.sizeof(core._params)),
        distinct_arrays=dict(vllm=vllm_arrays, core=core_arrays),
    )
    return dict(info=info, rows=res, attribution=attribute(res, vllm_arrays - core_arrays))


def build_empties() -> dict:
    """The two empty kernels (compiled here, NVRTC) and a zeroed parameter block of each one's size."""
    import cupy

    out = {}
    for name, words in (("vhost_empty272", 34), ("vhost_empty392", 49)):
        raw = cupy.RawKernel(EMPTY_SOURCE, name)
        fn = getattr(raw, "kernel", raw)
        block = (ctypes.c_uint64 * words)()
        args = (ctypes.c_void_p * 1)(ctypes.addressof(block))
        out[name] = (int(fn.ptr), ctypes.addressof(args))
        out[name + "_keep"] = (block, args)  # (alive while the launches use them)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="decode:N or mixed:N:T (repeatable; default decode:64, :1024)")
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import cupy

    sys.path.insert(0, _ROOT)
    stream = cupy.cuda.Stream(non_blocking=True)  # the bench's kind of stream, passed to both
    empties = build_empties()
    results = []
    t0 = time.perf_counter()
    with stream:
        for shape_text in a.shape or SHAPES:
            for groups in GROUPS:
                r = profile_batch(shape_text, groups, stream, empties, a.calls, a.samples)
                i = r["info"]
                title = (
                    f"{shape_text} G={len(groups)}: grid v2 {i['grid']['vllm']} x {i['threads']['vllm']} / core "
                    f"{i['grid']['core']} x {i['threads']['core']}; params {i['params_bytes']['vllm']} / "
                    f"{i['params_bytes']['core']} B; distinct arrays {i['distinct_arrays']['vllm']} / "
                    f"{i['distinct_arrays']['core']} (us per call; {a.samples} samples of {a.calls} calls)"
                )
                print(format_table(title, r["rows"], r["attribution"]), flush=True)
                results.append(r)
    print(f"vhost_profile: {time.perf_counter() - t0:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
