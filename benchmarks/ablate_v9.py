"""Issue 16: where v9's 0.6-0.8 us over decode-out goes, in ONE run (docs/perf-notes.md, v9).

v9 (``kvaddr_step1_c{G}_i64``) at decode 1 and 64 costs 1.57-1.66x the decode-out floor of
``floor_step.py``. This times, side by side and the way ``floor_step.py`` does (graph mode,
N copies of one launch per graph, median of R replays, us per copy), on decode batches of
1, 64 and 256 requests (capacity = batch) with one and two caches:

``decode-out``
    ``floor_step.py``'s floor kernel (13 scalar arguments, ``<<<ceil(C / 256), 256>>>``).
``decode-out @T``
    The same kernel launched with v9's geometry (``<<<1, T>>>``, T = v9's block width).
``decode-out, struct``
    The same work reading its arguments from ``KvStepParams`` (v9's one by-value struct),
    ``kvaddr_abl_floor_out_c{G}``: what passing the struct costs.
``v9`` / ``v9-old`` / ``v9 (launcher)``
    ``StepPlanner.compute`` with the library's default (``kvaddr_step1_c{G}_i64``: since round 2
    ``KV_V9_DEFAULT`` = params in regs + decode-first + lean, mask 416), ``compute`` with ``use_kernel("v9-old")`` (``kvaddr_step1old_c{G}_i64``, v9 as first
    shipped), and v9-old recompiled in the ablation module (mask 0), launched bare with the
    planner's struct (the last two should agree: the same code). Phase costs are against mask 0.
``- <phase>``
    v9 with one phase skipped (``kvaddr_step1_abl_c{G}_m{MASK}``, the ``KV_ABL_*`` bits of
    ``kv_step_one``; timing only, outputs may be wrong): error-record stores, request
    checks, scan + barriers + search (decode assumed), padding stores, per-request
    outputs, token checks; ``- all but outputs`` does decode-out's work (its ratio to
    decode-out is what the struct, the launch geometry and the leftovers cost), ``- all``
    less than that. ``unguarded length loads`` (``KV_ABL_UNGUARDED_LOADS``): every thread
    loads its lengths without waiting for bsz (v9 reads bsz, compares, and only then the
    length pointers from the struct: two dependent constant loads before the first global
    one); the length arrays here live in 1024-entry allocations, so those reads stay in
    bounds.
``fix: ...``
    Candidate fixes (correct: ``tests/gpu/test_ablate_v9_gpu.py`` checks them against the
    NumPy reference): ``params in regs`` (``KV_ABL_PARAM_REGS``: every struct field read
    into a register at entry; v9 reads bsz, compares, and only then the length pointers),
    ``decode-first`` (``KV_FIX_DECODE_FIRST``: one vote "every request is decode" replaces
    the scan, which runs only when the vote fails), ``lean`` (``KV_FIX_LEAN``: pos / B once
    per token), decode-first + lean, all three (mask 416, the library's code).
    ``all three - error stores`` (417) shows what the error-record merge still costs after the
    three fixes: since the sixth session records are sticky (a clean warp only votes and
    writes nothing, no kernel clears records), so the fifth session's record variants
    (clearing loop, late clear, 16-byte records: masks 1024-12704) are gone.
    Each fix's outputs and error record (and v9-old's) are compared with v9's before timing.

Then issue 16's verdicts for v9 and each fix (``floor_step.py``'s targets: at most 1.25x
decode-out; at decode 1 also no slower than one-block; the second cache at most +0.15 us).

    PYTHONPATH=. python benchmarks/ablate_v9.py [--copies 200] [--replays 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import B, graph_time_per_copy, make_batch
from floor_step import SOURCE as FLOOR_SOURCE

from kvaddr import StepPlanner, kernel_loader
from kvaddr.outputs import OUTPUT_FIELDS
from kvaddr.strategies.gpu import OneBlock
from tests.support.ablation import ablation_source

#: (label, mask) of the ablation variants: kv_step_one's KV_ABL_* bits (kvaddr/kernels.cu).
ABLATIONS = [
    ("- error-record stores", 1),
    ("- request checks", 2),
    ("- scan, barriers, search", 4),
    ("- padding stores", 8),
    ("- per-request outputs", 16),
    ("- token checks", 64),
    ("- all but outputs", 79),
    ("- all", 95),
    ("- all, params in regs", 127),
    ("unguarded length loads", 512),
    ("- all but outputs, unguarded", 591),
]
#: (label, mask) of all three fixes (416) less the error-record merge: its cost after them.
ERR_ON_416 = [
    ("all three - error stores", 417),
]
#: (label, mask) of the candidate fixes: KV_FIX_* bits (correct kernels).
FIXES = [
    ("fix: params in regs", 32),
    ("fix: decode-first", 128),
    ("fix: lean", 256),
    ("fix: decode-first + lean", 384),
    ("fix: all three", 416),
]
#: KV_V9_DEFAULT: what the library's kvaddr_step1_c* instantiate (StepPlanner's "v9" since round 2)
DEFAULT = 416
SHAPES = [("decode 1", 1), ("decode 64", 64), ("decode 256", 256)]


def ablation_module():
    """kernels.cu's head and v9 section with ``KV_ABLATION``: v9's ablation and fix kernels
    (tests/support/ablation.py; the GPU tests build the same string: one compile per machine)."""
    return cupy.RawModule(code=ablation_source(), options=kernel_loader.COMPILE_OPTIONS)


def v9_launcher(module, planner, mask, G):
    """A bare launch of ``kvaddr_step1_abl_c{G}_m{mask}`` with ``planner``'s struct and v9's geometry."""
    fn = module.get_function(f"kvaddr_step1_abl_c{G}_m{mask}").kernel  # the Function takes a stream
    return kernel_loader.Launcher(fn, planner._params, by_value=True)


def snapshot(planner, out, stream):
    stream.synchronize()
    return {f: cupy.asnumpy(getattr(out, f)) for f in OUTPUT_FIELDS}, planner.errors(stream)


def poison(planner, out):
    """Poison the outputs; clear the (sticky) error records, so the next launch's errors are its own."""
    for f in OUTPUT_FIELDS:
        getattr(out, f).fill(0x5A5A5A5A if f != "num_tokens" else -77)
    planner.clear_errors()


