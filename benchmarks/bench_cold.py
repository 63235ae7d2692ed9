"""Cold start: what the first call costs in a fresh process, with an empty and with a warm kernel cache.

Each row runs in a new Python process whose ``CUPY_CACHE_DIR`` is a new empty folder (cold),
then again in another new process on the folder the first one filled (warm):

* ``StepPlanner``: import kvaddr, build a planner (one cache, no attention; 256 requests and
  a second one with 4096, which compiles the across-blocks kernels too) and run its first
  ``compute`` to completion;
* ``VllmStepPlanner``: the same for the vLLM step (one group, no attention);
* ``kvaddr profile --batch 64``: the CLI end to end (its default workload and budget).

The time is the child's wall clock from start to exit, as a user sees it, and, for the library
rows, the first call's own share (import and the planner's construction included).

Run from the repository root on a GPU: ``PYTHONPATH=. python benchmarks/bench_cold.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STEP = """
import time
t0 = time.perf_counter()
import cupy as cp
from kvaddr import StepPlanner
M = {max_requests}
p = StepPlanner(max_requests=M, capacity=8192, block_sizes=[64])
dec = cp.full(M, 100, dtype=cp.int32)
q = cp.ones(M, dtype=cp.int32)
table = cp.arange(M * 64, dtype=cp.int32).reshape(M, 64)
p.compute(dec, q, table)
cp.cuda.get_current_stream().synchronize()
p.check()
print(time.perf_counter() - t0)
"""

VLLM = """
import time
t0 = time.perf_counter()
import cupy as cp
from kvaddr.engines.vllm import VllmStepPlanner
M = 256
p = VllmStepPlanner(max_num_reqs=M, max_num_batched_tokens=8192, block_sizes=[16], widths=[512])
idx = cp.arange(M, dtype=cp.int32)
qsl = cp.arange(M + 1, dtype=cp.int32)
nct = cp.full(M, 100, dtype=cp.int32)
table = cp.arange(M * 512, dtype=cp.int32).reshape(M, 512)
nb = cp.full(M, 512, dtype=cp.int32)
p.compute(idx, qsl, nct, [table], [nb], num_reqs_padded=M)
cp.cuda.get_current_stream().synchronize()
p.check()
print(time.perf_counter() - t0)
"""


def _run(cmd: list, cache: str) -> tuple[float, float | None, str]:
    env = dict(os.environ, CUPY_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    inner = None
    try:
        inner = float(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pass
    return wall, inner, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--skip-profile", action="store_true", help="leave out the kvaddr profile row")
    args = ap.parse_args()
    py = sys.executable
    cases = [
        ("StepPlanner, 256 requests: first compute", [py, "-c", STEP.format(max_requests=256)]),
        ("StepPlanner, 4096 requests: first compute", [py, "-c", STEP.format(max_requests=4096)]),
        ("VllmStepPlanner: first compute", [py, "-c", VLLM]),
    ]
    if not args.skip_profile:
        cases.append(("kvaddr profile --batch 64", [py, "-m", "kvaddr.cli", "profile", "--batch", "64"]))
    rows = []
    for label, cmd in cases:
        with tempfile.TemporaryDirectory(prefix="kvaddr-cold-") as cache:
            cold, cold_inner, _ = _run(cmd, cache)
            warm, warm_inner, _ = _run(cmd, cache)
        rows.append(
            {"case": label, "cold_s": cold, "cold_call_s": cold_inner, "warm_s": warm, "warm_call_s": warm_inner}
        )
        print(f"{label}: cold {cold:.2f} s, warm {warm:.2f} s", file=sys.stderr, flush=True)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"{'case':<44} {'cold s':>8} {'(call)':>8} {'warm s':>8} {'(call)':>8}")
    for r in rows:
        print(
            f"{r['case']:<44} {fmt(r['cold_s']):>8} {fmt(r['cold_call_s']):>8} "
            f"{fmt(r['warm_s']):>8} {fmt(r['warm_call_s']):>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
