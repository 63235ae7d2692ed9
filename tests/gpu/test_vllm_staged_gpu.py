"""``num_blocks`` in pinned host memory on the GPU: the staged launch (``vllm_stage_num_blocks``
copying it into the planner's device copy, then the step's ``STAGED`` instantiation as its
programmatic dependent) writes exactly what the one launch over the same counts in device memory
writes: every output, the attention metadata, the DSA outputs and the error record. Cases: 1-3
groups, attention metadata, DSA, DCP, a sliding window, int32 slots, corrupted counts (the error
records), an empty batch and more than 1024 requests; a CuPy graph replayed with new pinned
contents. The one launch over device memory is itself compared with the NumPy reference by the
other vLLM tests, and here once more. Skips without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvaddr.engines.vllm import VllmStepPlanner
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_cases import assert_same, corrupt, new_batch, planner_kwargs, random_case

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
BOTH = ("flashinfer", "varlen")


def snapshot(out) -> dict:
    """Every buffer of a planner's outputs, copied to the host, by name."""
    import cupy

    got = {}
    for name, v in out.as_dict().items():
        vs = v if isinstance(v, tuple) else (v,)
        for k, a in enumerate(vs):
            got[f"{name}[{k}]"] = cupy.asnumpy(a)
    for part in ("attention", "dsa"):
        extra = getattr(out, part)
        if extra is not None:
            for f in dataclasses.fields(extra):
                a = getattr(extra, f.name)
                if a is not None and hasattr(a, "shape"):
                    got[f"{part}.{f.name}"] = cupy.asnumpy(a)
    return got


def pinned(stacked: np.ndarray):
    """``stacked`` in pinned host memory, as vLLM keeps num_blocks (a CuPy view at its device pointer)."""
    from kvaddr.measure.vllm_workload import pinned_num_blocks

    return pinned_num_blocks(stacked)


CASES = [
    # (label, G, planner keywords, random_case keywords)
    ("one group", 1, {}, {}),
    ("three groups, int32 slots", 3, {}, dict(slot_dtype=np.int32)),
    ("attention", 2, dict(attention=BOTH, kv_indices_capacity=1 << 20), {}),
    ("dsa", 2, dict(dsa=True, dsa_decode_len=2), {}),
    ("dsa and attention", 2, dict(dsa=True, attention=BOTH, kv_indices_capacity=1 << 20), {}),
    ("dcp", 2, {}, dict(cp_size=2, cp_rank=1)),
    ("sliding window", 2, {}, dict(sliding_window_reach=[0, 40])),
]


@pytest.mark.parametrize("label, G, kw, case_kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("M", [300, 1500])
def test_staged_equals_device_memory(label, G, kw, case_kw, M):
    import cupy

    rng = np.random.default_rng(900 + 7 * G + M)
    cfg, state = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=min(M, 1200),
        block_sizes=(16, 64, 4)[:G],
        max_query=4,
        spare_tokens=M + 300,
        **case_kw,
    )
    stacked = np.stack(state["num_blocks"]).astype(np.int32)
    host, view = pinned(stacked)
    dev_nb = cupy.asarray(stacked)
    staged, device = VllmStepPlanner(**planner_kwargs(cfg), **kw), VllmStepPlanner(**planner_kwargs(cfg), **kw)
    for step, n in enumerate([min(M, 1200), 0, 37, min(M, 1100), 1]):
        x = new_batch(rng, cfg, state, n, max_query=4)
        if step == 3:  # bad values everywhere the step checks
            x = corrupt(rng, cfg, x)
        host[...] = np.stack(x["num_blocks"])
        if step % 2:  # counts past the width and negative ones
            host[G - 1, rng.integers(0, M)] = 10**6
            host[0, rng.integers(0, M)] = -3
        dev_nb[...] = cupy.asarray(host)
        nct, tables = cupy.asarray(x["num_computed_tokens"]), [cupy.asarray(t) for t in x["block_tables"]]
        idx, qsl = cupy.asarray(x["idx_mapping"]), cupy.asarray(x["query_start_loc"])
        padded = min(M, n + 5)
        a = snapshot(staged.compute(idx, qsl, nct, tables, view, padded))
        b = snapshot(device.compute(idx, qsl, nct, tables, dev_nb, padded))
        assert staged.staged and not device.staged
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), f"{label} M={M} step {step}: {name} differs"
        assert staged.errors() == device.errors(), f"{label} M={M} step {step}: error records differ"
        if not kw:  # the plain step: the reference too
            want = vllm_step_reference(
                cfg, **dict(x, num_blocks=list(host.copy())), num_reqs_padded=padded
            ).outputs.as_dict()
            out = staged.outputs
            assert_same(out, want, f"{label} M={M} step {step}")


def test_the_step_is_the_copys_programmatic_dependent_from_sm_90():
    import cupy

    from kvaddr import kernel_loader

    major = int(cupy.cuda.Device(0).compute_capability) // 10
    assert kernel_loader.programmatic_launch_supported(0) == (major >= 9)


def test_cupy_graph_replays_read_new_pinned_counts():
    """A CuPy graph of the staged step (two kernel nodes, the second the first's programmatic
    dependent) replayed after the host changed the pinned num_blocks: each replay equals the
    reference over the new counts."""
    import cupy

    rng = np.random.default_rng(950)
    cfg, state = random_case(rng, max_num_reqs=400, num_reqs=300, block_sizes=(16, 64), max_query=2, spare_tokens=400)
    d = {
        k: [cupy.asarray(a) for a in state[k]] if isinstance(state[k], list) else cupy.asarray(state[k])
        for k in NAMES[2:4]
    }
    stacked = np.stack(state["num_blocks"]).astype(np.int32)
    host, view = pinned(stacked)
    x = new_batch(rng, cfg, state, 300, max_query=2)
    idx, qsl = cupy.asarray(x["idx_mapping"]), cupy.asarray(x["query_start_loc"])
    planner = VllmStepPlanner(**planner_kwargs(cfg))
    stream = cupy.cuda.Stream(non_blocking=True)
    run = lambda: planner.compute(idx, qsl, d["num_computed_tokens"], d["block_tables"], view, 304, stream=stream)  # noqa: E731
    with stream:
        run()
        stream.synchronize()
        planner.errors(stream=stream)
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    for k in range(4):
        host[...] = np.stack(state["num_blocks"])
        if k % 2:
            host[1, rng.integers(0, 400)] = 10**6
            host[0, :] = np.maximum(host[0, :] - 1, 0)  # fewer blocks than pages: slots -1, the error bit
        graph.launch(stream)
        stream.synchronize()
        want = vllm_step_reference(cfg, **dict(x, num_blocks=list(host.copy())), num_reqs_padded=304)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {k}")
        assert planner.errors(stream=stream) == (want.error_mask, want.error_key), f"replay {k}"
