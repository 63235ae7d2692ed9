"""VllmStepPlanner(attention=...) on the GPU (``vllm_step<true>``) against the NumPy reference
(docs/vllm.md, "Attention metadata"): the worked example, random batches (permuted sparse
idx_mapping, dummies, 1-4 groups with different block sizes incl. non powers of two, several
metadata blocks per group), DCP (cp_size 2 and 4, interleave 1 and B), capacity overflow, the
bad-value rows, corrupted inputs (bits and keys), every element written (poisoned buffers, a
big step then a small one), CUDA-graph replay with new contents, the addressing outputs
unchanged by attention, and a small end-to-end paged-KV read through kv_indices.

Skips, with the reason, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support.gpu import requires_gpu
from tests.support.vllm_attention_cases import DEVICE_ROWS, WORKED, WORKED_DCP, assert_attention
from tests.support.vllm_cases import (
    assert_same,
    corrupt,
    new_batch,
    planner_kwargs,
    random_case,
    to_numpy,
    worked_example,
)

pytestmark = requires_gpu

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
BOTH = ("flashinfer", "varlen")


def on_device(x: dict) -> dict:
    import cupy

    out = {k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()}
    cupy.cuda.runtime.deviceSynchronize()
    return out


def make(cfg, attention=BOTH, N=1 << 20, **kw):
    from kvaddr.engines.vllm import VllmStepPlanner

    return VllmStepPlanner(**planner_kwargs(cfg), attention=attention, kv_indices_capacity=N, **kw)


def reference(cfg, x, attention=BOTH, N=1 << 20, padded=None):
    return vllm_step_reference(
        cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded, attention=attention, kv_indices_capacity=N
    )


def assert_attention_same(got, want, groups, label=""):
    """Every field of the groups asked for, element by element (the reference's are NumPy)."""
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k"):
        w = getattr(want, name)
        g = getattr(got, name)
        assert (w is None) == (g is None), (label, name)
        if w is None:
            continue
        a = to_numpy(g)
        assert a.dtype == w.dtype and a.shape == w.shape, (label, name, a.dtype, a.shape, w.shape)
        if not np.array_equal(a, w):
            at = tuple(np.argwhere(a != w)[0])
            raise AssertionError(f"{label}: {name} differs at {at}: got {a[at]}, want {w[at]}")
    if "varlen" in groups:
        assert int(to_numpy(got.max_seqlen_q)) == int(want.max_seqlen_q), (label, "max_seqlen_q")
        assert to_numpy(got.max_seqlen_k).tolist() == want.max_seqlen_k.tolist(), (label, "max_seqlen_k")
        for g, (a, w) in enumerate(zip(got.seqused_k, want.seqused_k)):
            assert np.array_equal(to_numpy(a), w), (label, "seqused_k", g)


def run_and_compare(planner, cfg, x, attention=BOTH, N=1 << 20, padded=None, label=""):
    import cupy

    d = on_device(x)
    out = planner.compute(*(d[k] for k in NAMES), num_reqs_padded=padded)
    cupy.cuda.get_current_stream().synchronize()
    want = reference(cfg, x, attention, N, padded)
    assert_same(out, want.outputs.as_dict(), label)
    assert_attention_same(out.attention, want.outputs.attention, attention, label)
    assert planner.errors() == (want.error_mask, want.error_key), label
    return out, want


def test_worked_example():
    cfg, x = worked_example()
    out, _ = run_and_compare(make(cfg, N=8), cfg, x, N=8)
    assert_attention(out.attention, WORKED)


@pytest.mark.parametrize("rank", [0, 1])
def test_worked_example_dcp(rank):
    cfg, x = worked_example(cp_size=2, cp_rank=rank)
    out, _ = run_and_compare(make(cfg, N=8), cfg, x, N=8)
    assert_attention(out.attention, {**WORKED, **WORKED_DCP[rank]})


@pytest.mark.parametrize("groups", [("flashinfer",), ("varlen",), ("flashinfer", "varlen", "page_table")])
def test_group_subsets(groups):
    rng = np.random.default_rng(1)
    cfg, x = random_case(rng, max_num_reqs=64, num_reqs=50, block_sizes=(16, 24), max_query=5)
    out, _ = run_and_compare(make(cfg, attention=groups), cfg, x, attention=groups)
    if "page_table" in groups:
        assert out.attention.page_table is out.input_block_tables


@pytest.mark.parametrize(
    "block_sizes", [(16,), (16, 64), (3, 24, 7, 128), (1, 16, 5, 32)], ids=lambda b: "B" + "-".join(map(str, b))
)
@pytest.mark.parametrize(("M", "n"), [(5, 5), (300, 257), (1100, 1000), (600, 0)])
@pytest.mark.parametrize("max_query", [1, 40])
def test_random_batches(block_sizes, M, n, max_query):
    rng = np.random.default_rng(M * 7 + n + max_query + len(block_sizes))
    cfg, x = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=n,
        block_sizes=block_sizes,
        max_query=max_query,
        max_context=700,
        dummy_fraction=0.15,
        idx_dtype=np.int64 if M == 300 else np.int32,
        sliding_window_reach=[0, 33, 0, 0][: len(block_sizes)],
    )
    planner = make(cfg, N=1 << 20)
    run_and_compare(planner, cfg, x, N=1 << 20, padded=min(M, n + 3), label=f"{block_sizes} M={M} n={n}")


