#!/usr/bin/env python
"""End-to-end check of ``kvaddr profile`` on a GPU machine .

Runs ``kvaddr profile --batch 64`` (both modes) twice, each with ``--json`` to a
file: the first run with an empty CuPy kernel cache (a fresh ``CUPY_CACHE_DIR``,
so NVRTC compiles everything, as on a fresh machine), the second with the cache
the first one filled. Then:

* prints both runs' tables and each run's wall time (the first must be < 60 s);
* checks that the two runs agree on every graph-mode median within 10 %;
* compares the per-layer medians with reference figures measured with a probe
  (about 1.4 ms per DeepSeek-V3.2 step under CUDA graphs and about 15 ms eager at
  batch 64) and flags a difference of more than 2x.

Exit status 0 when every check holds, 1 otherwise, 3 when there is no GPU.

Usage::

    python scripts/gpu/gpu_cli_check.py [--keep DIR] [-- extra kvaddr profile options]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

AGREEMENT = 0.10
COLD_LIMIT_S = 60.0
PROBE_US = {("graph", "gpu"): 1400.0, ("eager", "host"): 15000.0}
PROBE_FACTOR = 2.0


def kvaddr_command() -> list:
    exe = shutil.which("kvaddr")
    return [exe] if exe else [sys.executable, "-m", "kvaddr.cli"]


def run_profile(json_path: str, cache_dir: str, extra: list) -> tuple:
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = kvaddr_command() + [
        "profile",
        "--batch",
        "64",
        "--mode",
        "both",
        "--device",
        "cuda",
        "--json",
        json_path,
        *extra,
    ]
    print("$ " + " ".join(cmd), f"  (CUPY_CACHE_DIR={cache_dir})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(proc.stdout)
    sys.stdout.write(proc.stderr)
    return proc.returncode, wall


def medians(doc: dict, mode: str, clock: str) -> dict:
    out = {}
    for shape in doc["shapes"]:
        for r in shape["results"]:
            if r["mode"] == mode and r["clock"] == clock:
                out[(shape["batch"], r["strategy"])] = r["summary"]["median"]
    return out


def main() -> int:
    work = tempfile.mkdtemp(prefix="kvaddr-gpu-check-")
    try:
        return check(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check(work: str) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", metavar="DIR", help="copy the two JSON reports into DIR")
    ap.add_argument("extra", nargs="*", help="extra kvaddr profile options (after --)")
    args = ap.parse_args()

    cache = os.path.join(work, "kernel_cache")
    os.makedirs(cache)
    paths = [os.path.join(work, "run1.json"), os.path.join(work, "run2.json")]
    failures = []

    rc1, wall1 = run_profile(paths[0], cache, args.extra)
    if rc1 == 3:
        print("no usable GPU (kvaddr profile exited 3)")
        return 3
    rc2, wall2 = run_profile(paths[1], cache, args.extra)
    print(f"\nfirst run (cold kernel cache): exit {rc1}, wall {wall1:.1f} s")
    print(f"second run (warm kernel cache): exit {rc2}, wall {wall2:.1f} s")
    if rc1 or rc2:
        print("FAIL: a run did not exit 0")
        return 1
    if wall1 > COLD_LIMIT_S:
        failures.append(f"first run took {wall1:.1f} s (> {COLD_LIMIT_S:.0f} s)")

    docs = [json.load(open(p)) for p in paths]
    if docs[0]["environment"]["device"] != "cuda":
        failures.append("the runs did not use the GPU")
    a, b = medians(docs[0], "graph", "gpu"), medians(docs[1], "graph", "gpu")
    if not a:
        failures.append("no graph-mode results")
    print("\ngraph-mode medians, us per step (first run, second run, difference):")
    for key in sorted(a):
        if key not in b:
            failures.append(f"{key} missing from the second run")
            continue
        diff = abs(b[key] - a[key]) / a[key] if a[key] > 0 else 0.0
        flag = "" if diff <= AGREEMENT else "  <-- more than 10%"
        print(f"  batch {key[0]:>4} {key[1]:<17} {a[key]:>10.2f} {b[key]:>10.2f} {100 * diff:6.1f}%{flag}")
        if flag:
            failures.append(f"graph-mode median of {key[1]} (batch {key[0]}) differs by {100 * diff:.1f}%")

    print("\nper-layer against the probe's figures (batch 64):")
    for (mode, clock), probe in PROBE_US.items():
        ours = medians(docs[0], mode, clock).get((64, "per-layer"))
        if ours is None:
            continue
        ratio = ours / probe
        note = "" if 1 / PROBE_FACTOR <= ratio <= PROBE_FACTOR else "  <-- differs by more than 2x: explain in the note"
        print(f"  {mode}/{clock}: ours {ours:.0f} us, probe ~{probe:.0f} us, ratio {ratio:.2f}{note}")

    env = docs[0]["environment"]
    print(
        f"\nGPU: {env.get('gpu')}, driver {env.get('cuda_driver')}, runtime {env.get('cuda_runtime')}, "
        f"CuPy {env.get('cupy')}, kvaddr {env.get('kvaddr')}, commit {env.get('git_commit')}"
    )
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        for p in paths:
            shutil.copy(p, args.keep)
        print(f"JSON reports copied to {args.keep}")
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: both runs agree on every graph-mode median within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
