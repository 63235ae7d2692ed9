"""Host time per eager launch, side by side in one run, against the empty launch.

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_host.py [--json out.json]

Rows (every one launched on the same CUDA stream, inputs persistent, one decode step of
``--bsz`` requests with two caches):

* ``empty RawKernel``: ``cupy.RawKernel`` of an empty kernel, called with no arguments
  (the yardstick every ratio is against);
* ``empty kvaddr launcher``: kvaddr's empty kernel through ``kernel_loader.Launcher``
  (``cupy.cuda.driver.launchKernel`` with a prebuilt parameter array, as the planner launches);
* ``RawKernel, 1 block, 11 args``: a one-block CuPy kernel with 11 arguments (CuPy converts each);
* ``BoundStep.launch``: the bound fast path (``planner.bind(...)`` once, then ``launch(bsz)``);
* ``compute() (CuPy)`` / ``compute() (torch)``: ``StepPlanner.compute`` with full checks
  (memoised: the same input objects with unchanged pointer, shape, strides, dtype and device
  skip re-running them); ``compute() (CuPy), no memo``: every check on every call
  (``planner.memoize_checks = False``, the path before the memo); ``new dec/q objects``: new
  views of the same buffers every call (8 sets in turn), as an engine passing fresh slices:
  the memo never hits, and no memo guard is built for them;
* ``torch op (eager)``: ``torch.ops.kvaddr.step_into.default`` (the packed op: one table, the
  outputs in one mutated tensor ``StepBuffers.storage``, an int layout handle; 5 arguments) with
  persistent tensors, on torch's current stream; ``.tables overload``: ``step_into.tables``
  (a list of tables); ``old schema kvaddr::step``: the op before (11 arguments, one tensor per
  output), on the same buffers; ``autograd fallback``: ``step_into`` without the op's Autograd
  fallthrough (``kvaddr.torch.set_autograd_fallthrough(False)``);
* ``kvaddr.torch.step (op + views)``: the documented entry point (its views kept per bsz);
  ``views per call``: the op plus ``StepBuffers.outputs(bsz)`` (the views built every call, as
  ``step()`` did before).
* the vLLM step on torch tensors, as vLLM's Model Runner V2 calls it (a decode batch of ``--bsz``
  requests, two KV-cache groups, B = 16 and 64, ``max_num_reqs`` = 2 x bsz, a permuted subset of
  the rows; persistent torch tensors from its persistent buffers): ``vLLM bind(batch buffers)
  .launch(n, padded)``: ``VllmStepPlanner.bind(state, idx_mapping=buffer, query_start_loc=buffer)``
  once, then two ints per step; ``vLLM bind().launch(fresh slices)``: ``bind(state)`` once, then
  ``launch(idx_buf[:n], qsl_buf[:n + 1], padded)`` with new slices every call (8 sets made
  beforehand, taken in turn: the slicing itself is torch's cost, timed in its own row);
  ``vLLM compute(fresh slices)``: ``VllmStepPlanner.compute`` with the same fresh slices and the
  persistent state; ``, torch stream object``: the same with ``stream=`` a torch stream object
  new at every call (8 ``torch.cuda.current_stream()`` objects made beforehand, in turn) instead of
  its int handle; ``torch: 2 slices + current_stream() (no launch)``: what making those objects
  costs the engine per step (no kvaddr call); ``, pinned num_blocks``: the bound batch launch and
  compute() with fresh slices over ``num_blocks`` in pinned host memory (a ``pin_memory()``
  tensor, vLLM's layout), which the planner stages: two driver calls per step (no bound).

Host time: ``time.perf_counter`` around N calls with no synchronisation in between, then
one synchronisation outside the clock; per call = elapsed / N. Rows are measured in turn,
round-robin, ``--repeats`` times (so drift hits every row alike); the table shows the
median (and best) of those samples, plus the median of single-call samples. Exit status 1
if a bound is missed: bound launch <= 1.0x, compute() (CuPy) <= 1.5x, the
torch op <= 2.0x, the vLLM bound batch launch (torch) <= 1.0x and each vLLM fresh-slice row
(torch) <= 2.0x the empty RawKernel launch.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import platform
import statistics
import sys
import time

import numpy as np

BOUNDS = {
    "BoundStep.launch": 1.0,
    "compute() (CuPy)": 1.5,
    "torch op (eager)": 2.0,
    "vLLM bind(batch buffers).launch(n, padded)": 1.0,
    "vLLM bind().launch(fresh slices)": 2.0,
    "vLLM bind().launch(fresh slices), torch stream object": 2.0,
    "vLLM compute(fresh slices)": 2.0,
    "vLLM compute(fresh slices), torch stream object": 2.0,
}

ELEVEN_ARGS = r"""
extern "C" __global__ void eleven(const int* a, const int* b, const int* c, int* d, long long* e,
                                  int n0, int n1, int n2, int n3, long long n4, int n5) {
    if (threadIdx.x == 0 && n0 < 0) d[0] = a[0] + b[0] + c[0] + n1 + n2 + n3 + (int)n4 + n5 + (int)e[0];
}
"""


class _NoArgs(ctypes.Structure):
    _fields_ = ()  # the empty kernel takes no parameter


def per_call_samples(fn, sync, n):
    """Per-call host time of n back-to-back calls (one sync after, off the clock)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def single_call_samples(fn, sync, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    sync()
    return out


def vllm_torch_rows(torch, bsz: int, handle: int, rows: dict):
    """Add the vLLM step's torch rows (see the module's docstring) to ``rows``; returns
    ``check(sync)``, which runs each row's call once and compares every output with the NumPy
    reference (raises AssertionError on a difference)."""
    import itertools

    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.engines.vllm_reference import vllm_step_reference
    from kvaddr.measure.vllm_workload import VllmWorkload, make_batch_set, parse_shape

    bs = make_batch_set(VllmWorkload(block_sizes=(16, 64), input_sets=1), parse_shape(f"decode:{bsz}"))
    cfg, x, padded = bs.config, bs.inputs[0], bs.num_reqs_padded
    n = len(x["idx_mapping"])
    dev = torch.device("cuda", torch.cuda.current_device())

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), device=dev)

    nct, tables = t(x["num_computed_tokens"]), [t(b) for b in x["block_tables"]]
    num_blocks = t(np.stack(x["num_blocks"]))  # vLLM's layout: one [G, rows] array
    M = cfg.max_num_reqs
    idx_buf = torch.zeros(M, dtype=torch.int32, device=dev)  # vLLM's persistent batch buffers
    qsl_buf = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    idx_buf[:n] = t(x["idx_mapping"].astype(np.int32))
    qsl_buf[: n + 1] = t(x["query_start_loc"])
    kw = dict(max_num_reqs=M, max_num_batched_tokens=cfg.max_num_batched_tokens, block_sizes=[16, 64])
    kw["widths"] = list(cfg.widths)
    pb, pf, pc, pcs, pbu, pcu = (VllmStepPlanner(**kw) for _ in range(6))
    num_blocks_pinned = torch.from_numpy(np.stack(x["num_blocks"]).astype(np.int32)).pin_memory()
    bound_batch = pb.bind(nct, tables, num_blocks, idx_mapping=idx_buf, query_start_loc=qsl_buf, stream=handle)
    bound = pf.bind(nct, tables, num_blocks, stream=handle)
    bound_batch_pinned = pbu.bind(
        nct, tables, num_blocks_pinned, idx_mapping=idx_buf, query_start_loc=qsl_buf, stream=handle
    )
    slices = itertools.cycle([(idx_buf[:n], qsl_buf[: n + 1]) for _ in range(8)])
    streams = itertools.cycle([torch.cuda.current_stream() for _ in range(8)])
    assert all(s.cuda_stream == handle for s in [next(streams) for _ in range(8)]), "torch's current stream"

    def bound_fresh():
        i, q = next(slices)
        bound.launch(i, q, padded, stream=handle)

    def bound_fresh_torch_stream():
        i, q = next(slices)
        bound.launch(i, q, padded, stream=next(streams))

    def compute_fresh():
        i, q = next(slices)
        pc.compute(i, q, nct, tables, num_blocks, padded, stream=handle)

    def compute_fresh_torch_stream():
        i, q = next(slices)
        pcs.compute(i, q, nct, tables, num_blocks, padded, stream=next(streams))

    def compute_fresh_pinned():
        i, q = next(slices)
        pcu.compute(i, q, nct, tables, num_blocks_pinned, padded, stream=handle)

    def torch_alone():
        return idx_buf[:n], qsl_buf[: n + 1], torch.cuda.current_stream()

    rows["vLLM bind(batch buffers).launch(n, padded)"] = lambda: bound_batch.launch(n, padded, handle)
    rows["vLLM bind().launch(fresh slices)"] = bound_fresh
    rows["vLLM bind().launch(fresh slices), torch stream object"] = bound_fresh_torch_stream
    rows["vLLM compute(fresh slices)"] = compute_fresh
    rows["vLLM compute(fresh slices), torch stream object"] = compute_fresh_torch_stream
    rows["torch: 2 slices + current_stream() (no launch)"] = torch_alone
    rows["vLLM bind(batch buffers).launch(n, padded), pinned num_blocks"] = lambda: bound_batch_pinned.launch(
        n, padded, handle
    )
    rows["vLLM compute(fresh slices), pinned num_blocks"] = compute_fresh_pinned
    want = vllm_step_reference(cfg, **x, num_reqs_padded=padded).outputs

    def check(sync):
        for name, planner, fn in (
            ("bind(batch buffers)", pb, rows["vLLM bind(batch buffers).launch(n, padded)"]),
            ("bind() fresh slices", pf, bound_fresh),
            ("compute() fresh slices", pc, compute_fresh),
            ("compute() fresh slices, torch stream", pcs, compute_fresh_torch_stream),
            (
                "bind(batch buffers), pinned num_blocks",
                pbu,
                rows["vLLM bind(batch buffers).launch(n, padded), pinned num_blocks"],
            ),
            ("compute() fresh slices, pinned num_blocks", pcu, compute_fresh_pinned),
        ):
            for _ in range(3):  # (compute(): the third call is on the path of fresh objects)
                fn()
            sync()
            out = planner.outputs
            for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
                assert np.array_equal(getattr(out, f).get(), getattr(want, f)), f"vLLM {name}: {f} != reference"
            for g, tab in enumerate(out.input_block_tables):
                assert np.array_equal(tab.get(), want.input_block_tables[g]), f"vLLM {name}: table {g} != reference"
            assert planner.errors()[0] == 0, f"vLLM {name}: device errors"
        assert pc._state_bound is not None, "compute() did not take the path of fresh batch objects"

    return check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bsz", type=int, default=64, help="requests of the step (decode, one token each)")
    ap.add_argument("--n", type=int, default=2000, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=15, help="samples per row (round-robin)")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    import cupy

    from kvaddr import StepPlanner, kernel_loader

    B = 64
    rng = np.random.default_rng(0)
    bsz = a.bsz
    dec_h = rng.integers(1024, 32768, size=bsz).astype(np.int32)
    q_h = np.ones(bsz, np.int32)
    width = int((dec_h.max() + 1) // B + 1)
    table_h = rng.permutation(bsz * width).astype(np.int32).reshape(bsz, width)
    capacity = max(bsz, 1)

    stream = cupy.cuda.Stream(non_blocking=True)
    rows = {}
    setups, teardowns = {}, {}  # per row: run before / after its samples (off the clock)
    with stream:
        dec, q, table = cupy.asarray(dec_h), cupy.asarray(q_h), cupy.asarray(table_h)
        empty_raw = cupy.RawKernel('extern "C" __global__ void empty() {}', "empty")
        rows["empty RawKernel"] = lambda: empty_raw((1,), (1,), ())

        empty_fn = kernel_loader.get_function("kvaddr_empty")
        empty_launcher = kernel_loader.Launcher(empty_fn, _NoArgs())
        handle = stream.ptr
        rows["empty kvaddr launcher"] = lambda: empty_launcher(1, 1, handle)

        eleven = cupy.RawKernel(ELEVEN_ARGS, "eleven")
        out_i = cupy.zeros(4, np.int32)
        out_l = cupy.zeros(4, np.int64)
        eleven_args = (dec, q, dec, out_i, out_l, np.int32(1), np.int32(2), np.int32(3), np.int32(4), np.int64(5))
        eleven_args = (*eleven_args, np.int32(6))
        rows["RawKernel, 1 block, 11 args"] = lambda: eleven((1,), (32,), eleven_args)

        planner = StepPlanner(bsz, capacity, [B, B])
        bound = planner.bind(dec, q, table, stream=stream)
        rows["BoundStep.launch"] = lambda: bound.launch(bsz)
        rows["compute() (CuPy)"] = lambda: planner.compute(dec, q, table, stream=stream)
        # the path before the memo of checked inputs: every check on every call
        planner_nomemo = StepPlanner(bsz, capacity, [B, B])
        planner_nomemo.memoize_checks = False
        rows["compute() (CuPy), no memo"] = lambda: planner_nomemo.compute(dec, q, table, stream=stream)
        # an engine passing new input objects every step (vLLM's slices of its persistent buffers):
        # 8 sets of new views of dec and q in turn, so the memo never hits (and no guard is built)
        planner_new = StepPlanner(bsz, capacity, [B, B])
        views = itertools.cycle([(dec[:], q[:]) for _ in range(8)])

        def compute_new_objects():
            d_, q_ = next(views)
            planner_new.compute(d_, q_, table, stream=stream)

        rows["compute() (CuPy), new dec/q objects"] = compute_new_objects

        torch = None
        vllm_checks = []  # the vLLM rows' checks against the reference (run before timing)
        try:
            import torch
        except ImportError:
            pass
        if torch is not None and torch.cuda.is_available():
            import kvaddr.torch as kt

            torch.cuda.set_stream(torch.cuda.ExternalStream(stream.ptr))  # torch's current stream = ours
            td, tq, tt = (torch.from_dlpack(x) for x in (dec, q, table))
            rows["compute() (torch)"] = lambda: planner.compute(td, tq, tt, stream=handle)
            bufs = kt.StepBuffers(bsz, capacity, [B, B], device=td.device)
            op = torch.ops.kvaddr.step_into.default
            op_tables = torch.ops.kvaddr.step_into.tables
            op_old = torch.ops.kvaddr.step.default
            tables, sizes, outs = [tt], [B, B], bufs.outputs_args
            storage, layout = bufs.storage, bufs.layout
            rows["torch op (eager)"] = lambda: op(td, tq, tt, storage, layout)
            rows["torch op (eager), .tables overload"] = lambda: op_tables(td, tq, tables, storage, layout)
            # the op before (11 arguments, one tensor per output): same buffers, same launch
            rows["torch op (eager), old schema kvaddr::step"] = lambda: op_old(td, tq, tables, sizes, *outs)
            # the same op through torch's generic autograd fallback (no Autograd fallthrough)
            rows["torch op (eager), autograd fallback"] = lambda: op(td, tq, tt, storage, layout)
            setups["torch op (eager), autograd fallback"] = lambda: kt.set_autograd_fallthrough(False)
            teardowns["torch op (eager), autograd fallback"] = lambda: kt.set_autograd_fallthrough(True)
            rows["kvaddr.torch.step (op + views)"] = lambda: kt.step(td, tq, tt, bufs)
            # the views built per call (what step() did before it kept them per bsz)
            rows["kvaddr.torch.step, views per call"] = lambda: (op(td, tq, tt, storage, layout), bufs.outputs(bsz))
            vllm_checks.append(vllm_torch_rows(torch, bsz, handle, rows))

        def sync():
            stream.synchronize()

        # correctness of what is timed: the bound launch and compute() agree with the reference
        from kvaddr.reference import step_addressing

        ref = step_addressing(dec_h, q_h, table_h, [B, B], capacity)
        out = bound.launch(bsz)
        sync()
        assert np.array_equal(out.slot_mapping.get(), ref.outputs.slot_mapping), "bound launch != reference"
        if "torch op (eager)" in rows:
            for k in (
                "torch op (eager)",
                "torch op (eager), .tables overload",
                "torch op (eager), old schema kvaddr::step",
            ):
                bufs.slot_mapping.fill_(-5)
                bufs.position_ids.fill_(-5)
                rows[k]()
                sync()
                assert np.array_equal(bufs.slot_mapping.cpu().numpy(), ref.outputs.slot_mapping), f"{k} != reference"
                assert np.array_equal(bufs.position_ids.cpu().numpy(), ref.outputs.position_ids), f"{k} != reference"
            got = kt.step(td, tq, tt, bufs)
            sync()
            assert got is kt.step(td, tq, tt, bufs), "step() built new views for the same bsz"
            assert np.array_equal(got.seq_lens_kv.cpu().numpy(), ref.outputs.seq_lens_kv), "step() != reference"
            assert int(got.num_tokens) == int(ref.outputs.num_tokens), "step() != reference"
            assert bufs.errors() == (ref.error_mask, ref.error_key), "torch op's error record != reference"

        for check in vllm_checks:
            check(sync)

        def nothing():
            pass

        for k, fn in rows.items():
            setups.get(k, nothing)()
            for _ in range(a.warmup):
                fn()
            sync()
            teardowns.get(k, nothing)()
        batch = {k: [] for k in rows}
        single = {k: [] for k in rows}
        for _ in range(a.repeats):
            for k, fn in rows.items():
                setups.get(k, nothing)()
                batch[k].append(per_call_samples(fn, sync, a.n))
                single[k].extend(single_call_samples(fn, sync, 200))
                teardowns.get(k, nothing)()

    yard = statistics.median(batch["empty RawKernel"])
    results = []
    for k in rows:
        med = statistics.median(batch[k])
        bound_x = BOUNDS.get(k)
        results.append(
            dict(
                row=k,
                median_us=med,
                best_us=min(batch[k]),
                single_call_median_us=statistics.median(single[k]),
                ratio_vs_empty_rawkernel=med / yard,
                bound=bound_x,
                verdict=None if bound_x is None else ("PASS" if med / yard <= bound_x else "FAIL"),
                samples_us=batch[k],
            )
        )

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"host time per eager call, {dev}, CuPy {cupy.__version__}, bsz {bsz}, two caches (B = {B})")
    print(f"median of {a.repeats} samples of {a.n} back-to-back calls; single = median of one-call samples")
    w = max(44, *(len(r["row"]) + 1 for r in results))
    print(f"{'row':<{w}}{'median us':>11}{'best us':>10}{'single us':>11}{'x empty':>9}  bound")
    failed = False
    for r in results:
        b = "" if r["bound"] is None else f"<= {r['bound']:.1f}x  {r['verdict']}"
        failed |= r["verdict"] == "FAIL"
        print(
            f"{r['row']:<{w}}{r['median_us']:>11.2f}{r['best_us']:>10.2f}{r['single_call_median_us']:>11.2f}"
            f"{r['ratio_vs_empty_rawkernel']:>9.2f}  {b}"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                dict(
                    device=dev,
                    cupy=cupy.__version__,
                    torch=None if torch is None else torch.__version__,
                    python=platform.python_version(),
                    bsz=bsz,
                    n=a.n,
                    repeats=a.repeats,
                    rows=results,
                ),
                fh,
                indent=2,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