@pytest.mark.parametrize(("M", "n"), [(8200, 4096), (3000, 2500)])
def test_pass1_past_one_chunk(M, n):
    """num_reqs > 1024 (pass 1 loops after its first chunk), 2 groups, decode-like (the
    benchmark's decode 4096 shape: max_num_reqs ~ 2 * num_reqs), the automatic rows per block."""
    rng = np.random.default_rng(n)
    cfg, x = random_case(
        rng, max_num_reqs=M, num_reqs=n, block_sizes=(16, 64), max_query=1, max_context=1500, dummy_fraction=0.05
    )
    run_and_compare(make(cfg, N=1 << 20), cfg, x, N=1 << 20, padded=n, label=f"M {M} n {n}")


@pytest.mark.parametrize("seed", range(3))
def test_corrupted_inputs_and_capacity(seed):
    """Corrupted inputs and an overflowing N."""
    rng = np.random.default_rng(40 + seed)
    cfg, x = random_case(rng, max_num_reqs=300, num_reqs=290, block_sizes=(16, 7), max_query=6)
    x = corrupt(rng, cfg, x, rate=0.05)
    run_and_compare(make(cfg, N=3000), cfg, x, N=3000, label=f"seed {seed}")
    run_and_compare(make(cfg, N=50), cfg, x, N=50, label=f"seed {seed} N=50")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("interleave", ["1", "B"])
@pytest.mark.parametrize("rank", [0, -1])
def test_dcp(cp, interleave, rank):
    rng = np.random.default_rng(cp * 10 + len(interleave))
    B = 16
    il = 1 if interleave == "1" else B
    c = rank % cp
    cfg, x = random_case(
        rng,
        max_num_reqs=300,
        num_reqs=280,
        block_sizes=(B, 32),
        max_query=20,
        max_context=900,
        cp_size=cp,
        cp_rank=c,
        cp_interleave=il,
        dcp_sharded=[True, False],
    )
    out, _ = run_and_compare(make(cfg), cfg, x, label=f"cp {cp} il {il} rank {c}")
    assert out.attention.seqused_k[0] is out.dcp_local_seq_lens and out.attention.seqused_k[1] is out.seq_lens


