"""Benchmark of the one-launch vLLM step against the core fused step and vLLM's three-launch design.

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_vllm.py [--json out.json]

Graph mode (as benchmarks/bench_step.py): N copies of one call captured in one CUDA
graph; time per copy = replay time (CUDA events, median of R replays) / N, for
  * one      VllmStepPlanner.compute: one launch (the ``vllm_step`` kernel),
  * core     StepPlanner.compute on the same batch (dec = num_computed_tokens of
             each request's row, q = its query length, the batch-order block rows),
  * three    VllmThreeLaunch.compute (vLLM's three launches, re-implemented),
  * vllm-min on decode batches, a floor (CUDA source below, an instrument): one launch in
             which token t trusts that it is batch entry t with one token and does only the
             chain of vLLM's contract, idx_mapping[t] -> num_computed_tokens[r] -> the block id
             of each group -> its position and slots (positions 0 and slots -1 past the batch
             and for dummy entries); no seq_lens, no gathered tables, no checks. Printed beside
             a quarter of the three launches.
Shapes: decode batches of 64, 1024 and 4096 requests and 256 requests carrying 16k
tokens (kvaddr.measure.vllm_workload), each with 1 group (B = 16) and 2 groups
(B = 16 and 64). Every implementation is first checked against the NumPy reference on the
same batch (outputs and error record).
Eager: host time per call (no synchronisation between calls) of VllmStepPlanner.compute
against StepPlanner.compute on the same batch, interleaved. Both planners memoise their
checked inputs (the same objects with unchanged signatures skip the checks); each is also
timed with ``memoize_checks = False`` (every call checked: "no memo"), and with new batch
objects every call (8 sets of new views of the same buffers in turn, as vLLM passes new slices:
the memo never hits) for compute() of both and for ``VllmStepPlanner.bind()``'s
``BoundVllmStep.launch`` (the request state bound once; also with the same objects).
``--host-only``: the correctness check and the eager host rows alone (no graph timing), about 15 s.
``--attention``: only the attention rows: the vLLM step with attention=("flashinfer", "varlen")
against the step without, graph mode, on/off, after checking both against the reference.
``--num-blocks-mem uva``: only the rows of ``num_blocks`` in pinned host memory (vLLM's layout:
one ``[G, max_num_reqs]`` int32 array, ``cupyx.empty_pinned``; the planner stages it: a copy
kernel, then the step as its programmatic dependent) against the same step with ``num_blocks``
in device memory, graph mode, decode 64/1024/4096 and mixed, G = 1, 2; beside them two floors
(CUDA source below, instruments): ``uva-floor``, one launch reading the same words through UVA
in the same dependent order (idx_mapping[b] -> num_blocks[g][r] of every group) and storing them;
``staged-floor``, the staged step's two launches doing strictly less (the same copy, then a
dependent kernel that reads idx_mapping[b] and the copied num_blocks[g][r] and stores them).
Prints uva/device, uva/floor and uva/staged-floor with PASS or FAIL against the bounds
(uva <= 1.2x device or <= 1.3x the uva-floor; uva <= 1.3x the staged-floor); exit status 1 if
the first fails. Every implementation, the floors included, is checked first. ``--num-blocks-mem device`` (the default): the rows above.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr import StepPlanner
from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_reference import vllm_step_reference
from kvaddr.measure.vllm_workload import VllmWorkload, make_batch_set, parse_shape
from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

# The vllm-min floor (decode batches): token t is batch entry t; three dependent loads, then the stores.
VLLM_MIN_SOURCE = r"""
extern "C" __global__ void vllm_min(const int* __restrict__ idx,   // [n] int32, -1: a dummy entry
                                    const int* __restrict__ nct,   // [max_num_reqs] int32
                                    const int* __restrict__ t0,    // [max_num_reqs, W0] int32 (group 0)
                                    const int* __restrict__ t1,    // [max_num_reqs, W1] int32 (group 1 if G = 2)
                                    int W0, int W1, int B0, int B1, int G, int n, int T,
                                    long long* __restrict__ pos,   // [T] int64
                                    long long* __restrict__ s0,    // [T] int64
                                    long long* __restrict__ s1) {  // [T] int64 (G = 2)
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    long long p = 0, a = -1, b = -1;
    if (t < n) {
        const int r = idx[t];
        if (r >= 0) {
            const int c = nct[r];
            p = c;
            a = (long long)t0[(long long)r * W0 + c / B0] * B0 + c % B0;
            if (G > 1) b = (long long)t1[(long long)r * W1 + c / B1] * B1 + c % B1;
        }
    }
    pos[t] = p;
    s0[t] = a;
    if (G > 1) s1[t] = b;
}
"""

# The uva-floor (--num-blocks-mem uva): per batch entry b, the row r = idx[b] (device memory), then
# every group's num_blocks[g][r] (pinned host memory, through UVA; all issued before the stores).
UVA_FLOOR_SOURCE = r"""
extern "C" __global__ void uva_floor(const int* __restrict__ idx,  // [n] int32: batch b -> row r; -1 dummy
                                     unsigned long long nb_addr,   // device address of [G, stride] int32 (UVA)
                                     long long stride,             // elements between two groups' rows
                                     int G, int n,
                                     int* __restrict__ out) {      // [G, n] int32: num_blocks[g][r], 0 dummy
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const int* __restrict__ nb = reinterpret_cast<const int*>(nb_addr);
    const int r = idx[b];
    int v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G && r >= 0) v[g] = nb[g * stride + r];
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G) out[(long long)g * n + b] = v[g];
}

