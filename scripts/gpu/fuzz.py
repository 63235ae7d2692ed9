"""Fuzz every GPU strategy against the NumPy reference on random steps (needs a GPU).

    PYTHONPATH=. python scripts/gpu/fuzz.py --steps 10000 --seed 20261129

Step i uses the seed ``seed + i`` (printed on any mismatch, and the range at the end),
so any failure replays alone with ``--seed SEED --steps 1``. Steps mix decode,
speculative, chunked-prefill (fresh and continuation) and idle requests, 1 to 4 caches,
block sizes including 1, 96 and odd ones, block ids near 2^31, injected bad values,
steps over capacity, and every 25th step takes the large-batch path (> 4096 requests).
Exit 0 with zero mismatches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout: tests.support

from tests.support.gpu import assert_outputs_equal, reference, to_device
from tests.support.step_cases import random_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--max-bsz", type=int, default=200)
    ap.add_argument(
        "--kernels",
        default="v8,v9,v9-wide,v9-across",
        help="fused-step designs to check (StepPlanner.use_kernel): v8, v9 (the small-batch kernel up to 1024"
        " requests, then v9 across blocks up to 4096), v9-wide (the same with 1024-thread blocks), v9-across"
        " (v9 across blocks for every batch of 1 to 4096 requests); comma-separated",
    )
    a = ap.parse_args(argv)
    kernels = [k for k in a.kernels.split(",") if k]
    for k in kernels:
        if k not in ("v8", "v9", "v9-wide", "v9-across"):
            ap.error(f"--kernels: unknown design {k!r} (v8, v9, v9-wide, v9-across)")

    from kvaddr.strategies.gpu import STRATEGY_NAMES, make_strategy
    from kvaddr.strategies.names import not_run_reason

    t0 = time.perf_counter()
    mismatches, checked, large = 0, 0, 0
    for i in range(a.steps):
        seed = a.seed + i
        rng = np.random.default_rng(seed)
        big = i % 25 == 24
        case = random_step(
            rng,
            max_bsz=9000 if big else a.max_bsz,
            errors=bool(rng.integers(0, 2)),
            over_capacity=bool(rng.integers(0, 4) == 0),
            big_ids=bool(rng.integers(0, 3) == 0),
            mix=("decode", "spec", "idle") if big else None,
        )
        bsz = len(case["seq_lens_decoder"])
        large += bsz > 4096
        ref = reference(case)
        dev = to_device(case)
        for name in STRATEGY_NAMES:
            if not_run_reason(name, bsz) is not None:
                continue  # one-block beyond 1024 requests
            s = make_strategy(
                name, max_requests=max(bsz, 1), capacity=case["capacity"], block_sizes=case["block_sizes"], num_layers=1
            )
            for kernel in kernels if name == "fused" else [None]:
                label = f"seed {seed}/{name}" + (f" [{kernel}]" if kernel else "")
                if kernel == "v9-wide":
                    s.planner.one_block_min_threads = 1024
                    s.planner.use_kernel("v9", max_requests=1024)
                elif kernel == "v9-across":
                    s.planner.use_kernel("v9", max_requests=0)
                elif kernel:  # v9 up to the kernel's own limit (the shipped cut-off is 256 requests)
                    s.planner.use_kernel(kernel, **({"max_requests": 1024} if kernel == "v9" else {}))
                out = s.step(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
                try:
                    assert_outputs_equal(out, ref.outputs, label)
                    if name == "fused":
                        got = s.planner.errors()
                        if got != (ref.error_mask, ref.error_key):
                            raise AssertionError(f"{label}: error record {got} != {(ref.error_mask, ref.error_key)}")
                except AssertionError as exc:
                    mismatches += 1
                    print(f"MISMATCH {exc}", flush=True)
                checked += 1
        if (i + 1) % 1000 == 0:
            print(f"{i + 1} steps, {mismatches} mismatches, {time.perf_counter() - t0:.0f} s", flush=True)
    print(
        f"fuzz: {a.steps} steps (seeds {a.seed}..{a.seed + a.steps - 1}, {large} on the large-batch path), "
        f"{checked} strategy runs, {mismatches} mismatches, {time.perf_counter() - t0:.0f} s"
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