@pytest.mark.parametrize("N", [1, 37, 1000])
def test_capacity_overflow(N):
    rng = np.random.default_rng(N)
    cfg, x = random_case(rng, max_num_reqs=600, num_reqs=550, block_sizes=(4, 16), max_query=3, max_context=200)
    _, want = run_and_compare(make(cfg, N=N), cfg, x, N=N)
    assert want.error_mask & 512


@pytest.mark.parametrize("row", DEVICE_ROWS, ids=[r[0] for r in DEVICE_ROWS])
def test_bad_value_rows(row):
    from kvaddr.engines.vllm_errors import decode_vllm_error_key

    _, mk, N, bits, key = row
    cfg, x = mk()
    _, want = run_and_compare(make(cfg, N=N), cfg, x, N=N)
    assert want.error_mask & bits and decode_vllm_error_key(want.error_key) == key


@pytest.mark.parametrize("seed", range(6))
def test_corrupted_inputs_bits_and_keys(seed):
    rng = np.random.default_rng(seed)
    cp = (1, 2)[seed % 2]
    cfg, x = random_case(
        rng, max_num_reqs=300, num_reqs=290, block_sizes=(16, 7), max_query=6, cp_size=cp, cp_rank=cp - 1
    )
    x = corrupt(rng, cfg, x, rate=0.05)
    run_and_compare(make(cfg, N=3000), cfg, x, N=3000, label=f"seed {seed}")


def test_every_element_written_and_nothing_stale():
    import cupy

    rng = np.random.default_rng(3)
    cfg, state = random_case(rng, max_num_reqs=600, num_reqs=600, block_sizes=(16, 5), max_query=4, spare_tokens=3000)
    planner = make(cfg, N=1 << 16)
    a = planner.attention_outputs
    for buf in (a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_last_page_len, a.cu_seqlens_k, planner._max_seqlen):
        buf.fill(123456)
    big = new_batch(rng, cfg, state, 590, max_query=4)
    run_and_compare(planner, cfg, big, N=1 << 16, label="big")
    small = new_batch(rng, cfg, state, 7, max_query=4)
    run_and_compare(planner, cfg, small, N=1 << 16, label="small after big")
    cupy.cuda.runtime.deviceSynchronize()


def test_attention_leaves_the_addressing_unchanged():
    import cupy

    from kvaddr.engines.vllm import VllmStepPlanner

    rng = np.random.default_rng(9)
    cfg, x = random_case(rng, max_num_reqs=400, num_reqs=390, block_sizes=(16, 64), max_query=10)
    d = on_device(x)
    plain = VllmStepPlanner(**planner_kwargs(cfg))
    attn = make(cfg)
    o1 = plain.compute(*(d[k] for k in NAMES), num_reqs_padded=395)
    o2 = attn.compute(*(d[k] for k in NAMES), num_reqs_padded=395)
    cupy.cuda.runtime.deviceSynchronize()
    assert_same(
        o2, {k: to_numpy(v) if k != "input_block_tables" else tuple(map(to_numpy, v)) for k, v in o1.as_dict().items()}
    )
    assert plain.errors() == attn.errors()


