"""Does a second `kvaddr profile` in the same process time slower than the first?

Runs `kvaddr profile --profile P --budget X --json F` several times in this process
(optionally pausing between runs), and prints, per run, every graph-mode median
against the baseline's run of the same profile, the CuPy pool size, the live CUDA
graph objects and the SM clock.

    PYTHONPATH=. python scripts/gpu/inprocess_drift.py --baseline profiles/baselines/h200.json \
        --profile profiles/glm-5.toml --repeat 3 [--pause 10] [--first profiles/x.toml]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import subprocess
import tempfile
import time


def graph_medians(doc):
    out = {}
    for shape in doc["shapes"]:
        for r in shape["results"]:
            if r["mode"] == "graph" and r["clock"] == "gpu":
                out[(shape["batch"], r["strategy"])] = r["summary"]["median"]
    return out


def sm_clock():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--first", default=None, help="another profile to run once before")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--budget", type=float, default=0.3)
    args = ap.parse_args()
    import cupy

    from kvaddr.cli import cli

    base = json.load(open(args.baseline))
    want = os.path.basename(args.profile)
    ref = next(graph_medians(r) for r in base["runs"] if os.path.basename(r["options"]["workload_profile"]) == want)
    runs = ([args.first] if args.first else []) + [args.profile] * args.repeat
    for i, prof in enumerate(runs):
        if i and args.pause:
            time.sleep(args.pause)
        path = os.path.join(tempfile.mkdtemp(), "p.json")
        t0 = time.time()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cli.main(
                    args=["profile", "--profile", prof, "--budget", str(args.budget), "--json", path],
                    prog_name="kvaddr",
                    standalone_mode=False,
                )
        except SystemExit:
            pass
        doc = json.load(open(path))
        graphs = sum(1 for o in gc.get_objects() if type(o).__name__ == "Graph")
        pool = cupy.get_default_memory_pool()
        print(
            f"run {i} {os.path.basename(prof)} {time.time() - t0:.1f}s pool used {pool.used_bytes() >> 20} MiB "
            f"total {pool.total_bytes() >> 20} MiB, live Graph objects {graphs}, clocks {sm_clock()}",
            flush=True,
        )
        if os.path.basename(prof) == want:
            med = graph_medians(doc)
            for key in sorted(med):
                if key in ref:
                    print(
                        f"   batch {key[0]:>5} {key[1]:<17} {ref[key]:10.3f} -> {med[key]:10.3f}  x{med[key] / ref[key]:.3f}"
                    )


if __name__ == "__main__":
    main()
