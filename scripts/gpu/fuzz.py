"""Fuzz every GPU strategy against the NumPy reference on random steps (needs a GPU).

    PYTHONPATH=. python scripts/gpu/fuzz.py --steps 10000 --seed 20261129

Step i uses the seed ``seed + i`` (printed on any mismatch, and the range at the end),
so any failure replays alone with ``--seed SEED --steps 1``. Steps mix decode,
speculative, chunked-prefill (fresh and continuation) and idle requests, 1 to 4 caches,
block sizes including 1, 96 and odd ones, block ids near 2^31, injected bad values and
steps over capacity. Batch sizes reach every kernel of the dispatch table
(kvaddr/dispatch.py): most steps have up to --max-bsz requests (``step_small``), every 10th
up to 4096 (``step_wide``) and every 25th more than 4096 (``step_multiblock``). Every
strategy runs as users get it; the fused step's error record is compared too, and the
count of steps per fused kernel is printed at the end.
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
    a = ap.parse_args(argv)

    from kvaddr.strategies.gpu import STRATEGY_NAMES, make_strategy
    from kvaddr.strategies.names import not_run_reason

    t0 = time.perf_counter()
    mismatches, checked, large = 0, 0, 0
    kernels: dict = {}
    for i in range(a.steps):
        seed = a.seed + i
        rng = np.random.default_rng(seed)
        big = i % 25 == 24
        wide = not big and i % 10 == 9
        case = random_step(
            rng,
            max_bsz=9000 if big else 4096 if wide else a.max_bsz,
            errors=bool(rng.integers(0, 2)),
            over_capacity=bool(rng.integers(0, 4) == 0),
            big_ids=bool(rng.integers(0, 3) == 0),
            mix=("decode", "spec", "idle") if big or wide else None,
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
            label = f"seed {seed}/{name}"
            if name == "fused":
                kernel = s.planner.kernel_for(bsz)[0]
                kernels[kernel] = kernels.get(kernel, 0) + 1
                label += f" [{kernel}]"
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
    print("fused steps per kernel: " + ", ".join(f"{k} {n}" for k, n in sorted(kernels.items())))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