def test_cupy_graph_replay_with_new_contents():
    import cupy

    rng = np.random.default_rng(5)
    cfg, state = random_case(rng, max_num_reqs=512, num_reqs=512, block_sizes=(16, 24), max_query=4, spare_tokens=2000)
    N = 1 << 15
    planner = make(cfg, N=N)
    n, padded = 400, 448
    first = new_batch(rng, cfg, state, n, max_query=4)
    d = on_device(first)
    cupy.cuda.runtime.deviceSynchronize()  # the null stream's writes are done before a non-blocking stream reads them
    stream = cupy.cuda.Stream(non_blocking=True)
    planner.compute(*(d[k] for k in NAMES), num_reqs_padded=padded, stream=stream)
    stream.synchronize()
    stream.begin_capture()
    planner.compute(*(d[k] for k in NAMES), num_reqs_padded=padded, stream=stream)
    graph = stream.end_capture()
    for i in range(4):
        step = new_batch(rng, cfg, state, n, max_query=4)
        step["num_computed_tokens"] = state["num_computed_tokens"].copy()
        step["num_computed_tokens"][rng.integers(0, 512, 20)] = 0
        for k in NAMES:
            src, dst = step[k], d[k]
            if isinstance(dst, list):
                for a, b in zip(src, dst):
                    b.set(a, stream=stream)
            else:
                dst.set(src, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        want = reference(cfg, step, N=N, padded=padded)
        assert_same(planner.outputs, want.outputs.as_dict(), f"replay {i}")
        assert_attention_same(planner.outputs.attention, want.outputs.attention, BOTH, f"replay {i}")
        assert planner.errors(stream) == (want.error_mask, want.error_key)


@pytest.mark.parametrize("cp", [1, 2])
def test_paged_kv_read_back_through_kv_indices(cp):
    """End to end, small: over several steps each token's value is written at its slot
    (slot_mappings), then every request's KV is read back page by page through
    kv_indptr / kv_indices / kv_last_page_len (as FlashInfer's paged KV does) and must be
    the request's own tokens, in order (with DCP: this rank's local tokens)."""
    import cupy

    B, M, steps = 8, 40, 4
    W = 64
    cfg_kw = dict(max_num_reqs=M, max_num_batched_tokens=512, block_sizes=[B], widths=[W])
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.engines.vllm_config import VllmStepConfig

    for c in range(cp):
        cfg = VllmStepConfig(**cfg_kw, cp_size=cp, cp_rank=c)
        planner = VllmStepPlanner(**planner_kwargs(cfg), attention=BOTH, kv_indices_capacity=4096)
        r2 = np.random.default_rng(99)  # every rank sees the same batches
        table = (r2.permutation(M * W).reshape(M, W) + 1).astype(np.int32)  # distinct blocks, 0 unused
        nct = np.zeros(M, np.int32)
        cache = np.full((M * W + 1) * B, -1, np.int64)  # value = request row * 10^6 + position
        for _ in range(steps):
            n = 30
            idx = r2.permutation(M)[:n].astype(np.int32)
            q = r2.integers(1, 12, n)
            qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
            nb = np.full(M, W, np.int32)
            x = dict(
                idx_mapping=idx,
                query_start_loc=qsl,
                num_computed_tokens=nct.copy(),
                block_tables=[table],
                num_blocks=[nb],
            )
            d = on_device(x)
            out = planner.compute(*(d[k] for k in NAMES))
            cupy.cuda.runtime.deviceSynchronize()
            assert planner.errors() == (0, (1 << 64) - 1)
            pos, slots = to_numpy(out.positions), to_numpy(out.slot_mappings)[0]
            for b in range(n):
                for t in range(qsl[b], qsl[b + 1]):
                    if slots[t] >= 0:
                        cache[slots[t]] = idx[b] * 10**6 + pos[t]
            a = out.attention
            indptr, indices = to_numpy(a.kv_indptr)[0], to_numpy(a.kv_indices)[0]
            last = to_numpy(a.kv_last_page_len)[0]
            seqused = to_numpy(a.seqused_k[0])
            for b in range(n):
                pages = indices[indptr[b] : indptr[b + 1]]
                L = int(seqused[b])
                assert len(pages) == -(-L // B) and (L == 0 or last[b] == (L - 1) % B + 1)
                got = np.concatenate([cache[p * B : p * B + B] for p in pages])[:L] if L else np.zeros(0)
                s = nct[idx[b]] + q[b]
                if cp == 1:
                    assert got.tolist() == [idx[b] * 10**6 + j for j in range(s)]
                else:
                    # rank c holds positions whose run (j // I) % cp == c, densely, in order
                    mine = [j for j in range(s) if j % cp == c]
                    assert got.tolist() == [idx[b] * 10**6 + j for j in mine]
            nct[idx] += q.astype(np.int32)
