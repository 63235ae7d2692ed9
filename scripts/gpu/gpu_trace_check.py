#!/usr/bin/env python
"""On a GPU machine: a 10k-step trace, replayed on the GPU, and the sweep plot.

1. ``kvaddr trace generate --profile deepseek-v3.2-decode --steps 10000`` (seeded) into a temporary
   folder;
2. ``kvaddr replay TRACE --device cuda --eager-every 10 --json ...``: every step checked against the
   reference and timed in graph mode, eager mode on every 10th step;
3. prints the per-step saving's distribution (mean, p50, p99, min, total) of each strategy and mode,
   and the wall time of generation and replay, which together must stay under 5 minutes;
4. ``kvaddr sweep --batch 1,4,16,64,256,1024 --device cuda --json ... --plot docs/sweep-h200.png``:
   the plot of saved us per step against batch size (the GPU's name in its title). Without
   matplotlib the sweep's JSON is still kept, and the plot can be drawn anywhere later with
   ``kvaddr sweep --from sweep.json --plot docs/sweep-h200.png``.

Every step runs in a subprocess with a time limit, so a hang or a crash is reported, not waited
on; the script carries on with the next step where it can. Exit status: 0 every check held, 1 a
check failed (a command failed or took too long), 3 no usable GPU.

Usage::

    python scripts/gpu/gpu_trace_check.py [--keep DIR] [--steps 10000] [--plot docs/sweep-h200.png]
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT_S = 300.0  # generation + replay of the trace
REPLAY_TIMEOUT_S = 420  # kill a replay that runs away (still reported as a failure)
GENERATE_TIMEOUT_S = 180
SWEEP_TIMEOUT_S = 240


def kvaddr(*args: str) -> list:
    return [sys.executable, "-m", "kvaddr.cli", *args]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


def run(cmd: list, timeout: float, show: bool = True) -> tuple:
    """Run a command; return (exit status or None on timeout, wall seconds, stdout, stderr)."""
    shown = ["kvaddr", *cmd[3:]] if cmd[:3] == [sys.executable, "-m", "kvaddr.cli"] else cmd
    print("$ " + " ".join(shown), flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.perf_counter() - t0
    if show:
        sys.stdout.write(out)
    sys.stdout.write(err[-6000:])
    print(f"  -> exit {rc if rc is not None else 'TIMEOUT'} after {wall:.1f} s", flush=True)
    return rc, wall, out, err


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if abs(x) < 1000 else f"{x:.1f}"


def print_distribution(doc: dict) -> None:
    t = doc["trace"]
    print(
        f"\nreplayed {t['steps_replayed']} steps ({t['steps_checked']} checked, {t['bad_lines']} bad lines); "
        f"requests per step {t['requests_per_step']['min']:.0f}-{t['requests_per_step']['max']:.0f} "
        f"(mean {t['requests_per_step']['mean']:.1f}); tokens per step "
        f"{t['tokens_per_step']['min']:.0f}-{t['tokens_per_step']['max']:.0f}; "
        f"{doc['settings'].get('captured_shapes')} graphs captured"
    )
    for m in doc["measures"]:
        print(f"\n{m['label']} ({m['steps']} steps), us per step:")
        print(
            f"  {'strategy':<17} {'time p50':>9} {'saved mean':>11} {'p50':>9} {'p99':>9} {'min':>9} {'total (ms)':>11}"
        )
        for s in m["strategies"]:
            sv = s["saved_us"] or {}
            total = sv.get("total")
            print(
                f"  {s['strategy']:<17} {fmt(s['time_us']['p50']):>9} {fmt(sv.get('mean')):>11} "
                f"{fmt(sv.get('p50')):>9} {fmt(sv.get('p99')):>9} {fmt(sv.get('min')):>9} "
                f"{fmt(None if total is None else total / 1000):>11}"
            )
    for h in doc.get("headlines", []):
        print(h)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="deepseek-v3.2-decode")
    ap.add_argument("--eager-every", type=int, default=10)
    ap.add_argument("--sweep-batches", default="1,4,16,64,256,1024")
    ap.add_argument("--sweep-budget", default="0.5")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "sweep-h200.png"))
    ap.add_argument("--keep", metavar="DIR", help="copy the replay and sweep JSON reports into DIR")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the same pipeline on the CPU path (a dry run of this script)",
    )
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="kvaddr-trace-check-")
    try:
        return check(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check(args, work: str) -> int:
    failures = []
    rc, _, out, _ = run(kvaddr("info", "--json"), 120, show=False)
    try:
        info = json.loads(out)
    except ValueError:
        info = {}
    if args.device == "cuda" and not info.get("cuda_available"):
        print(f"no usable GPU: {info.get('cuda_status', 'kvaddr info failed')}")
        return 3
    gpu = (info.get("gpus") or [{}])[0]
    print(
        f"GPU: {gpu.get('name')}, driver {info.get('cuda_driver')}, runtime {info.get('cuda_runtime')}, "
        f"CuPy {info.get('cupy')}, kernels compile: {info.get('kernels_compile')}"
    )

    trace = os.path.join(work, "trace.jsonl")
    replay_json = os.path.join(work, "replay.json")
    sweep_json = os.path.join(work, "sweep.json")

    rc, gen_wall, _, _ = run(
        kvaddr(
            "trace",
            "generate",
            "--profile",
            args.profile,
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
            "-o",
            trace,
        ),
        GENERATE_TIMEOUT_S,
    )
    if rc != 0:
        failures.append(f"trace generate exited {rc if rc is not None else 'by timeout'}")
    else:
        print(f"trace: {os.path.getsize(trace) / 2**20:.0f} MiB")
        rc, rep_wall, _, _ = run(
            kvaddr(
                "replay", trace, "--device", args.device, "--eager-every", str(args.eager_every), "--json", replay_json
            ),
            REPLAY_TIMEOUT_S,
        )
        if rc != 0:
            failures.append(f"replay exited {rc if rc is not None else 'by timeout'}")
        if os.path.isfile(replay_json):
            try:
                doc = json.load(open(replay_json))
                print_distribution(doc)
                if doc["trace"]["steps_replayed"] != args.steps:
                    failures.append(f"replayed {doc['trace']['steps_replayed']} of {args.steps} steps")
                if doc["environment"]["device"] != args.device:
                    failures.append("the replay did not run on the GPU")
            except (ValueError, KeyError) as exc:
                failures.append(f"cannot read the replay report: {exc}")
        total = gen_wall + rep_wall
        print(
            f"\nwall time: generate {gen_wall:.1f} s + replay {rep_wall:.1f} s = {total:.1f} s (limit {LIMIT_S:.0f} s)"
        )
        if total > LIMIT_S:
            failures.append(f"generate + replay took {total:.1f} s (> {LIMIT_S:.0f} s)")
        try:
            os.remove(trace)
        except OSError:
            pass

    if not args.skip_sweep:
        have_mpl = subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True).returncode == 0
        cmd = [
            "sweep",
            "--batch",
            args.sweep_batches,
            "--device",
            args.device,
            "--budget",
            args.sweep_budget,
            "--json",
            sweep_json,
        ]
        if have_mpl:
            os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
            cmd += ["--plot", args.plot]
        else:
            print(
                "matplotlib is not installed here: the sweep keeps its JSON; plot it elsewhere with "
                f"`kvaddr sweep --from sweep.json --plot {os.path.relpath(args.plot, ROOT)}`"
            )
        rc, sw_wall, _, _ = run(kvaddr(*cmd), SWEEP_TIMEOUT_S)
        if rc != 0:
            failures.append(f"sweep exited {rc if rc is not None else 'by timeout'}")
        elif have_mpl:
            size = os.path.getsize(args.plot) if os.path.isfile(args.plot) else 0
            print(f"plot: {args.plot} ({size} bytes)")
            if size == 0:
                failures.append("the sweep plot is missing or empty")

    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        for p in (replay_json, sweep_json):
            if os.path.isfile(p):
                shutil.copy(p, args.keep)
        print(f"JSON reports copied to {args.keep}")
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        return 1
    print(f"\nOK: the trace replayed ({args.device}) within the time limit, every step checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