// The staged-floor (--num-blocks-mem uva): the staged step's two launches doing strictly less.
// staged_floor_copy copies num_blocks rows [0, M) of every group into device memory, as
// vllm_stage_num_blocks does; staged_floor_read, launched as its programmatic dependent, reads
// idx[b], waits for the copy, reads the copy's num_blocks[g][r] and stores them. Same parameters.
extern "C" __global__ void staged_floor_copy(const int* __restrict__ idx, unsigned long long nb_addr,
                                             long long stride, int* __restrict__ copy, int G, int M, int n,
                                             int* __restrict__ out) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const int* nb = reinterpret_cast<const int*>(nb_addr);
    int v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G) v[g] = nb[g * stride + i];
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G) copy[(long long)g * M + i] = v[g];
}
extern "C" __global__ void staged_floor_read(const int* __restrict__ idx, unsigned long long nb_addr,
                                             long long stride, int* __restrict__ copy, int G, int M, int n,
                                             int* __restrict__ out) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const int r = idx[b];
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    int v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G && r >= 0) v[g] = copy[(long long)g * M + r];
#pragma unroll
    for (int g = 0; g < 4; ++g)
        if (g < G) out[(long long)g * n + b] = v[g];
}
"""
#: --num-blocks-mem uva: UVA num_blocks may cost this much more than device num_blocks, or than the floor.
UVA_BOUNDS = (1.2, 1.3)

SHAPES = ("decode:64", "decode:1024", "decode:4096", "mixed:256:16384")
GROUPS = ((16,), (16, 64))
NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


def graph_time_per_copy(launch, stream, copies, replays):
    """Median GPU time per copy of ``launch`` over graph replays (bench_step's, without the samples)."""
    return bench_step.graph_time_per_copy(launch, stream, copies, replays)[0]


def host_times(calls: dict, stream, n, samples, *, best: dict | None = None):
    """Host time per call of each of ``calls`` (name -> function), median of ``samples`` samples
    of ``n`` eager calls each. The samples are interleaved and the order rotates every sample
    (each function in turn first after the synchronisation), so every function sees the same
    host noise and the same position; the stream is drained (untimed) after every sample, so no
    function's sample starts behind another's queued work. ``best`` (a dict) gets each minimum."""
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
    if best is not None:
        best.update({k: min(v) for k, v in got.items()})
    return {k: statistics.median(v) for k, v in got.items()}


def vllm_min_launcher(d, config, stream):
    """The vllm-min floor on a decode batch's device inputs ``d``: (launch, (positions, slots of each
    group)), or None if ``d`` is not a decode batch."""
    qsl = d["query_start_loc"].get()
    n = int(qsl.shape[0]) - 1
    if not np.all(np.diff(qsl) == 1):
        return None
    fn = cupy.RawModule(code=VLLM_MIN_SOURCE).get_function("vllm_min")
    idx = d["idx_mapping"].astype(cupy.int32)
    nct = d["num_computed_tokens"].astype(cupy.int32)
    tabs = d["block_tables"]
    G, T = len(tabs), int(config.max_num_batched_tokens)
    t1 = tabs[1] if G > 1 else tabs[0]
    W, Bs = list(config.widths), list(config.block_sizes)
    W1, B1 = (W[1], Bs[1]) if G > 1 else (W[0], Bs[0])
    pos, s0, s1 = (cupy.empty(T, cupy.int64) for _ in range(3))
    args = (idx, nct, tabs[0], t1, *(np.int32(v) for v in (W[0], W1, Bs[0], B1, G, n, T)), pos, s0, s1)
    return (lambda: fn(((T + 255) // 256,), (256,), args, stream=stream)), (pos, s0, s1)[: 1 + G]


def core_inputs(bs, x, ref):
    """The same batch in the core step's terms (batch order)."""
    idx, qsl = x["idx_mapping"], x["query_start_loc"]
    n = idx.shape[0]
    dec = np.where(idx >= 0, x["num_computed_tokens"][np.maximum(idx, 0)], 0).astype(np.int32)
    q = np.diff(qsl).astype(np.int32)
    tables = [cupy.asarray(np.ascontiguousarray(t[:n])) for t in ref.input_block_tables]
    return cupy.asarray(dec), cupy.asarray(q), tables


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--calls", type=int, default=1000, help="eager calls per host-time sample")
    ap.add_argument("--shape", action="append", help="decode:N or mixed:N:T (repeatable)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--host-samples", type=int, default=15, help="interleaved host-time samples per implementation (median)"
    )
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="only the eager host rows (the vLLM step against the core step, memo and no memo), after "
        "checking the vLLM step against the reference; no graph timing",
    )
    ap.add_argument(
        "--attention",
        action="store_true",
        help="only the attention rows: the vLLM step with attention metadata (flashinfer + varlen) on vs off",
    )
    ap.add_argument(
        "--num-blocks-mem",
        choices=("device", "uva"),
        default="device",
        help="uva: only num_blocks in pinned host memory (UVA) against device memory and the uva-floor, graph mode",
    )
    a = ap.parse_args(argv)
    stream = cupy.cuda.Stream(non_blocking=True)
    if a.attention:
        return attention_rows(a, stream)
    if a.num_blocks_mem == "uva":
        return uva_rows(a, stream)
    rows = []
    with stream:
        for shape_text in a.shape or SHAPES:
            for groups in GROUPS:
                bs = make_batch_set(VllmWorkload(block_sizes=groups, input_sets=1), parse_shape(shape_text))
                x = bs.inputs[0]
                ref = vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded).outputs
                d = {
                    k: ([cupy.asarray(t) for t in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()
                }
                args = tuple(d[k] for k in NAMES) + (bs.num_reqs_padded,)
                kw = dict(
                    max_num_reqs=bs.config.max_num_reqs,
                    max_num_batched_tokens=bs.config.max_num_batched_tokens,
                    block_sizes=list(groups),
                    widths=list(bs.config.widths),
                )
                one, three = VllmStepPlanner(**kw), VllmThreeLaunch(**kw)
                dec, q, tables = core_inputs(bs, x, ref)
                core = StepPlanner(
                    max_requests=bs.num_reqs, capacity=bs.config.max_num_batched_tokens, block_sizes=list(groups)
                )
                stream.synchronize()
                # correctness first: the vLLM implementations against the reference
                for impl in (one, *(() if a.host_only else (three,))):
                    name = type(impl).__name__
                    for _ in range(2):  # the second call finds the first one's device state
                        out = impl.compute(*args, stream=stream)
                        stream.synchronize()
                        for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
                            assert np.array_equal(getattr(out, f).get(), getattr(ref, f)), (name, f)
                        for g, t in enumerate(out.input_block_tables):
                            assert np.array_equal(t.get(), ref.input_block_tables[g]), (name, g)
                        if impl is not three:
                            assert impl.errors(stream)[0] == 0, name

                # (the arguments spelled out, as an engine calls it and as run_core does: a star call
                # builds a tuple and a dict per call, which the core step's call did not pay)
                i_, s_, c_, t_, b_, p_ = args
                # vLLM passes new idx_mapping / query_start_loc objects every step (slices of its
                # persistent buffers): K sets of new views of the same memory, taken in turn (the core
                # step: new dec / q views), so compute()'s memo never hits
                views = itertools.cycle([(i_[:], s_[:]) for _ in range(8)])
                core_views = itertools.cycle([(dec[:], q[:]) for _ in range(8)])
                one_new = VllmStepPlanner(**kw)
                core_new = StepPlanner(
                    max_requests=bs.num_reqs, capacity=bs.config.max_num_batched_tokens, block_sizes=list(groups)
                )
                # VllmStepPlanner.bind(): the request state bound once, the batch checked every launch
                one_b = VllmStepPlanner(**kw)
                bound = one_b.bind(c_, t_, b_)
                for _ in range(2):
                    out = bound.launch(*next(views), p_, stream=stream)
                    stream.synchronize()
                    for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
                        assert np.array_equal(getattr(out, f).get(), getattr(ref, f)), ("bind", f)
                    for g, t in enumerate(out.input_block_tables):
                        assert np.array_equal(t.get(), ref.input_block_tables[g]), ("bind", g)
                    assert one_b.errors(stream)[0] == 0, "bind"

                def run_one_new():
                    i, s = next(views)
                    one_new.compute(i, s, c_, t_, b_, p_, stream=stream)

                def run_core_new():
                    d_, q_ = next(core_views)
                    core_new.compute(d_, q_, tables, stream=stream)

                def run_bind_new():
                    i, s = next(views)
                    bound.launch(i, s, p_, stream=stream)

                def run_bind():
                    bound.launch(i_, s_, p_, stream=stream)

                def run_one():
                    one.compute(i_, s_, c_, t_, b_, p_, stream=stream)

                def run_three():
                    three.compute(*args, stream=stream)

                def run_core():
                    core.compute(dec, q, tables, stream=stream)

                if a.host_only:
                    t_one = t_core = t_three = float("nan")
                else:
                    t_one = graph_time_per_copy(run_one, stream, a.copies, a.replays)
                    t_core = graph_time_per_copy(run_core, stream, a.copies, a.replays)
                    t_three = graph_time_per_copy(run_three, stream, a.copies, a.replays)
                got = None if a.host_only else vllm_min_launcher(d, bs.config, stream)
                run_min, t_min = None, float("nan")
                if got is not None:
                    run_min, (pos_min, *slots_min) = got
                    run_min()
                    stream.synchronize()  # the floor computes the reference's positions and slots
                    assert np.array_equal(pos_min.get(), ref.positions), "vllm-min positions"
                    for g, sm_ in enumerate(slots_min):
                        assert np.array_equal(sm_.get(), np.asarray(ref.slot_mappings[g])), ("vllm-min slots", g)
                    t_min = graph_time_per_copy(run_min, stream, a.copies, a.replays)
                # eager host time: the vLLM and the core step memoised, interleaved; then both without
                # the memo (every call checked), interleaved
                hb = {}
                h = host_times(
                    dict(
                        one=run_one,
                        core=run_core,
                        one_new=run_one_new,
                        core_new=run_core_new,
                        bind_new=run_bind_new,
                        bind=run_bind,
                    ),
                    stream,
                    a.calls,
                    a.host_samples,
                    best=hb,
                )
                h_one, h_core = h["one"], h["core"]
                assert one_new._memo is None and core_new._memo is None, "a new-objects row took a memo"
                assert one._memo is not None and core._memo is not None, "the host time was not on the memoised path"
                one.memoize_checks = False  # (forgets the memo)
                core.memoize_checks, core._memo = False, None  # (StepPlanner keeps a memo made before)
                hn = host_times(dict(one=run_one, core=run_core), stream, a.calls, a.host_samples)
                h_one_nm, h_core_nm = hn["one"], hn["core"]
                one.memoize_checks = True
                core.memoize_checks = True
                row = dict(
                    shape=shape_text,
                    groups=list(groups),
                    num_reqs=bs.num_reqs,
                    num_tokens=int(x["query_start_loc"][-1]),
                    max_num_reqs=bs.config.max_num_reqs,
                    widths=list(bs.config.widths),
                    graph_us=dict(
                        vllm_one=t_one,
                        core=t_core,
                        vllm_three=t_three,
                        vllm_min_floor=None if run_min is None else t_min,
                    ),
                    kernel=one.kernel_name,
                    eager_host_us=dict(
                        vllm_one=h_one,
                        core=h_core,
                        vllm_one_no_memo=h_one_nm,
                        core_no_memo=h_core_nm,
                        vllm_one_new_objects=h["one_new"],
                        core_new_objects=h["core_new"],
                        vllm_bind_new_objects=h["bind_new"],
                        vllm_bind=h["bind"],
                    ),
                    host_bind_new_vs_core=h["bind_new"] / h_core,
                    host_bind_new_vs_core_new=h["bind_new"] / h["core_new"],
                    host_one_new_vs_core_new=h["one_new"] / h["core_new"],
                    one_vs_core=t_one / t_core,
                    three_vs_one=t_three / t_one,
                    host_one_vs_core=h_one / h_core,
                    eager_host_best_us=dict(
                        vllm_one=hb["one"],
                        core=hb["core"],
                        vllm_one_new_objects=hb["one_new"],
                        core_new_objects=hb["core_new"],
                        vllm_bind_new_objects=hb["bind_new"],
                        vllm_bind=hb["bind"],
                    ),
                    host_one_vs_core_best=hb["one"] / hb["core"],
                    host_one_no_memo_vs_core_no_memo=h_one_nm / h_core_nm,
                )
                if a.host_only:  # (no graph times)
                    for k in ("graph_us", "one_vs_core", "three_vs_one"):
                        del row[k]
                rows.append(row)
                host_text = (
                    f"eager host us: one {h_one:6.2f} core {h_core:6.2f} "
                    f"one/core {h_one / h_core:5.2f} ("
                    f"best {hb['one']:5.2f}/{hb['core']:5.2f} = {hb['one'] / hb['core']:4.2f}) "
                    f"| no memo: one {h_one_nm:6.2f} core {h_core_nm:6.2f}\n{'':>20}new batch objects every call: "
                    f"one compute() {h['one_new']:6.2f} core compute() {h['core_new']:6.2f} (one/core "
                    f"{h['one_new'] / h['core_new']:4.2f}) | one bind(): launch {h['bind_new']:6.2f} "
                    f"(/core memo {h['bind_new'] / h_core:4.2f}, /core new {h['bind_new'] / h['core_new']:4.2f}; "
                    f"best {hb['bind_new']:5.2f}/{hb['core']:5.2f} = {hb['bind_new'] / hb['core']:4.2f}) "
                    f"| bind, same objects {h['bind']:6.2f}"
                )
                if a.host_only:
                    print(f"{shape_text:>16} G={len(groups)}  {host_text}", flush=True)
                    continue
                extra = ""
                if run_min is not None:
                    row["three_over_four_below_floor"] = t_three / 4 < t_min
                    extra += (
                        f"  vllm-min {t_min:6.2f} (three/4 {t_three / 4:5.2f}"
                        f"{': below the floor' if t_three / 4 < t_min else ''})"
                    )
                print(
                    f"{shape_text:>16} G={len(groups)}  graph us: one {t_one:6.2f}  "
                    f"core {t_core:6.2f}  three {t_three:6.2f}{extra}\n"
                    f"{'':>20}one/core {t_one / t_core:5.2f}  three/one {t_three / t_one:5.2f}  "
                    f"| {host_text}",
                    flush=True,
                )
    if a.json:
        dev = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        with open(a.json, "w") as fh:
            json.dump({"device": dev.decode() if isinstance(dev, bytes) else dev, "rows": rows}, fh, indent=2)
    return 0


def attention_rows(a, stream) -> int:
    """The vLLM step with ``attention=("flashinfer", "varlen")`` against the step without, graph mode,
    per shape and group count; both first checked against the reference (the metadata included)."""
    rows = []
    attention = ("flashinfer", "varlen")
    with stream:
        for shape_text in a.shape or SHAPES:
            for groups in GROUPS:
                bs = make_batch_set(VllmWorkload(block_sizes=groups, input_sets=1), parse_shape(shape_text))
                x = bs.inputs[0]
                plain_ref = vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded).outputs
                # N: the batch's own bound, its pages in the group with the smallest block size (as
                # benchmarks/bench_attention.py sizes the core step's; every entry past the used ones
                # is rewritten by every call, so a larger N costs its pad)
                pages = max(int((-(-plain_ref.seq_lens.astype(np.int64) // B)).sum()) for B in groups)
                N = max(pages, 1)
                want = vllm_step_reference(
                    bs.config, **x, num_reqs_padded=bs.num_reqs_padded, attention=attention, kv_indices_capacity=N
                )
                d = {
                    k: ([cupy.asarray(t) for t in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()
                }
                args = tuple(d[k] for k in NAMES) + (bs.num_reqs_padded,)
                kw = dict(
                    max_num_reqs=bs.config.max_num_reqs,
                    max_num_batched_tokens=bs.config.max_num_batched_tokens,
                    block_sizes=list(groups),
                    widths=list(bs.config.widths),
                )
                off = VllmStepPlanner(**kw)
                on = VllmStepPlanner(**kw, attention=attention, kv_indices_capacity=N)
                for impl in (off, on):
                    for _ in range(2):
                        out = impl.compute(*args, stream=stream)
                        stream.synchronize()
                        for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
                            assert np.array_equal(getattr(out, f).get(), getattr(want.outputs, f)), f
                        assert impl.errors(stream) == (want.error_mask, want.error_key)
                        if impl is not off:
                            w = want.outputs.attention
                            for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k"):
                                assert np.array_equal(getattr(out.attention, f).get(), getattr(w, f)), f
                            assert int(out.attention.max_seqlen_q.get()) == int(w.max_seqlen_q)
                            assert out.attention.max_seqlen_k.get().tolist() == w.max_seqlen_k.tolist()
                t_off = graph_time_per_copy(lambda: off.compute(*args, stream=stream), stream, a.copies, a.replays)
                t_on = graph_time_per_copy(lambda: on.compute(*args, stream=stream), stream, a.copies, a.replays)
                row = dict(
                    shape=shape_text,
                    groups=list(groups),
                    num_reqs=bs.num_reqs,
                    kv_indices_capacity=N,
                    kv_entries=int(max(w_[-1] for w_ in want.outputs.attention.kv_indptr)),
                    meta_rows=on.meta_rows,
                    graph_us=dict(attention_off=t_off, attention_on=t_on),
                    on_vs_off=t_on / t_off,
                )
                rows.append(row)
                print(
                    f"{shape_text:>16} G={len(groups)}  attention graph us: off {t_off:6.2f}  on {t_on:6.2f}  "
                    f"on/off {t_on / t_off:4.2f}  ({on.meta_rows} batch rows per metadata block)",
                    flush=True,
                )
    if a.json:
        dev = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        with open(a.json, "w") as fh:
            json.dump({"device": dev.decode() if isinstance(dev, bytes) else dev, "attention_rows": rows}, fh, indent=2)
    return 0


def uva_rows(a, stream) -> int:
    """``--num-blocks-mem uva``: the vLLM step with ``num_blocks`` in pinned host memory (UVA) against
    the step with it in device memory, and the uva-floor, graph mode; each first checked."""
    import ctypes

    from kvaddr import kernel_loader
    from kvaddr.measure.vllm_workload import pinned_num_blocks
    from kvaddr.validation import mapped_pointer

    class FloorArgs(ctypes.Structure):  # the staged-floor kernels' parameters, in order
        _fields_ = [
            ("idx", ctypes.c_uint64),
            ("nb_addr", ctypes.c_uint64),
            ("stride", ctypes.c_int64),
            ("copy", ctypes.c_uint64),
            ("G", ctypes.c_int32),
            ("M", ctypes.c_int32),
            ("n", ctypes.c_int32),
            ("out", ctypes.c_uint64),
        ]

    rows, missed = [], False
    mod = cupy.RawModule(code=UVA_FLOOR_SOURCE)
    fn = mod.get_function("uva_floor")
    programmatic = kernel_loader.programmatic_launch_supported(cupy.cuda.runtime.getDevice())
    with stream:
        for shape_text in a.shape or SHAPES:
            for groups in GROUPS:
                bs = make_batch_set(VllmWorkload(block_sizes=groups, input_sets=1), parse_shape(shape_text))
                x = bs.inputs[0]
                ref = vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded).outputs
                d = {k: cupy.asarray(x[k]) for k in NAMES[:3]}
                d["block_tables"] = [cupy.asarray(t) for t in x["block_tables"]]
                stacked = np.stack(x["num_blocks"]).astype(np.int32)  # vLLM's layout: one [G, rows] array
                nb_dev = cupy.asarray(stacked)
                # the pinned array and a CuPy array at its device pointer (vLLM's CUDA view of its pinned
                # tensor): the view is timed (a CuPy array: compute()'s memo holds); both are checked
                nb_host, nb_uva = pinned_num_blocks(stacked)
                kw = dict(
                    max_num_reqs=bs.config.max_num_reqs,
                    max_num_batched_tokens=bs.config.max_num_batched_tokens,
                    block_sizes=list(groups),
                    widths=list(bs.config.widths),
                )
                dev, uva = VllmStepPlanner(**kw), VllmStepPlanner(**kw)
                stream.synchronize()

                def run(planner, nb):
                    return planner.compute(
                        d["idx_mapping"],
                        d["query_start_loc"],
                        d["num_computed_tokens"],
                        d["block_tables"],
                        nb,
                        bs.num_reqs_padded,
                        stream=stream,
                    )

                pinned = VllmStepPlanner(**kw)
                for name, planner, nb in (("device", dev, nb_dev), ("uva", uva, nb_uva), ("pinned", pinned, nb_host)):
                    for _ in range(2):
                        out = run(planner, nb)
                        stream.synchronize()
                        for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
                            assert np.array_equal(getattr(out, f).get(), getattr(ref, f)), (name, f)
                        for g, t in enumerate(out.input_block_tables):
                            assert np.array_equal(t.get(), ref.input_block_tables[g]), (name, g)
                        assert planner.errors(stream)[0] == 0, name
                # the floor: its outputs are num_blocks[g][idx[b]] (0 for a dummy entry)
                idx_h = x["idx_mapping"].astype(np.int32)
                n, G = len(idx_h), len(groups)
                idx32 = cupy.asarray(idx_h)
                floor_out = cupy.full((G, max(n, 1)), -7, np.int32)
                addr = mapped_pointer("num_blocks", nb_host.ctypes.data)
                fargs = (idx32, np.uint64(addr), np.int64(stacked.shape[1]), np.int32(G), np.int32(n), floor_out)

                def run_floor():
                    fn(((n + 255) // 256,), (256,), fargs, stream=stream)

                run_floor()
                stream.synchronize()
                want = np.where(idx_h >= 0, stacked[:, np.maximum(idx_h, 0)], 0)
                assert np.array_equal(floor_out.get()[:, :n], want), "uva-floor"
                # the staged-floor: the copy, then the reader as its programmatic dependent
                M = bs.config.max_num_reqs
                copy = cupy.zeros((G, M), np.int32)
                sf_out = cupy.full((G, max(n, 1)), -7, np.int32)
                sf_args = FloorArgs(idx32.data.ptr, addr, stacked.shape[1], copy.data.ptr, G, M, n, sf_out.data.ptr)
                first = kernel_loader.DependentLaunch(
                    int(mod.get_function("staged_floor_copy").kernel.ptr), -(-M // 256), 256, programmatic=programmatic
                )
                sf = kernel_loader.Launcher(mod.get_function("staged_floor_read").kernel, sf_args, launch_kernel=first)

                def run_staged_floor():
                    sf(max(1, -(-n // 256)), 256, stream.ptr)

                run_staged_floor()
                stream.synchronize()
                assert np.array_equal(sf_out.get()[:, :n], want), "staged-floor"
                assert uva.staged and not dev.staged, "num_blocks in pinned host memory is staged"
                t_dev = graph_time_per_copy(lambda: run(dev, nb_dev), stream, a.copies, a.replays)
                t_uva = graph_time_per_copy(lambda: run(uva, nb_uva), stream, a.copies, a.replays)
                t_floor = graph_time_per_copy(run_floor, stream, a.copies, a.replays)
                t_sfloor = graph_time_per_copy(run_staged_floor, stream, a.copies, a.replays)
                r_dev, r_floor, r_sfloor = t_uva / t_dev, t_uva / t_floor, t_uva / t_sfloor
                ok = r_dev <= UVA_BOUNDS[0] or r_floor <= UVA_BOUNDS[1]
                ok_staged = r_sfloor <= UVA_BOUNDS[1]
                missed |= not ok
                rows.append(
                    dict(
                        shape=shape_text,
                        groups=list(groups),
                        num_reqs=bs.num_reqs,
                        graph_us=dict(
                            num_blocks_device=t_dev, num_blocks_uva=t_uva, uva_floor=t_floor, staged_floor=t_sfloor
                        ),
                        uva_vs_device=r_dev,
                        uva_vs_floor=r_floor,
                        uva_vs_staged_floor=r_sfloor,
                        programmatic=programmatic,
                        within_bound=ok,
                        within_staged_floor_bound=ok_staged,
                    )
                )
                print(
                    f"{shape_text:>16} G={len(groups)}  graph us: num_blocks device {t_dev:6.2f}  uva {t_uva:6.2f}  "
                    f"uva-floor {t_floor:6.2f}  staged-floor {t_sfloor:6.2f}  | uva/device {r_dev:5.2f} "
                    f"(bound {UVA_BOUNDS[0]})  uva/floor {r_floor:5.2f} (bound {UVA_BOUNDS[1]})  "
                    f"{'PASS' if ok else 'FAIL'}  uva/staged-floor {r_sfloor:5.2f} (bound {UVA_BOUNDS[1]})  "
                    f"{'PASS' if ok_staged else 'FAIL'}",
                    flush=True,
                )
    if a.json:
        dev_name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        with open(a.json, "w") as fh:
            name = dev_name.decode() if isinstance(dev_name, bytes) else dev_name
            json.dump({"device": name, "num_blocks_uva_rows": rows}, fh, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
