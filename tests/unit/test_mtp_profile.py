"""The profiler's MTP rows (kvaddr.measure.mtp_profile) on the CPU: the draft inputs it builds
fit the workload, and the rendering says what was measured. The GPU run is in
tests/gpu/test_mtp_gpu.py."""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console

from kvaddr.measure import mtp_profile
from kvaddr.measure.workload import Workload
from kvaddr.spec_reference import mtp_draft_addressing


def test_inputs_fit_the_tables_of_every_substep():
    w = Workload(
        model="deepseek-v3.2", num_layers=2, num_caches=2, block_sizes=(64, 5), context=(100, 5000), spec_tokens=3
    )
    dec, acc, tables = mtp_profile._inputs(w, 300, np.random.default_rng(0))
    assert dec.dtype == acc.dtype == np.int32 and acc.min() >= 1 and acc.max() <= 4
    assert dec.min() >= 100 and dec.max() <= 5000
    for r in mtp_draft_addressing(dec, acc, tables, [64, 5], int(acc.sum()), 3):
        assert r.error_mask == 0


def test_render_reports_the_saving_and_the_rows_not_run():
    section = {
        "substeps": 3,
        "rows": [
            {"batch": 64, "substeps": 3, "kvaddr": {"launches": 1, "host_syncs": 0, "us": 5.0},
             "fastdeploy": {"launches": 6, "host_syncs": 3, "us": 65.0}, "saving_us": 60.0},
            {"batch": 1024, "substeps": 3, "kvaddr": {"launches": 1, "host_syncs": 0, "us": 6.0},
             "fastdeploy": {"launches": 6, "host_syncs": 3, "not_run": "at most 512"}},
        ],
    }  # fmt: skip
    buf = io.StringIO()
    mtp_profile.render(Console(file=buf, width=200), section)
    text = buf.getvalue()
    assert "saving 60.00 us per cycle (13.0x)" in text and "6 launches, 3 host syncs" in text
    assert "batch 1024" in text and "not run (at most 512)" in text
