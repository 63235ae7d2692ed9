"""Where one warp's time goes in the small-batch step with attention outputs (kvaddr_step1m_c{G}_*).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/trace_step1m.py [--json FILE]

A measuring instrument, not a timing benchmark: kernels.cu compiled with ``KV_TRACE`` (its own
module; the library's kernels are compiled without it and are unchanged) has thread 0 of every
block store ``clock64`` at fixed points of the launch (kernels.cu's ``KV_STAMP`` slots, listed
in the v9m section comment) and ``%globaltimer`` at its start and end. For each of
benchmarks/bench_attention.py's small-batch shapes (decode 1, decode 64, the 256-request mixed
batch; B = 64, context 1k-32k), with 1 and 2 caches, the traced kernel is launched with the
planner's own parameter block and geometry, eagerly and as the last copy of a CUDA graph, and
the stamps of the last launch are read back; the table gives medians over --samples launches:

* per block kind (metadata / token block): the block's start and end (ns after the launch's
  first block started, %globaltimer: coarse) and its cycles from start to end;
* per metadata-block segment, in cycles: *issue* (start to the row loads issued; the length
  loads go out first), *lenRT* (then waiting for the lengths), *scans* (pages, the three warp
  scans, the shared stores), *bar*, *rowst* (the first row's columns stored), *outs* (the
  per-request outputs), *total* (entry bsz, the maxima), *copy* (the rest of the rows), *pad*,
  *rec* (the error record).

The stamps cost a few instructions each and move ptxas's schedule: read the segments as a
breakdown of one build, compare builds by bench_attention.py's times. docs/perf-notes.md,
"Twelfth session", has the method and the tables it gave.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_common
from bench_attention import make_batch

SEGMENTS = [
    (1, 2, "issue"),
    (2, 3, "lenRT"),
    (3, 4, "scans"),
    (4, 5, "bar"),
    (5, 6, "rowst"),
    (6, 7, "outs"),
    (7, 8, "total"),
    (8, 9, "copy"),
    (9, 10, "pad"),
    (10, 11, "rec"),
]
KINDS = {1: "metadata", 2: "token"}
SHAPES = [("decode 1", 1, 1, False), ("decode 64", 64, 1, False), ("256 req, mixed (~16k)", 256, 64, True)]


def batches(rng):
    """bench_attention.py's small-batch shapes, one and two caches."""
    for label, bsz, per, mixed in SHAPES:
        r = np.random.default_rng(1) if bsz == 1 else rng  # bench_attention.py's batches
        dec, q, table, total, pages = make_batch(r, bsz, per, 64, mixed=mixed)
        for G in (1, 2):
            yield label, G, dec, q, table, total, pages


def main(argv=None) -> int:
    return trace_common.main(
        argv,
        description=__doc__.split("\n\n")[0],
        segments=SEGMENTS,
        kinds=KINDS,
        segment_kinds=(1,),
        batches=batches,
        kernel_prefix="kvaddr_step1m_",
    )


if __name__ == "__main__":
    raise SystemExit(main())
