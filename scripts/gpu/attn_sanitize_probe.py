"""A few attention steps for compute-sanitizer (memcheck, racecheck): every metadata
implementation (StepPlanner._set_meta_impl: 0 the first version, 1 request-parallel,
2 with the row prefetch, 3 in one round) and lane counts, on batches that reach every branch of the
metadata blocks, each compared with the NumPy reference. Few launches (the sanitizers are
slow); exits 1 on a mismatch.

    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/gpu/attn_sanitize_probe.py
"""

from __future__ import annotations

import sys

import numpy as np

from kvaddr import StepPlanner
from kvaddr.reference import step_addressing
from tests.support.attention_cases import ALL_GROUPS, make_case
from tests.support.gpu import assert_attention_equal, assert_outputs_equal, to_device

VARIANTS = [(0, 32), (1, 32), (1, 4), (2, 8), (3, 32), (3, 4)]


def cases():
    rng = np.random.default_rng(2026)
    big = make_case(rng, bsz=4500, block_sizes=[16, 3], max_ctx=120, spare_capacity=2, kinds=("decode", "idle"))
    mixed = make_case(rng, bsz=300, block_sizes=[1, 16, 3], spare_capacity=3)
    over = dict(mixed, kv_indices_capacity=max(mixed["kv_indices_capacity"] * 2 // 3, 1))
    yield "mixed 300, 3 caches", mixed
    yield "over capacity", over
    yield "prefills", make_case(rng, bsz=40, block_sizes=[2], spare_capacity=0, kinds=("prefill", "continuation"))
    yield "unallocated", make_case(rng, bsz=60, block_sizes=[4, 16], bad="unallocated", spare_capacity=2)
    yield "narrow row", make_case(rng, bsz=60, block_sizes=[4, 16], bad="narrow-row", spare_capacity=2)
    yield "empty batch", make_case(rng, bsz=0, block_sizes=[4], spare_capacity=2)
    yield "4500 requests", big
    # impl 3 (kv_meta_block3) with rows longer than its pre-barrier loads and several requests per group
    yield "long rows, B = 1", make_case(rng, bsz=120, block_sizes=[1], max_ctx=600, spare_capacity=2)


def main() -> int:
    failures = 0
    for label, case in cases():
        case = dict(case, attention=ALL_GROUPS)
        ref = step_addressing(
            case["seq_lens_decoder"],
            case["seq_lens_this_time"],
            case["block_tables"],
            case["block_sizes"],
            case["capacity"],
            attention=ALL_GROUPS,
            kv_indices_capacity=case["kv_indices_capacity"],
        )
        dev = to_device(case)
        p = StepPlanner(
            max(len(case["seq_lens_decoder"]), 1),
            case["capacity"],
            case["block_sizes"],
            attention=ALL_GROUPS,
            kv_indices_capacity=case["kv_indices_capacity"],
        )
        for impl, lanes in VARIANTS:
            p._set_meta_impl(impl, lanes)
            out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
            tag = f"{label}, impl {impl}, lanes {lanes}"
            try:
                assert_outputs_equal(out, ref.outputs, tag)
                assert_attention_equal(out.attention, ref.outputs.attention, tag)
                assert p.errors() == (ref.error_mask, ref.error_key), f"{tag}: error record"
            except AssertionError as exc:
                failures += 1
                print("FAIL", exc)
            else:
                print("ok  ", tag)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
