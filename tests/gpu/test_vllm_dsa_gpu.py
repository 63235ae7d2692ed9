"""The vLLM step's DSA outputs on the GPU (docs/dsa.md, "The vLLM step"): VllmStepPlanner(dsa=True)
against the NumPy reference (kvaddr.engines.vllm_reference, dsa=True), every element of every
output (the step's own outputs unchanged by the second grid row) and the error record: random
batches with dummy rows, 1 to 3 groups, decodes of n > 1 tokens, prefill chunks, more than 1024
requests, bad inputs, the bound step, CUDA-graph replays with the inputs' contents changed.
Skips without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import device_copy, requires_gpu
from tests.support.vllm_cases import assert_same, corrupt, planner_kwargs, random_case, to_numpy
from tests.support.vllm_dsa_cases import dsa_batch

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
DSA_FIELDS = ("value_offsets", "scale_offsets", "ks", "ke", "ctx", "cu_seq_lens", "req_id_per_token")


def on_device(x: dict) -> dict:
    return device_copy(x)


def compare(got, want, label: str) -> None:
    host = {
        k: (tuple(to_numpy(t) for t in v) if isinstance(v, tuple) else to_numpy(v)) for k, v in got.as_dict().items()
    }
    assert_same(host, want.outputs.as_dict(), label)
    for f in DSA_FIELDS:
        a, b = to_numpy(getattr(got.dsa, f)), getattr(want.outputs.dsa, f)
        np.testing.assert_array_equal(a, b, err_msg=f"{label}: dsa.{f}")
        assert a.dtype == b.dtype, f


def step(planner, cfg, x, padded, label, **kw):
    got = planner.compute(*(on_device(x)[k] for k in NAMES), num_reqs_padded=padded)
    want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded, dsa=True, **kw)
    compare(got, want, label)
    assert planner.errors() == (want.error_mask, want.error_key), label
    return want


def case(seed, M, block_sizes, *, n=1, T=None, cp_size=1, cp_rank=0, slot_dtype=np.int64, max_block_id=1 << 20):
    rng = np.random.default_rng(seed)
    cfg, state = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=M,
        block_sizes=block_sizes,
        max_query=max(n, 40),
        cp_size=cp_size,
        cp_rank=cp_rank,
        slot_dtype=slot_dtype,
        spare_tokens=T or M * 8,
        max_block_id=max_block_id,
    )
    return rng, cfg, state


@pytest.mark.parametrize(
    "M, block_sizes, n, prefill",
    [
        (1, (64,), 1, 0.0),
        (7, (4, 13), 2, 0.5),
        (64, (64,), 1, 0.0),
        (200, (16, 64, 5), 3, 0.2),
        (1030, (64,), 2, 0.1),
        (3000, (16, 64), 1, 0.05),
    ],
)
def test_random_batches(M, block_sizes, n, prefill):
    from kvaddr.engines.vllm import VllmStepPlanner

    rng, cfg, state = case(M * 7 + n, M, block_sizes, n=n)
    for g in range(len(block_sizes)):
        kw = dict(dsa_cache=g, dsa_decode_len=n)
        p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, **kw)
        for i, num_reqs in enumerate([M, max(M // 3, 1), 0, M]):
            x = dsa_batch(rng, cfg, state, num_reqs, n=n, prefill=prefill)
            step(p, cfg, x, min(M, num_reqs + 3), f"M {M} group {g} step {i}", **kw)


@pytest.mark.parametrize("seed", range(6))
def test_bad_inputs_dcp_and_int32_slots(seed):
    from kvaddr.engines.vllm import VllmStepPlanner

    cp = 2 if seed % 2 else 1
    rng, cfg, state = case(
        seed,
        300,
        (64, 16),
        n=2,
        cp_size=cp,
        cp_rank=seed % cp,
        slot_dtype=[np.int32, np.int64][seed % 2],
        max_block_id=(1 << 31) // 16 if seed >= 3 else 1 << 20,  # slots and offsets past 2^31
    )
    kw = dict(
        dsa_cache=seed % 2, dsa_decode_len=2, dsa_value_bytes=[128, 7][seed % 2], dsa_scale_bytes=[4, 2][seed % 2]
    )
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, **kw)
    for i in range(3):
        x = corrupt(rng, cfg, dsa_batch(rng, cfg, state, 300 - 40 * i, n=2, prefill=0.2), rate=0.1)
        step(p, cfg, x, 300, f"seed {seed} step {i}", **kw)


@pytest.mark.parametrize("M, n", [(1, 1), (60, 3), (300, 2), (2047, 1), (2048, 2), (2049, 1), (2600, 2)])
def test_edge_batches_write_every_element(M, n):
    """The batches that select each path of the DSA blocks (tests.support.vllm_dsa_cases.EDGES:
    only decodes, plain or MTP; only prefills; one prefill last or first; dummies only; padding
    past a few tokens; no request) around the staged query_start_loc's and the tile's sizes, each
    launch on DSA outputs first filled with a value no thread writes: every element is written."""
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner
    from tests.support.vllm_dsa_cases import EDGES, edge_batch

    rng, cfg, state = case(M * 11 + n, M, (16, 64), n=n, T=M * 20 + 300)
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, dsa_decode_len=n)
    for kind in EDGES + EDGES[::-1]:
        x = edge_batch(rng, cfg, state, kind, M, n=n)
        for f in DSA_FIELDS:
            getattr(p.outputs.dsa, f).fill(-7)
        cupy.cuda.runtime.deviceSynchronize()  # the fills land before the launch (on any stream) writes
        step(p, cfg, x, M, f"M {M} n {n} {kind}", dsa_decode_len=n)


def test_dsa_off_is_the_plain_step():
    from kvaddr.engines.vllm import VllmStepPlanner

    rng, cfg, state = case(3, 100, (16, 64), n=1)
    on = VllmStepPlanner(**planner_kwargs(cfg), dsa=True)
    off = VllmStepPlanner(**planner_kwargs(cfg))
    assert off.kernel_name == "vllm_step<false>" and on.kernel_name == "vllm_step<false, true>"
    x = on_device(dsa_batch(rng, cfg, state, 90, n=1, prefill=0.3))
    a = on.compute(*(x[k] for k in NAMES), num_reqs_padded=100)
    b = off.compute(*(x[k] for k in NAMES), num_reqs_padded=100)
    assert_same(
        {k: (tuple(to_numpy(t) for t in v) if isinstance(v, tuple) else to_numpy(v)) for k, v in a.as_dict().items()},
        {k: (tuple(to_numpy(t) for t in v) if isinstance(v, tuple) else to_numpy(v)) for k, v in b.as_dict().items()},
    )


def test_with_attention_outputs():
    from kvaddr.engines.vllm import VllmStepPlanner

    rng, cfg, state = case(4, 500, (64,), n=2)
    p = VllmStepPlanner(
        **planner_kwargs(cfg), dsa=True, dsa_decode_len=2, attention="flashinfer,varlen", kv_indices_capacity=1 << 16
    )
    assert p.kernel_name == "vllm_step<true, true>"
    x = dsa_batch(rng, cfg, state, 480, n=2, prefill=0.1)
    got = p.compute(*(on_device(x)[k] for k in NAMES), num_reqs_padded=500)
    want = vllm_step_reference(
        cfg,
        **{k: x[k] for k in NAMES},
        num_reqs_padded=500,
        dsa=True,
        dsa_decode_len=2,
        attention="flashinfer,varlen",
        kv_indices_capacity=1 << 16,
    )
    for f in DSA_FIELDS:
        np.testing.assert_array_equal(to_numpy(getattr(got.dsa, f)), getattr(want.outputs.dsa, f), err_msg=f)
    np.testing.assert_array_equal(to_numpy(got.attention.kv_indptr), want.outputs.attention.kv_indptr)
    assert p.errors() == (want.error_mask, want.error_key)


def test_bound_step():
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    rng, cfg, state = case(5, 1100, (64,), n=2)
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, dsa_decode_len=2)
    s = on_device(state)
    bound = p.bind(s["num_computed_tokens"], s["block_tables"], s["num_blocks"])
    for i in range(3):
        x = dsa_batch(rng, cfg, state, 1100 - 300 * i, n=2, prefill=0.1)
        got = bound.launch(cupy.asarray(x["idx_mapping"]), cupy.asarray(x["query_start_loc"]), num_reqs_padded=1100)
        want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=1100, dsa=True, dsa_decode_len=2)
        compare(got, want, f"bound {i}")


@pytest.mark.parametrize("M", [64, 1030])
def test_graph_replay(M):
    """One compute() captured in a CUDA graph, replayed after the batch buffers' contents change
    (decodes, mixed, fewer requests): every DSA output follows, padding included."""
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    rng, cfg, state = case(M, M, (16, 64), n=2)
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, dsa_decode_len=2)
    s = on_device(state)
    idx, qsl = device_copy([np.full(M, -1, np.int32), np.zeros(M + 1, np.int32)])
    stream = cupy.cuda.Stream(non_blocking=True)
    args = (s["num_computed_tokens"], s["block_tables"], s["num_blocks"])
    with stream:
        p.compute(idx, qsl, *args, num_reqs_padded=M, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        p.compute(idx, qsl, *args, num_reqs_padded=M, stream=stream)
        graph = stream.end_capture()
    p.clear_errors(stream)
    for i, (prefill, dummy) in enumerate([(0.0, 0.0), (0.3, 0.1), (0.1, 0.5)]):
        x = dsa_batch(rng, cfg, state, M, n=2, prefill=prefill, dummy=dummy)
        with stream:
            idx.set(x["idx_mapping"].astype(np.int32), stream=stream)
            qsl.set(x["query_start_loc"], stream=stream)
            graph.launch(stream)
        stream.synchronize()
        want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=M, dsa=True, dsa_decode_len=2)
        compare(p.outputs, want, f"replay {i}")
        p.clear_errors(stream)


def test_doc_snippet_prints_what_it_says():
    import contextlib
    import io

    from tests.support.docs import DOCS, expected_prints, snippet

    code = snippet((DOCS / "dsa.md").read_text(), "dsa-vllm-gpu")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/dsa.md", "exec"), {})
    assert [line.strip() for line in buf.getvalue().splitlines()] == expected_prints(code, explanations=False)
