"""Where a block's time goes in v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/trace_step1wm.py [--json FILE]

A measuring instrument, not a timing benchmark, as benchmarks/trace_step1m.py: kernels.cu compiled
with ``KV_TRACE`` (its own module; the library's kernels are unchanged) has thread 0 of every block
store ``clock64`` at the ``KV_STAMP`` slots of kv_meta_wide (listed in the v9wm section comment) and
``%globaltimer`` at its start and end. For decode batches of 512, 1024 and 4096 requests (B = 64,
context 1k-32k, one cache: at most KV_TRACE_BLOCKS = 256 blocks are traced), the traced kernel is
launched with the planner's own parameter block and geometry, eagerly and as the last copy of a
CUDA graph; the table gives medians over --samples launches per block kind (request, pad, token
block): start and end (ns after the launch's first block started), cycles, and per segment, in
cycles: *issue* (start to the row loads issued), *lenRT* (waiting for the lengths), *scans* (the
thread sums and three warp scans), *bar*, *wscan* (the warp totals scanned), *outs* (the owned
requests' outputs), *bar2*, *rowst* (the loaded columns stored), *copy* (the rest of the row; a pad
block: *wscan* to *copy* is its pad), *rec* (the error record).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_common
from bench_attention import make_batch

SEGMENTS = [
    (1, 2, "issue"),
    (2, 3, "lenRT"),
    (3, 4, "scans"),
    (4, 5, "bar"),
    (5, 6, "wscan"),
    (6, 7, "outs"),
    (7, 8, "bar2"),
    (8, 9, "rowst"),
    (9, 10, "copy"),
    (10, 11, "rec"),
]
KINDS = {1: "request", 2: "token", 3: "pad"}
SHAPES = [("decode 512", 512), ("decode 1024", 1024), ("decode 4096", 4096)]


def batches(rng):
    """Decode batches of 512, 1024 and 4096 requests, one cache (at most 256 blocks are traced)."""
    for label, bsz in SHAPES:
        dec, q, table, total, pages = make_batch(rng, bsz, 1, 64)
        yield label, 1, dec, q, table, total, pages


def main(argv=None) -> int:
    return trace_common.main(
        argv,
        description=__doc__.split("\n\n")[0],
        segments=SEGMENTS,
        kinds=KINDS,
        segment_kinds=(1, 3),
        batches=batches,
        kernel_prefix="kvaddr_step1wm",
    )


if __name__ == "__main__":
    raise SystemExit(main())
