"""VllmDraftPlanner (kernels/spec.cuh) on the GPU against the NumPy reference: random acceptance 0..k
with chunked-prefill rows, 1-3 groups, DCP ranks, positions reaching max_model_len, attention
metadata, > 1024 requests, corrupted values (error bits and first-bad key), stale outputs of a
larger batch overwritten, bind()/launch equal to compute(), CUDA graph replays with new contents,
the torch op (opcheck, torch.compile(fullgraph=True)), and the toy draft loop with torch caches.
Skips without a GPU (the torch parts without torch). CPU twins: tests/unit/test_vllm_draft_*.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_draft import VllmDraftPlanner
from tests.support.draft_cases import compare, corrupt, draft_case, reference
from tests.support.draft_loop import NumpyOps, run_loop
from tests.support.gpu import device_copy, requires_gpu
from tests.support.torch_ops import cuda_torch_skip_reason

pytestmark = requires_gpu
TORCH_SKIP = cuda_torch_skip_reason()
requires_torch_cuda = pytest.mark.skipif(TORCH_SKIP is not None, reason=TORCH_SKIP or "")

ARGS = ("idx_mapping", "query_start_loc", "seq_lens", "num_rejected", "num_sampled")


def _dev(x):
    return device_copy(x)


def _args(case):
    x = case["inputs"]
    return (
        *(_dev(x[k]) for k in ARGS),
        _dev(x["block_tables"]),
        _dev(x["num_blocks"]),
        _dev(x["verify_slot_mappings"]),
    )


def _host(out):
    return {k: (None if v is None else v.get()) for k, v in out.as_dict().items()}


def _check(planner, case, label=""):
    import cupy

    out = planner.compute(*_args(case))
    cupy.cuda.get_current_stream().synchronize()
    want = reference(case)
    compare(_host(out), want, label)
    assert planner.errors() == (want.error_mask, want.error_key), label
    return want


@pytest.mark.parametrize("seed", range(12))
def test_random_cycles_equal_the_reference(seed):
    rng = np.random.default_rng(1000 + seed)
    sizes = [(16,), (16, 4), (64, 16, 1)][seed % 3]
    att = [None, "flashinfer", "varlen", "flashinfer,varlen"][seed % 4]
    case = draft_case(
        rng,
        num_reqs=int(rng.integers(1, 300)),
        max_num_reqs=320,
        k=int(rng.integers(1, 6)),
        block_sizes=sizes,
        max_model_len=int(rng.integers(40, 600)),
        attention=att,
        idx64=bool(seed % 2),
        mask_rejected=bool(seed % 3 != 1),
        slot_mapping_enabled=[g != 1 or seed % 5 != 0 for g in range(len(sizes))],
    )
    planner = VllmDraftPlanner(**case["settings"])
    _check(planner, case, "clean")
    for i in range(3):  # the same planner, corrupted inputs, then a clean call again
        bad = draft_case(
            np.random.default_rng(seed * 10 + i),
            num_reqs=50,
            max_num_reqs=320,
            k=case["settings"]["num_speculative_steps"],
            block_sizes=sizes,
            max_model_len=case["settings"]["max_model_len"],
        )
        bad["settings"] = case["settings"]
        bad["inputs"]["block_tables"] = [
            np.pad(t, ((0, 0), (0, max(w - t.shape[1], 0))), constant_values=-1)[:, :w]
            for t, w in zip(bad["inputs"]["block_tables"], case["settings"]["widths"])
        ]
        bad["inputs"]["verify_slot_mappings"] = bad["inputs"]["verify_slot_mappings"][
            :, : case["settings"]["max_num_batched_tokens"]
        ]
        label = corrupt(bad, np.random.default_rng(i))
        _check(planner, bad, label)
    _check(planner, case, "clean again")


@pytest.mark.parametrize(("cp_size", "il"), [(2, 1), (2, 4), (4, 2)])
def test_dcp_ranks(cp_size, il):
    for rank in range(cp_size):
        case = draft_case(
            np.random.default_rng(7),
            num_reqs=100,
            max_num_reqs=128,
            block_sizes=(16, 8),
            max_model_len=300,
            cp_size=cp_size,
            cp_rank=rank,
            cp_interleave=il,
            dcp_sharded=[True, False],
            attention="flashinfer,varlen",
        )
        _check(VllmDraftPlanner(**case["settings"]), case, f"rank {rank}")


def test_positions_reach_max_model_len():
    case = draft_case(
        np.random.default_rng(8), num_reqs=200, k=5, near_end_share=1.0, prefill_share=0.0, max_model_len=97
    )
    want = _check(VllmDraftPlanner(**case["settings"]), case)
    assert want.positions.max() == 96 and want.seq_lens.max() == 97


@pytest.mark.parametrize("n", [1025, 3000, 5000])
def test_more_than_1024_requests(n):
    case = draft_case(
        np.random.default_rng(n),
        num_reqs=n,
        max_num_reqs=n + 100,
        k=3,
        block_sizes=(16, 64),
        max_model_len=2048,
        attention="flashinfer,varlen",
    )
    _check(VllmDraftPlanner(**case["settings"]), case)


@pytest.mark.parametrize(
    "num_reqs, max_num_reqs, k, block_sizes",
    [(200, 255, 3, (4, 3)), (256, 256, 2, (4, 1, 16)), (300, 511, 4, (2, 5)), (40, 300, 1, (4, 3, 8))],
)
def test_request_block_boundaries(num_reqs, max_num_reqs, k, block_sizes):
    """Slices of one and of several request blocks (max_num_reqs + 1 at and past 256), 2-3 groups,
    no draft step (k = 1), clean and corrupted (CPU twin: test_vllm_draft_emulated.py)."""
    rng = np.random.default_rng(num_reqs + 7 * k)
    for bad in (False, True):
        case = draft_case(rng, num_reqs=num_reqs, max_num_reqs=max_num_reqs, k=k, block_sizes=block_sizes)
        label = corrupt(case, rng) if bad else "clean"
        _check(VllmDraftPlanner(**case["settings"]), case, label)


def test_empty_batch_writes_everything():
    case = draft_case(
        np.random.default_rng(9), num_reqs=0, max_num_reqs=40, attention="flashinfer,varlen", max_tokens=64
    )
    planner = VllmDraftPlanner(**case["settings"])
    for v in planner.outputs.as_dict().values():
        if v is not None:
            v.fill(77)
    _check(planner, case)


def test_smaller_batch_leaves_nothing_of_the_larger():
    rng = np.random.default_rng(10)
    big = draft_case(
        rng, num_reqs=300, max_num_reqs=300, attention="flashinfer,varlen", max_tokens=2000, max_model_len=200
    )
    planner = VllmDraftPlanner(**big["settings"])
    _check(planner, big)
    small = draft_case(rng, num_reqs=7, max_num_reqs=300, max_model_len=200, max_tokens=2000)
    small["settings"] = big["settings"]
    small["inputs"]["block_tables"] = [
        np.pad(t, ((0, 0), (0, max(w - t.shape[1], 0))), constant_values=-1)[:, :w]
        for t, w in zip(small["inputs"]["block_tables"], big["settings"]["widths"])
    ]
    _check(planner, small)


def test_bind_launch_equals_compute_and_follows_new_contents():
    import cupy

    case = draft_case(
        np.random.default_rng(11),
        num_reqs=200,
        max_num_reqs=256,
        attention="flashinfer,varlen",
        max_tokens=1200,
        max_model_len=300,
    )
    s = case["settings"]
    x = case["inputs"]
    M = s["max_num_reqs"]
    persistent = {k: cupy.zeros(M, dtype=cupy.int32) for k in ("seq_lens", "num_rejected", "num_sampled")}
    for k, v in persistent.items():
        v[: x[k].shape[0]] = cupy.asarray(x[k])
    planner = VllmDraftPlanner(**s)
    tables, nbs, vsm = _dev(x["block_tables"]), _dev(x["num_blocks"]), _dev(x["verify_slot_mappings"])
    bound = planner.bind(
        persistent["seq_lens"], persistent["num_rejected"], persistent["num_sampled"], tables, nbs, vsm
    )
    bound.launch(_dev(x["idx_mapping"]), _dev(x["query_start_loc"]))
    cupy.cuda.get_current_stream().synchronize()
    want = reference(case)
    compare(_host(planner.outputs), want, "bound")
    assert planner.errors() == (want.error_mask, want.error_key)
    # new acceptance in the same persistent buffers
    rej = np.minimum(x["num_rejected"] + 1, np.maximum(np.diff(x["query_start_loc"]) - 1, 0)).astype(np.int32)
    rej[x["num_sampled"] <= 1] = 0
    smp = np.where(x["num_sampled"] > 1, np.diff(x["query_start_loc"]) - rej, x["num_sampled"]).astype(np.int32)
    persistent["num_rejected"][: rej.shape[0]] = cupy.asarray(rej)
    persistent["num_sampled"][: smp.shape[0]] = cupy.asarray(smp)
    x["num_rejected"], x["num_sampled"] = rej, smp
    bound.launch(_dev(x["idx_mapping"]), _dev(x["query_start_loc"]))
    cupy.cuda.get_current_stream().synchronize()
    want = reference(case)
    compare(_host(planner.outputs), want, "bound, new contents")
    assert planner.errors() == (want.error_mask, want.error_key)


@pytest.mark.parametrize("attention", [None, "flashinfer,varlen"])
def test_batch_binding_launch_num_reqs_equals_the_reference(attention):
    """bind(..., idx_mapping=, query_start_loc=) over persistent batch buffers longer than the
    batch: launch(num_reqs) for several counts, eagerly and replayed from a CUDA graph."""
    import cupy

    rng = np.random.default_rng(21)
    M = 300
    stream = cupy.cuda.Stream(non_blocking=True)
    base = draft_case(rng, num_reqs=M, max_num_reqs=M, attention=attention, max_tokens=4 * M, max_model_len=400)
    s = base["settings"]
    planner = VllmDraftPlanner(**s)
    idx_buf = cupy.full(M, 7, dtype=cupy.int32)
    qsl_buf = cupy.full(M + 1, 5, dtype=cupy.int32)
    per = {k: cupy.zeros(M, dtype=cupy.int32) for k in ("seq_lens", "num_rejected", "num_sampled")}
    x = base["inputs"]
    tables, nbs = _dev(x["block_tables"]), _dev(x["num_blocks"])
    # bound whole; on the device before load() writes it on `stream`
    vsm = _dev(np.zeros((len(s["block_sizes"]), s["max_num_batched_tokens"]), dtype=np.int64))
    bound = planner.bind(
        per["seq_lens"], per["num_rejected"], per["num_sampled"], tables, nbs, vsm,
        idx_mapping=idx_buf, query_start_loc=qsl_buf, stream=stream,
    )  # fmt: skip
    assert bound.max_num_reqs == M

    def load(n):
        """A new verify step of n requests written into the bound buffers (tables cropped or
        padded with -1 to the bound widths, as a scheduler's persistent tables are)."""
        case = draft_case(rng, num_reqs=n, max_num_reqs=M, attention=attention, max_tokens=4 * M, max_model_len=400)
        case["settings"] = s
        c = case["inputs"]
        c["block_tables"] = [
            np.pad(t, ((0, 0), (0, max(w - t.shape[1], 0))), constant_values=-1)[:, :w]
            for t, w in zip(c["block_tables"], s["widths"])
        ]
        for dev_t, t in zip(tables, c["block_tables"]):
            dev_t.set(np.ascontiguousarray(t), stream=stream)
        for dev_n, nb in zip(nbs, c["num_blocks"]):
            dev_n.set(nb, stream=stream)
        idx_buf[:n].set(c["idx_mapping"].astype(np.int32), stream=stream)
        qsl_buf[: n + 1].set(c["query_start_loc"], stream=stream)
        for k in per:
            per[k][:n].set(c[k], stream=stream)
        vsm.set(c["verify_slot_mappings"], stream=stream)  # [G, max_tokens = 4 M], as bound
        return case

    for n in (M, 17, 0, 200):
        case = load(n)
        with stream:
            bound.launch(n)
        stream.synchronize()
        want = reference(case)
        compare(_host(planner.outputs), want, f"batch binding n={n}")
        assert planner.errors(stream) == (want.error_mask, want.error_key)
    with stream:
        bound.launch(40)  # warm up the count outside capture
        stream.begin_capture()
        bound.launch(40)
        graph = stream.end_capture()
    for _ in range(3):
        case = load(40)
        graph.launch(stream)
        stream.synchronize()
        want = reference(case)
        compare(_host(planner.outputs), want, "batch binding replay")
        assert planner.errors(stream) == (want.error_mask, want.error_key)


def test_bad_arguments_name_themselves():
    case = draft_case(np.random.default_rng(12), num_reqs=5, max_num_reqs=8)
    planner = VllmDraftPlanner(**case["settings"])
    a = list(_args(case))
    a[2] = a[2].astype(np.int64)
    with pytest.raises(TypeError, match="seq_lens"):
        planner.compute(*a)
    a = list(_args(case))
    with pytest.raises(ValueError, match="verify_slot_mappings"):
        planner.compute(*a[:7], None)


def test_cuda_graph_replays_follow_new_contents():
    import cupy

    case = draft_case(
        np.random.default_rng(13),
        num_reqs=64,
        max_num_reqs=64,
        prefill_share=0.0,
        dummy_share=0.0,
        attention="flashinfer,varlen",
        max_tokens=64 * 4,
        max_model_len=500,
    )
    s, x = case["settings"], case["inputs"]
    planner = VllmDraftPlanner(**s)
    dev = {k: _dev(x[k]) for k in (*ARGS, "block_tables", "num_blocks", "verify_slot_mappings")}
    stream = cupy.cuda.Stream(non_blocking=True)
    bound = planner.bind(
        dev["seq_lens"],
        dev["num_rejected"],
        dev["num_sampled"],
        dev["block_tables"],
        dev["num_blocks"],
        dev["verify_slot_mappings"],
        stream=stream,
    )
    with stream:
        bound.launch(dev["idx_mapping"], dev["query_start_loc"])  # warm up outside capture
        stream.begin_capture()
        bound.launch(dev["idx_mapping"], dev["query_start_loc"])
        graph = stream.end_capture()
    rng = np.random.default_rng(14)
    for _ in range(4):
        acc = rng.integers(0, 4, size=64).astype(np.int32)
        x["num_rejected"] = (3 - acc).astype(np.int32)
        x["num_sampled"] = (acc + 1).astype(np.int32)
        x["idx_mapping"] = x["idx_mapping"][rng.permutation(64)]
        dev["num_rejected"].set(x["num_rejected"], stream=stream)
        dev["num_sampled"].set(x["num_sampled"], stream=stream)
        dev["idx_mapping"].set(x["idx_mapping"], stream=stream)
        graph.launch(stream)
        stream.synchronize()
        want = reference(case)
        compare(_host(planner.outputs), want, "replay")
        assert planner.errors(stream) == (want.error_mask, want.error_key)


# -- the torch op ---------------------------------------------------------------------------


def _torch_args(case):
    import torch

    x = case["inputs"]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    return (
        *(t(x[k]) for k in ARGS),
        [t(a) for a in x["block_tables"]],
        t(np.stack(x["num_blocks"])),
        t(x["verify_slot_mappings"]),
    )


def _torch_case(seed=15):
    case = draft_case(
        np.random.default_rng(seed),
        num_reqs=40,
        max_num_reqs=48,
        attention="flashinfer,varlen",
        block_sizes=(16, 8),
        max_model_len=300,
    )
    s = dict(case["settings"])
    return case, s


def _torch_compare(out, case):
    want = reference(case)
    got = {k: v.cpu().numpy() for k, v in out.items()}
    compare(got, want, "torch op")
    return want


@requires_torch_cuda
def test_torch_op_equals_the_reference_and_passes_opcheck():
    import torch

    from kvaddr.torch import VllmDraftBuffers, vllm_draft

    case, s = _torch_case()
    buf = VllmDraftBuffers(**s)
    out = vllm_draft(*_torch_args(case), buf)
    torch.cuda.synchronize()
    want = _torch_compare(out, case)
    assert buf.errors() == (want.error_mask, want.error_key)
    a = _torch_args(case)
    torch.library.opcheck(torch.ops.kvaddr.vllm_draft_into.default, (*a, buf.storage, buf.layout))


@requires_torch_cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    import torch

    from kvaddr.torch import VllmDraftBuffers, vllm_draft

    case, s = _torch_case(16)
    buf = VllmDraftBuffers(**s)
    a = _torch_args(case)
    vllm_draft(*a, buf)  # builds the planner outside compilation

    def f(*xs):
        o = vllm_draft(*xs, buf)
        return o["positions"] + 0, o["slot_mappings"] + 0, o["kv_indices"] + 0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = compiled(*a)
    torch.cuda.synchronize()
    want = reference(case)
    assert np.array_equal(got[0].cpu().numpy(), want.positions)
    assert np.array_equal(got[1].cpu().numpy(), want.slot_mappings)
    assert np.array_equal(got[2].cpu().numpy(), want.kv_indices)


# -- the toy draft loop with torch caches on the GPU ----------------------------------------


class TorchOps(NumpyOps):
    def asarray(self, a):
        import torch

        return torch.as_tensor(np.asarray(a), device="cuda")

    def host(self, a):
        if hasattr(a, "get"):
            return a.get()
        return a.cpu().numpy() if hasattr(a, "cpu") else np.asarray(a)

    def cache(self, blocks, B, D):
        import torch

        return torch.full((blocks * B, D), float("nan"), dtype=torch.float64, device="cuda")

    def write(self, cache, slots, vals):
        cache.index_copy_(0, slots.long(), vals.to(cache.dtype))

    def gather(self, cache, slots):
        return cache.index_select(0, slots.long())

    def attention(self, q, K, V):
        import torch

        w = torch.softmax(K @ q.to(K.dtype) / q.shape[0] ** 0.5, dim=0)
        return w @ V

    def close(self, a, b):
        return bool(np.allclose(a, b, rtol=1e-9, atol=1e-9))


@requires_torch_cuda
@pytest.mark.parametrize(("seed", "k", "B"), [(0, 3, 16), (1, 4, 4), (2, 2, 7)])
def test_toy_draft_loop_on_the_gpu(seed, k, B):
    import torch

    checks = run_loop(
        lambda s: VllmDraftPlanner(**s),
        TorchOps(),
        seed=seed,
        k=k,
        B=B,
        M=203,
        rows=33,
        cycles=25,
        to_device=lambda a: torch.as_tensor(np.ascontiguousarray(a), device="cuda"),
    )
    assert checks == (k - 1) * 25 * 33


# -- the per-draft-step baseline --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_per_step_baseline_equals_the_reference(seed):
    from kvaddr.strategies.vllm_draft_per_step import VllmDraftPerStep

    rng = np.random.default_rng(2000 + seed)
    case = draft_case(
        rng,
        num_reqs=[64, 1024, 300, 5][seed],
        max_num_reqs=1100,
        k=[3, 3, 5, 2][seed],
        block_sizes=[(16,), (16, 64), (8, 16, 32), (4,)][seed],
        max_model_len=4096,
        dummy_share=0.1,
        attention=[None, "flashinfer,varlen", "flashinfer", "varlen"][seed],
    )
    base = VllmDraftPerStep(**case["settings"])
    _check(base, case, "per-step")
    assert base.launches_per_cycle > 1


def test_profile_rows_check_then_time_both_designs():
    """kvaddr.measure.vllm_draft_profile (``kvaddr profile --engine vllm --spec-tokens k``): a row per
    shape, the one launch checked equal to vLLM's per-draft-step design and to the reference, both
    timed with and without attention metadata."""
    from kvaddr.measure import vllm_draft_profile
    from kvaddr.measure.vllm_profile import VllmProfileOptions

    opts = VllmProfileOptions(shapes=("decode:64", "mixed:300:4000"), block_sizes=(16, 64), context=(128, 4096))
    section = vllm_draft_profile.measure(opts, 3, budget_s=0.05)
    assert section["spec_tokens"] == 3 and [r["shape"] for r in section["rows"]] == ["decode:64", "mixed:300:4000"]
    for r in section["rows"]:
        for label, launches in (("addressing", 1 + 2 * 2), ("metadata", 1 + 2 * (2 + 2))):
            m = r[label]
            assert m["kvaddr"]["us"] > 0 and m["per_step"]["us"] > 0 and m["per_step"]["launches"] == launches
            assert m["saving_us"] == pytest.approx(m["per_step"]["us"] - m["kvaddr"]["us"])


def test_profile_command_with_spec_tokens_on_the_vllm_engine(tmp_path):
    """``kvaddr profile --engine vllm --spec-tokens 3``: the report's draft_steps rows and their lines."""
    import json

    from click.testing import CliRunner

    from kvaddr import cli

    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        cli.cli,
        ["profile", "--engine", "vllm", "--batch", "64", "--spec-tokens", "3", "--budget", "0.05",
         "--mode", "graph", "--input-sets", "1", "--json", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["options"]["spec_tokens"] == 3 and [x["shape"] for x in doc["draft_steps"]["rows"]] == ["decode:64"]
    assert "vLLM draft addressing, 3 draft tokens per verify step" in r.output
