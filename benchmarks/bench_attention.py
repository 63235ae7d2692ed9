"""Benchmark of the attention outputs of the fused step (docs/attention.md, issue 14).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_attention.py [--json FILE]

Graph mode, as benchmarks/bench_step.py: N copies of one call captured in one CUDA
graph; time per copy is the replay time (CUDA events, median of R replays) over N.

1. The fused step with every attention output on (flashinfer, varlen, page_table;
   kv_indices_capacity = the step's own bound, sum over requests of ceil(L_b / B)) against
   the fused step without them, at 64, 1024 and 4096 decode requests (context 1k-32k,
   B = 64) and on 256 requests carrying ~16k tokens (mixed lengths), with 1 and 2 caches
   (one shared table). Bound: on/off <= 1.5.
2. The big kv_indices case: 4096 requests x 32k context, B = 16 (~8M entries per step):
   the kv_indices write's achieved bandwidth, (bytes read + bytes written) / (fused with
   flashinfer - fused without), against a device-to-device copy (cudaMemcpyAsync) of the
   same byte count timed the same way in the same run. Bound: >= 50% of the copy's.

Both metadata implementations are timed in the same run (StepPlanner._set_meta_impl): "old"
(0, kv_meta_block: every metadata block rescans all lengths) and "new" (1, kv_meta_block2:
request-parallel, at each --lanes value) and "pf" (2: request-parallel with an L2 prefetch
of the rows, at the first --lanes value) and "E4" (request-parallel with a quarter of the
metadata blocks, E x 4), and "one" (3, kv_meta_block3: request-parallel in one round, one
barrier, the first row loads in flight across it) at each --lanes3 value, with its timing
ablations (at the first --lanes3 value; their outputs are wrong, timing only): "-np" without the
pass over all lengths, "-nc" without the row copy, "-nb" without both (the block's skeleton).
These run on kvaddr_step_* (``use_kernel("v8")``: its metadata blocks at every batch size).

The small-batch kernel with attention outputs (kvaddr_step1m_c{G}_*, the planner's default
for bsz <= 256: v9's token blocks + request-per-thread metadata blocks) is timed on the
shapes it runs (decode 1, decode 64, the mixed batch; "-" elsewhere), as "m3" (session 12's
metadata blocks, the planner's default: a warp per request, v9's block width) and its variants:
"m3-t256" (blocks of 256 threads: fewer, wider metadata blocks), "m3-k1" / "m3-k8" (1 / 8
metadata blocks per cache: several requests per warp, the rows loaded again before the
barrier), and the timing ablation "m3-e" (metadata blocks that return at once: the cost of
launching them; outputs wrong, timing only). Sessions 5 and 11's variants (lanes per
request, the EARLY / LEAN code paths and the copy / outputs / pad ablations, "m1*" / "m2*")
left the kernel in session 12; their figures are in docs/perf-notes.md.

v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*, the planner's default for
256 < bsz <= 4096, session 13: v9's wide token blocks + a metadata block per T / 32 requests, a
warp copying each request's row, and pad blocks) is timed on decode 1024 and 4096 as "wm" (the
default: R = 4, blocks of up to 1024 threads) and its variants: "wm-r8" / "wm-r16" (R forced:
narrower blocks, more of them), "wm-a128" (the token kernel's block aim, 128 threads), "wm-p"
(M1_ROWS_BY_PAGES: a warp loads its row's columns below the request's pages only) and the
timing ablation "wm-e" (metadata blocks that return after their loads). The kv_indices bandwidth
case runs the default (wm).

3. Floors under the bound (session 14), for every shape of 1.: two kernels in one launch each, timed the
   same way beside the fused step, that move only the bytes the attention outputs must move on every
   call and do nothing else (no lengths, no scans, no checks; CUDA source below, an instrument).
   "floor-w" writes every cache's batch-order page table (bsz x width) and its used kv_indices
   entries (sum of ceil(L_b / B)) with a constant: the writes no step can skip. "floor-c" also reads
   that many table entries once and writes them into both outputs of every cache: a copy of the used
   block ids. Each runs with 1, 2, 4 and 8 blocks per SM (512 threads) and the fastest counts. Where
   floor-c alone costs more than 1.5x the step without outputs, the bound is below what the H200
   needs to move the outputs' bytes, whatever the kernel computes.

The verdict (and the exit status) is the planner's default: m3 or wm where they run, else new
(the first --lanes value, E as built); the "v8" column gives new's verdict everywhere, "best"
the fastest variant with correct outputs; the other columns are for the perf notes.
--quick times only off, new and the m3 / wm variants (no old / pf / E4 / one columns).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step

from kvaddr import StepPlanner

ALL = ("flashinfer", "varlen", "page_table")

# The floors of section 3: int4 stores over one cache's page table (n_pt4 int4) and its used kv_indices
# entries (n_kv4 int4, the first of the page table's int4 range), repeated for G caches. floor-c reads
# the first n_kv4 int4 of the table (the used block ids' count) and stores them into both outputs.
FLOOR_SOURCE = r"""
extern "C" __global__ void attn_floor(const int4* __restrict__ table,  // [>= n_kv4] int4 (floor-c only)
                                      int4* __restrict__ pt,           // [G * n_pt4] int4
                                      int4* __restrict__ kv,           // [G * n_kv4] int4
                                      long long n_pt4, long long n_kv4, int G, int copy) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_pt4; i += stride) {
        const bool used = i < n_kv4;
        const int4 v = (copy && used) ? table[i] : make_int4(-1, -1, -1, -1);
        for (int g = 0; g < G; ++g) {
            pt[g * n_pt4 + i] = v;
            if (used) kv[g * n_kv4 + i] = v;
        }
    }
}
"""


@functools.cache
def floor_kernel():
    return cupy.RawModule(code=FLOOR_SOURCE).get_function("attn_floor")


def floor_times(table, pages, G, stream, copies, replays):
    """(floor-w, floor-c) in us: the fastest of 1, 2, 4, 8 blocks per SM (section 3)."""
    fn = floor_kernel()
    n_pt4, n_kv4 = -(-table.size // 4), -(-pages // 4)
    src = cupy.zeros(n_pt4 * 4, np.int32)
    src[: table.size] = table.ravel()
    pt, kv = cupy.empty(G * n_pt4 * 4, np.int32), cupy.empty(G * n_kv4 * 4, np.int32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    out = []
    for copy in (0, 1):
        args = (src, pt, kv, np.int64(n_pt4), np.int64(n_kv4), np.int32(G), np.int32(copy))
        out.append(
            min(
                graph_time_per_copy(lambda: fn((m * sms,), (512,), args, stream=stream), stream, copies, replays)
                for m in (1, 2, 4, 8)
            )
        )
    return tuple(out)


def graph_time_per_copy(launch, stream, copies, replays):
    """Median GPU time per copy of ``launch`` over graph replays (bench_step's, without the samples)."""
    return bench_step.graph_time_per_copy(launch, stream, copies, replays)[0]


def make_batch(rng, bsz, per, B, *, mixed=False, ctx=(1024, 32768)):
    """Decode lengths drawn from ctx; per tokens each (mixed: 1..2*per-1, same mean)."""
    q = rng.integers(1, 2 * per, size=bsz) if mixed else np.full(bsz, per)
    q = q.astype(np.int32)
    dec = (rng.integers(ctx[0], ctx[1], size=bsz) if ctx[0] < ctx[1] else np.full(bsz, ctx[0])).astype(np.int32)
    L = dec.astype(np.int64) + q
    width = int(-(-L.max() // B))
    table = rng.permutation(bsz * width).astype(np.int32).reshape(bsz, width)
    pages = int((-(-L // B)).sum())
    return cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table), int(q.sum()), pages


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--lanes", default="32", help="kv_meta_block2 lanes per request to time (first: the verdict)")
    ap.add_argument("--lanes3", default="32,16,8", help="kv_meta_block3 lanes per request to time (first: ablations)")
    ap.add_argument("--quick", action="store_true", help="only off, new (first --lanes) and the m3 variants")
    a = ap.parse_args(argv)
    lanes = [int(x) for x in a.lanes.split(",") if x]
    lanes3 = [int(x) for x in a.lanes3.split(",") if x]
    NP, NC = StepPlanner.META_NO_PREFIX, StepPlanner.META_NO_COPY
    # (name, meta_impl, lanes, E multiple, ablate): E x4 = a quarter of the metadata blocks, each 4x fatter
    variants = (
        [("old", 0, 32, 1, 0)]
        + [(f"new{n}", 1, n, 1, 0) for n in lanes]
        + [(f"pf{lanes[0]}", 2, lanes[0], 1, 0), (f"new{lanes[0]}E4", 1, lanes[0], 4, 0)]
        + [(f"one{n}", 3, n, 1, 0) for n in lanes3]
        + [
            (f"one{lanes3[0]}{tag}", 3, lanes3[0], 1, bits)
            for tag, bits in (("-np", NP), ("-nc", NC), ("-nb", NP | NC))
        ]
    )
    if a.quick:
        variants = [v for v in variants if v[0] == f"new{lanes[0]}"]
    # kvaddr_step1m_* (bsz <= 256): (name, _set_one_meta keywords)
    F = StepPlanner
    m3_variants = [
        ("m3", dict(blocks=0, min_threads=0, flags=0)),  # the planner's default
        ("m3-t256", dict(blocks=0, min_threads=256, flags=0)),
        ("m3-k1", dict(blocks=1, min_threads=0, flags=0)),
        ("m3-k8", dict(blocks=8, min_threads=0, flags=0)),
        ("m3-e", dict(blocks=0, min_threads=0, flags=F.M1_EMPTY)),  # outputs wrong: timing only
    ]
    # kvaddr_step1wm* (256 < bsz <= 4096): (name, R (0: the planner's), wide_meta_threads aim, flags)
    wm_variants = [
        ("wm", 0, StepPlanner.wide_meta_threads, 0),  # the planner's default (R = 4: T up to 1024)
        ("wm-r8", 8, StepPlanner.wide_meta_threads, 0),
        ("wm-r16", 16, StepPlanner.wide_meta_threads, 0),
        ("wm-a128", 0, 128, 0),  # the token kernel's block aim: R = 8 at 1024 requests, 16 at 4096
        ("wm-p", 0, StepPlanner.wide_meta_threads, F.M1_ROWS_BY_PAGES),  # row loads bounded by the pages
        ("wm-e", 0, StepPlanner.wide_meta_threads, F.M1_EMPTY),  # outputs wrong: timing only
    ]
    ablated = (
        {v[0] for v in variants if v[4]}
        | {n for n, kw in m3_variants if kw["flags"]}
        | {v[0] for v in wm_variants if v[3] & F.M1_EMPTY}
    )
    verdict = f"new{lanes[0]}"
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        shapes = [
            ("decode 1", 1, 1, False),
            ("decode 64", 64, 1, False),
            ("decode 1024", 1024, 1, False),
            ("decode 4096", 4096, 1, False),
            ("256 req, mixed (~16k)", 256, 64, True),
        ]
        B = 64
        for label, bsz, per, mixed in shapes:
            # (decode 1 draws from its own generator: the other shapes' batches stay those of earlier runs)
            r = np.random.default_rng(1) if bsz == 1 else rng
            dec, q, table, total, pages = make_batch(r, bsz, per, B, mixed=mixed)
            for G in (1, 2):
                off = StepPlanner(bsz, total, [B] * G)
                on = StepPlanner(bsz, total, [B] * G, attention=ALL, kv_indices_capacity=pages)
                t_off = graph_time_per_copy(
                    lambda: off.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
                )
                row = dict(shape=label, caches=G, entries=pages, off_us=t_off, bound=1.5)
                on.use_kernel("v8")  # kvaddr_step_* with its metadata blocks at every batch size
                for name, impl, n, mult, bits in variants:
                    on._set_meta_impl(impl, n, entries=on._meta_entries_min * mult, ablate=bits)
                    row[name + "_us"] = graph_time_per_copy(
                        lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
                    )
                    if not bits:  # an ablation's outputs (and so its records) are wrong by design
                        on.check(stream)
                on._set_meta_impl(1, lanes[0], entries=on._meta_entries_min)
                on.use_kernel("v9")  # the planner's default: kvaddr_step1m_* for bsz <= 256
                small = on.kernel_for(bsz)[0].startswith("kvaddr_step1m_")
                for name, kw in m3_variants:
                    row[name + "_us"] = None
                    if not small:
                        continue
                    on._set_one_meta(**kw)
                    row[name + "_geometry"] = list(on.kernel_for(bsz)[1:])
                    row[name + "_us"] = graph_time_per_copy(
                        lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
                    )
                    if not kw["flags"]:
                        on.check(stream)
                on._set_one_meta(blocks=0, min_threads=0, flags=0)  # the planner's default again
                wide = on.kernel_for(bsz)[0].startswith("kvaddr_step1wm")
                for name, r, aim, flags in wm_variants:
                    row[name + "_us"] = None
                    if not wide:
                        continue
                    on.wide_meta_threads = aim
                    on.use_kernel("v9", wide_per_thread=r)
                    on._set_one_meta(flags=flags)
                    row[name + "_geometry"] = list(on.kernel_for(bsz))
                    row[name + "_us"] = graph_time_per_copy(
                        lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
                    )
                    if not flags & F.M1_EMPTY:
                        on.check(stream)
                on.wide_meta_threads = StepPlanner.wide_meta_threads
                on.use_kernel("v9", wide_per_thread=0)
                on._set_one_meta(flags=0)
                row["v8_us"] = row[verdict + "_us"]
                row["default"] = "m3" if small else "wm" if wide else verdict
                row["on_us"] = row[row["default"] + "_us"]
                row["ratio"] = row["on_us"] / t_off
                row["floor_w_us"], row["floor_c_us"] = floor_times(table, pages, G, stream, a.copies, a.replays)
                rows.append(row)

        # The big kv_indices write: 4096 x 32k, B = 16.
        bsz, Bb = 4096, 16
        dec, q, table, total, pages = make_batch(rng, bsz, 1, Bb, ctx=(32767, 32767))
        off = StepPlanner(bsz, total, [Bb])
        on = StepPlanner(bsz, total, [Bb], attention=("flashinfer",), kv_indices_capacity=pages)
        on.use_kernel("v8")
        t_off = graph_time_per_copy(lambda: off.compute(dec, q, table, stream=stream), stream, a.copies, a.replays)
        t_impl = {}
        for name, impl, n, mult, bits in variants:
            on._set_meta_impl(impl, n, entries=on._meta_entries_min * mult, ablate=bits)
            t_impl[name] = graph_time_per_copy(
                lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
            )
            if not bits:
                on.check(stream)
        on.use_kernel("v9")  # the planner's default: kvaddr_step1wm4_c1_* for 4096 requests
        on._set_one_meta(flags=F.M1_ROWS_BY_PAGES)
        t_impl["wm-p"] = graph_time_per_copy(
            lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
        )
        on.check(stream)
        on._set_one_meta(flags=0)
        t_impl["wm"] = graph_time_per_copy(
            lambda: on.compute(dec, q, table, stream=stream), stream, a.copies, a.replays
        )
        on.check(stream)
        t_on = t_impl["wm"]
        nbytes = pages * 4
        src = cupy.arange(pages, dtype=np.int32)
        dst = cupy.empty_like(src)
        t_copy = graph_time_per_copy(
            lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), stream, a.copies, a.replays
        )
        moved = 2 * nbytes  # read + write, for both
        kv_us = max(t_on - t_off, 1e-9)
        big = dict(
            shape="4096 x 32k, B = 16",
            entries=pages,
            off_us=t_off,
            on_us=t_on,
            kv_indices_us=kv_us,
            kv_indices_gbs=moved / kv_us / 1e3,
            copy_us=t_copy,
            copy_gbs=moved / t_copy / 1e3,
        )
        big["ratio"] = big["kv_indices_gbs"] / big["copy_gbs"]
        big["variants"] = {
            name: dict(on_us=t, share=(moved / max(t - t_off, 1e-9) / 1e3) / big["copy_gbs"])
            for name, t in t_impl.items()
        }
        big["bound"] = 0.5

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}; graph mode, {a.copies} copies per graph, median of {a.replays} replays")
    names = [v[0] for v in variants] + [n for n, _ in m3_variants] + [v[0] for v in wm_variants]
    ok = True

    def cell(r, n, unit):
        t = r[n + "_us"]
        if t is None:
            return f"{'-':>11}"
        return f"{(t if unit == 'us' else t / r['off_us']):>11.3f}"

    for unit in ("us", "/off"):  # two tables: times, then ratios to off
        head = "".join(f"{n:>11}" for n in names)
        tail = f"  default (<= 1.5)        v8 {verdict}  best" if unit == "/off" else ""
        print(f"{'shape [' + unit + ']':<24}{'caches':>7}{'entries':>10}{'off us':>9}{head}{tail}")
        for r in rows:
            off = r["off_us"]
            cols = "".join(cell(r, n, unit) for n in names)
            line = f"{r['shape']:<24}{r['caches']:>7}{r['entries']:>10}{off:>9.3f}{cols}"
            if unit == "/off":
                good = r["ratio"] <= r["bound"]
                ok &= good
                good8 = r["v8_us"] / off <= r["bound"]
                timed = [n for n in names if n not in ablated and r[n + "_us"] is not None]
                best = min(timed, key=lambda n: r[n + "_us"])
                r["best"] = best
                verdict_txt = f"{r['default']} {r['ratio']:.2f} {'ok' if good else 'OVER BOUND'}"
                line += (
                    f"  {verdict_txt:<23}{r['v8_us'] / off:.2f} {'ok' if good8 else 'OVER':<7}"
                    f"{best} {r[best + '_us'] / off:.2f}"
                )
            print(line)
    print(
        "floors (section 3): us and /off; 'below the floor' where floor-c alone is over 1.5x off"
        f"\n{'shape':<24}{'caches':>7}{'off us':>9}{'on us':>9}{'bound us':>9}{'floor-w':>9}{'floor-c':>9}"
        f"{'on/off':>8}{'w/off':>8}{'c/off':>8}{'on/c':>8}"
    )
    for r in rows:
        off, fw, fc = r["off_us"], r["floor_w_us"], r["floor_c_us"]
        r["bound_below_floor"] = fc > r["bound"] * off
        print(
            f"{r['shape']:<24}{r['caches']:>7}{off:>9.3f}{r['on_us']:>9.3f}{r['bound'] * off:>9.3f}{fw:>9.3f}"
            f"{fc:>9.3f}{r['ratio']:>8.2f}{fw / off:>8.2f}{fc / off:>8.2f}{r['on_us'] / fc:>8.2f}"
            + ("  bound below the floor" if r["bound_below_floor"] else "")
        )
    print(
        "m3 launch geometry (blocks, threads) per shape: "
        + "; ".join(f"{r['shape']} x{r['caches']}: {r['m3_geometry']}" for r in rows if r.get("m3_geometry"))
    )
    print(
        "wm launch geometry (kernel, blocks, threads) per shape: "
        + "; ".join(f"{r['shape']} x{r['caches']}: {r['wm_geometry']}" for r in rows if r.get("wm_geometry"))
    )
    for n in [v[0] for v in variants] + ["wm-p", "wm"]:
        v = big["variants"][n]
        print(f"kv_indices, {big['shape']}, {n}: fused {v['on_us']:.2f} us, {v['share']:.0%} of the copy's bandwidth")
    good = big["ratio"] >= big["bound"]
    ok &= good
    print(
        f"kv_indices, {big['shape']}: {big['entries']} entries, fused {big['off_us']:.2f} us -> "
        f"{big['on_us']:.2f} us with flashinfer (wm, the default): {big['kv_indices_us']:.2f} us, {big['kv_indices_gbs']:.0f} GB/s "
        f"(read + write) vs a device-to-device copy of the same bytes {big['copy_us']:.2f} us, "
        f"{big['copy_gbs']:.0f} GB/s: {big['ratio']:.0%} ({'ok' if good else 'UNDER BOUND'}, >= 50%)"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=dev, copies=a.copies, replays=a.replays, graph=rows, kv_indices=big), fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
