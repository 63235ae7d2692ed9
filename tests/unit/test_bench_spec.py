"""benchmarks/bench_spec.py on the CPU (a stand-in ``cupy`` module): its verify batches are
error-free for the reference (decode and mixed: every draft step addressable) and its sections are
named. The benchmark itself checks every implementation and its floor against the reference on the
GPU before timing."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from kvaddr.engines.spec_reference import vllm_draft_reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_spec(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    for name in ("bench_step", "bench_spec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("bench_spec_under_test", ROOT / "benchmarks" / "bench_spec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["decode:64", "mixed:300"])
def test_verify_batches_are_clean(bench_spec, shape):
    x, s, N = bench_spec.verify_batch(np.random.default_rng(1), shape, 3, 16, 8192)
    want = vllm_draft_reference(
        x["idx_mapping"], x["query_start_loc"], x["seq_lens"], x["num_rejected"], x["num_sampled"],
        x["block_tables"], s["block_sizes"], x["verify_slot_mappings"], s["max_model_len"], 3,
        num_blocks=x["num_blocks"], max_num_reqs=s["max_num_reqs"], attention="flashinfer", kv_indices_capacity=N,
    )  # fmt: skip
    assert want.error_mask == 0
    assert (want.slot_mappings >= 0).all()
    n = s["max_num_reqs"]
    # the verify slots the batch carries are the tables' slots of the verify positions
    assert x["verify_slot_mappings"].shape == (1, int(x["query_start_loc"][-1]))
    assert set(bench_spec.SECTIONS) == {"vllm"} and n == x["idx_mapping"].shape[0]