def cell(us, floor):
    return f"{us:7.3f} {us / floor:4.2f}x"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    abl = ablation_module()
    floor = cupy.RawModule(code=FLOOR_SOURCE, options=("--std=c++17",))
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)

    def timed(launch):
        return graph_time_per_copy(launch, stream, a.copies, a.replays)[0]

    cols = []  # one per (batch, caches): {"label", "G", "floor", "times": {row: us}, ...}
    with stream:
        for label, bsz in SHAPES:
            dec, q, table, total = make_batch(rng, bsz, 1)
            # lengths in 1024-entry allocations: the unguarded-load variants (512, 591) read [0, T)
            dec_pad, q_pad = cupy.zeros(1024, dtype=cupy.int32), cupy.zeros(1024, dtype=cupy.int32)
            dec_pad[:bsz], q_pad[:bsz] = dec, q
            dec, q = dec_pad[:bsz], q_pad[:bsz]
            cap = total
            stride = np.int64(table.shape[1])
            for G in (1, 2):
                times: dict[str, float] = {}
                planner = StepPlanner(bsz, cap, [B] * G)
                planner.use_kernel("v9", max_requests=1024)
                name9, grid9, threads9 = planner.kernel_for(bsz)
                assert name9 == f"kvaddr_step1_c{G}_i64", name9
                out = planner.compute(dec, q, table, stream=stream)
                ref, ref_err = snapshot(planner, out, stream)
                # floors: the floor kernel as floor_step.py launches it, and with v9's geometry
                fo = floor.get_function(f"floor_decode_out_{G}")
                f_out = {
                    "batch_id_per_token": cupy.empty(cap, dtype=cupy.int32),
                    "position_ids": cupy.empty(cap, dtype=cupy.int64),
                    "slot_mapping": cupy.empty((G, cap), dtype=cupy.int64),
                    "cu_seqlens_q": cupy.empty(bsz + 1, dtype=cupy.int32),
                    "seq_lens_kv": cupy.empty(bsz, dtype=cupy.int32),
                    "num_tokens": cupy.empty(1, dtype=cupy.int32),
                }
                fargs = (
                    dec,
                    np.int32(bsz),
                    np.int32(cap),
                    table,
                    table,
                    stride,
                    np.int32(B),
                    f_out["batch_id_per_token"],
                    f_out["position_ids"],
                    f_out["slot_mapping"],
                    f_out["cu_seqlens_q"],
                    f_out["seq_lens_kv"],
                    f_out["num_tokens"],
                )
                fgrid = ((cap + 255) // 256,)
                fo(fgrid, (256,), fargs)
                stream.synchronize()
                for f, buf in f_out.items():
                    want = ref[f].reshape(buf.shape)
                    assert (cupy.asnumpy(buf) == want).all(), f"{label} decode-out: {f} differs from v9"
                times["decode-out"] = timed(lambda: fo(fgrid, (256,), fargs))
                if grid9 == 1 and threads9 >= cap:  # the floor kernel indexes tokens by blockIdx.x * 256
                    times["decode-out @T"] = timed(lambda: fo((1,), (threads9,), fargs))
                # the floor's work through KvStepParams
                st = kernel_loader.Launcher(
                    abl.get_function(f"kvaddr_abl_floor_out_c{G}").kernel, planner._params, by_value=True
                )
                poison(planner, out)
                st(fgrid[0], 256, stream.ptr)
                got, _ = snapshot(planner, out, stream)
                for f in OUTPUT_FIELDS:
                    assert (got[f] == ref[f]).all(), f"{label} decode-out, struct: {f} differs from v9"
                times["decode-out, struct"] = timed(lambda: st(fgrid[0], 256, stream.ptr))
                # "v9": compute() with the library's default (KV_V9_DEFAULT since round 2), "v9-old":
                # compute() with v9 as first shipped (use_kernel("v9-old"), kvaddr_step1old_c*)
                times["v9"] = timed(lambda: planner.compute(dec, q, table, stream=stream))
                planner_old = StepPlanner(bsz, cap, [B] * G)
                planner_old.use_kernel("v9-old", max_requests=1024)
                assert planner_old.kernel_for(bsz) == (f"kvaddr_step1old_c{G}_i64", grid9, threads9)
                poison(planner_old, planner_old._outputs(bsz))
                got, err = snapshot(planner_old, planner_old.compute(dec, q, table, stream=stream), stream)
                for f in OUTPUT_FIELDS:
                    assert (got[f] == ref[f]).all(), f"{label} v9-old: {f} differs from v9"
                assert err == ref_err, f"{label} v9-old: error record {err} != v9's {ref_err}"
                times["v9-old"] = timed(lambda: planner_old.compute(dec, q, table, stream=stream))
                l0 = v9_launcher(abl, planner, 0, G)
                times["v9 (launcher)"] = timed(lambda: l0(grid9, threads9, stream.ptr))
                for row, mask in ABLATIONS + ERR_ON_416:
                    lv = v9_launcher(abl, planner, mask, G)
                    times[row] = timed(lambda lv=lv: lv(grid9, threads9, stream.ptr))
                for row, mask in FIXES:
                    lv = v9_launcher(abl, planner, mask, G)
                    poison(planner, out)
                    lv(grid9, threads9, stream.ptr)
                    got, err = snapshot(planner, out, stream)
                    for f in OUTPUT_FIELDS:
                        assert (got[f] == ref[f]).all(), f"{label} {row}: {f} differs from v9"
                    assert err == ref_err, f"{label} {row}: error record {err} != v9's {ref_err}"
                    times[row] = timed(lambda lv=lv: lv(grid9, threads9, stream.ptr))
                one_block = None
                if bsz == 1:
                    ob = OneBlock(max_requests=bsz, capacity=cap, block_sizes=[B] * G, num_layers=1)
                    ob.step(dec, q, table, stream=stream)
                    one_block = timed(lambda ob=ob: ob.step(dec, q, table, stream=stream))
                planner.compute(dec, q, table, stream=stream)  # leave v9's own outputs behind
                stream.synchronize()
                cols.append(
                    dict(
                        batch=label,
                        caches=G,
                        geometry=[name9, grid9, threads9],
                        floor_us=times["decode-out"],
                        target_us=1.25 * times["decode-out"],
                        one_block_us=one_block,
                        times=times,
                    )
                )
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    verdicts = report(cols, dev, a.copies, a.replays)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=dev, columns=cols, verdicts=verdicts), fh, indent=1)
    return 0


def report(cols, dev, copies, replays) -> list:
    """Print the tables (ablation, what each phase costs, verdicts); return the verdicts."""
    print(f"device: {dev}; graph mode, {copies} copies per graph, median of {replays} replays; us per copy")
    print("each cell: us and the ratio to decode-out (floor_step.py's floor) of the same batch and cache count")
    head = f"{'variant':<30}" + "".join(f"{c['batch'] + ', ' + str(c['caches']) + 'c':>15}" for c in cols)
    print(head)
    rows = list(cols[0]["times"])
    for c in cols[1:]:
        rows += [r for r in c["times"] if r not in rows]
    for r in rows:
        line = f"{r:<30}"
        for c in cols:
            us = c["times"].get(r)
            line += f"{'-':>15}" if us is None else f"{cell(us, c['floor_us']):>15}"
        print(line)
    print(
        "v9 launches: "
        + "; ".join(f"{c['batch']}/{c['caches']}c <<<{c['geometry'][1]}, {c['geometry'][2]}>>>" for c in cols)
    )
    print()
    print("what each phase costs (v9 (launcher) minus the variant without it; for a fix: its gain), us:")
    for r, _ in ABLATIONS + FIXES:
        line = f"{r:<30}"
        for c in cols:
            line += f"{c['times']['v9 (launcher)'] - c['times'][r]:>+15.3f}"
        print(line)
    print()
    print("the error-record merge after all three fixes (fix: all three minus the variant), us:")
    for r, _ in ERR_ON_416 + [f for f in FIXES if f[1] & ~416]:
        line = f"{r:<30}"
        for c in cols:
            line += f"{c['times']['fix: all three'] - c['times'][r]:>+15.3f}"
        print(line)
    line = f"{'v9 (compute) - v9-old':<30}"
    for c in cols:
        line += f"{c['times']['v9'] - c['times']['v9-old']:>+15.3f}"
    print(line)
    print()
    print(
        "issue 16's targets (floor_step.py): at most 1.25x decode-out; decode 1 also <= one-block; 2nd cache <= +0.15 us"
    )
    print(f"{'kernel':<30}{'batch':<13}{'caches':>7}{'us':>8}{'target':>8}{'x floor':>9}{'1-block':>9}{'meets':>7}")
    verdicts = []
    for r in ["v9", "v9-old"] + [f for f, _ in FIXES]:
        for c in cols:
            us = c["times"][r]
            ok = us <= c["target_us"]
            ob = c["one_block_us"]
            if ob is not None:
                ok = ok and us <= ob
            verdicts.append(dict(kernel=r, batch=c["batch"], caches=c["caches"], us=us, meets=ok))
            obs = "-" if ob is None else f"{ob:.3f}"
            print(
                f"{r:<30}{c['batch']:<13}{c['caches']:>7}{us:>8.3f}{c['target_us']:>8.3f}{us / c['floor_us']:>8.2f}x"
                f"{obs:>9}{'yes' if ok else 'NO':>7}"
            )
        for c1 in cols:
            c2 = next((c for c in cols if c["batch"] == c1["batch"] and c["caches"] == 2), None)
            if c1["caches"] == 1 and c2 is not None:
                dd = c2["times"][r] - c1["times"][r]
                print(f"{r:<30}{c1['batch']:<13} second cache adds {dd:+.3f} us{'' if dd <= 0.15 else '  NOT MET'}")
    n_fix = sum(v["meets"] for v in verdicts if v["kernel"] not in ("v9", "v9-old"))
    n_v9 = sum(v["meets"] for v in verdicts if v["kernel"] == "v9")
    n_old = sum(v["meets"] for v in verdicts if v["kernel"] == "v9-old")
    ratio = " / ".join(f"{c['times']['v9'] / c['floor_us']:.2f}x" for c in cols)
    print(
        f"summary: v9 (the default, kvaddr_step1_c*) meets {n_v9}/{len(cols)} rows ({ratio} decode-out); "
        f"v9-old meets {n_old}/{len(cols)}; fixes meet {n_fix}/{len(cols) * len(FIXES)} (kernel, row) pairs"
    )
    return verdicts


if __name__ == "__main__":
    sys.exit(main())
