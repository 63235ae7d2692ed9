"""The vLLM step's DSA outputs (docs/dsa.md, "The vLLM step"): the NumPy reference against the
worked example and kvaddr.dsa_reference's indexer metadata, and the kernel's device code
(vllm_dsa.cuh, emulated on the CPU by tests/support/vllm_emulator.py) driven by the real
VllmStepPlanner against the reference, on random batches with dummy rows, bad inputs and
sequences of steps. The GPU runs the same comparisons in tests/gpu/test_vllm_dsa_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr import dispatch
from kvaddr.dsa_reference import indexer_cache_offsets, indexer_metadata
from kvaddr.engines.vllm_config import VllmStepConfig
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_emulator
from tests.support.vllm_cases import assert_same, corrupt, new_batch, planner_kwargs, random_case
from tests.support.vllm_fake_cupy import install, on_fake

I32 = np.int32
NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
DSA_FIELDS = ("value_offsets", "scale_offsets", "ks", "ke", "ctx", "cu_seq_lens", "req_id_per_token")
emulated = pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


def worked_example():
    """docs/dsa.md's example in vLLM's terms: request 0 (row 3) a decode at position 6 with table
    [5, 2], a dummy request (row -1) of one token, request 2 (row 1) a prefill chunk at positions
    2, 3, 4 with table [9, 3]; B = 4, 8 tokens of capacity."""
    cfg = VllmStepConfig(4, 8, [4], [2])
    table = np.zeros((4, 2), I32)
    table[3], table[1] = [5, 2], [9, 3]
    x = dict(
        idx_mapping=np.array([3, -1, 1], I32),
        query_start_loc=np.array([0, 1, 2, 5], I32),
        num_computed_tokens=np.array([0, 2, 0, 6], I32),
        block_tables=[table],
        num_blocks=[np.array([0, 2, 0, 2], I32)],
    )
    return cfg, x


def test_reference_worked_example():
    cfg, x = worked_example()
    out = vllm_step_reference(cfg, **x, dsa=True).outputs
    d = out.dsa
    assert out.slot_mappings[0].tolist() == [10, -1, 38, 39, 12, -1, -1, -1]
    assert d.value_offsets.tolist() == [1312, -1, 5008, 5136, 1584, -1, -1, -1]
    assert d.scale_offsets.tolist() == [1576, -1, 5272, 5276, 2096, -1, -1, -1]
    assert d.ctx.tolist() == [7, 0, 3, 4, 5, 0, 0, 0]
    assert d.ks.tolist() == [0] * 8
    assert d.ke.tolist() == [0, 0, 3, 4, 5, 0, 0, 0]
    assert d.cu_seq_lens.tolist() == [0, 5, 5, 5, 5]
    assert d.req_id_per_token.tolist() == [0, -1, 2, 2, 2, -1, -1, -1]
    # dsa_decode_len = 3: the chunk of three tokens is a decode (no prefills)
    d3 = vllm_step_reference(cfg, **x, dsa=True, dsa_decode_len=3).outputs.dsa
    assert d3.ke.tolist() == [0] * 8 and d3.cu_seq_lens.tolist() == [0] * 5


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.sampled_from([1, 2, 3]))
def test_reference_equals_indexer_metadata(seed, G, n):
    """A batch of decodes (n tokens each) then prefills, no dummies: the step's DSA outputs are
    dsa_reference.indexer_metadata's and indexer_cache_offsets' of the step's own slots."""
    rng = np.random.default_rng(seed)
    D, P = int(rng.integers(0, 6)), int(rng.integers(0, 6))
    q = np.concatenate([np.full(D, n), rng.integers(n + 1, n + 9, P)]).astype(np.int64)
    nb = D + P
    M = nb + int(rng.integers(0, 3))
    cfg, state = random_case(
        rng,
        max_num_reqs=max(M, 1),
        num_reqs=0,
        block_sizes=tuple([16, 64, 5][:G]),
        max_query=int(q.max(initial=1)),
        dummy_fraction=0.0,
        spare_tokens=int(q.sum()) + 3,
    )
    idx = rng.permutation(max(M, 1))[:nb].astype(I32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(I32)
    x = dict(state, idx_mapping=idx, query_start_loc=qsl)
    g = int(rng.integers(0, G))
    V, S = int(rng.choice([128, 64])), int(rng.choice([4, 8]))
    res = vllm_step_reference(
        cfg, **{k: x[k] for k in NAMES}, dsa=True, dsa_cache=g, dsa_decode_len=n, dsa_value_bytes=V, dsa_scale_bytes=S
    )
    out, d = res.outputs, res.outputs.dsa
    nt = int(qsl[-1])
    seq = out.seq_lens[:nb]
    m = indexer_metadata(seq, q, num_decodes=D)
    assert d.ctx[: D * n].reshape(D, n).tolist() == m.decode_ctx.tolist()
    assert d.ks[D * n : nt].tolist() == m.ks.tolist() and d.ke[D * n : nt].tolist() == m.ke.tolist()
    assert d.cu_seq_lens[: P + 1].tolist() == m.cu_seq_lens.tolist()
    assert d.req_id_per_token[:nt].tolist() == m.req_id_per_token.tolist()
    assert d.ctx[:nt].tolist() == m.ctx.tolist()
    off = indexer_cache_offsets(out.slot_mappings[g], cfg.block_sizes[g], value_bytes=V, scale_bytes=S)
    assert d.value_offsets.tolist() == off.value.tolist() and d.scale_offsets.tolist() == off.scale.tolist()
    assert (d.req_id_per_token[nt:] == -1).all() and (d.value_offsets[nt:] == -1).all()


def _host(a):
    return a.a.copy()


def check(planner, cfg, x, padded=None, label="", **dsa_kw):
    got = planner.compute(*(on_fake(x)[k] for k in NAMES), num_reqs_padded=padded)
    want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=padded, dsa=True, **dsa_kw)
    host = {k: (tuple(_host(t) for t in v) if isinstance(v, tuple) else _host(v)) for k, v in got.as_dict().items()}
    assert_same(host, want.outputs.as_dict(), label)  # the step's own outputs: unchanged
    for f in DSA_FIELDS:
        a, b = _host(getattr(got.dsa, f)), getattr(want.outputs.dsa, f)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), f"{label}: dsa.{f}\n got {a}\nwant {b}"
    assert planner.errors() == (want.error_mask, want.error_key), label
    return want


@emulated
def test_emulated_worked_example(monkeypatch):
    from kvaddr.engines.vllm import VllmStepPlanner

    emu = install(monkeypatch, on_launch=vllm_emulator.run)
    cfg, x = worked_example()
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True)
    check(p, cfg, x)
    (launch,) = emu.launches
    assert launch["name"] == dispatch.vllm_kernel(False, dsa=True) == "vllm_step<false, true>"
    assert launch["grid"][1] == 2  # the DSA row
    off = VllmStepPlanner(**planner_kwargs(cfg))
    off.compute(*(on_fake(x)[k] for k in NAMES))
    assert emu.launches[-1]["name"] == "vllm_step<false>" and emu.launches[-1]["grid"][1] == 1
    assert off.outputs.dsa is None


@emulated
@settings(max_examples=50, deadline=None)
@given(st.data())
def test_emulated_random_steps(data):
    from kvaddr.engines.vllm import VllmStepPlanner

    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    G = data.draw(st.integers(1, 3))
    block_sizes = tuple(data.draw(st.lists(st.sampled_from([1, 4, 13, 64]), min_size=G, max_size=G)))
    cp = data.draw(st.sampled_from([1, 1, 2]))
    M = data.draw(st.integers(1, 40))
    max_query = data.draw(st.sampled_from([1, 3, 20]))
    cfg, state = random_case(
        rng,
        max_num_reqs=M,
        num_reqs=M,
        block_sizes=block_sizes,
        max_query=max_query,
        cp_size=cp,
        cp_rank=data.draw(st.integers(0, cp - 1)),
        slot_mapping_enabled=[data.draw(st.booleans()) for _ in range(G)],
        idx_dtype=data.draw(st.sampled_from([np.int32, np.int64])),
        slot_dtype=data.draw(st.sampled_from([np.int32, np.int64])),
        spare_tokens=M * max_query,
        max_block_id=data.draw(st.sampled_from([1 << 20, (1 << 31) // 64])),
    )
    kw = dict(
        dsa_cache=data.draw(st.integers(0, G - 1)),
        dsa_decode_len=data.draw(st.integers(1, 3)),
        dsa_value_bytes=data.draw(st.sampled_from([128, 7])),
        dsa_scale_bytes=data.draw(st.sampled_from([4, 2])),
    )
    bad = data.draw(st.booleans())
    with pytest.MonkeyPatch.context() as mp:
        install(mp, on_launch=vllm_emulator.run)
        p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, **kw)
        for step in range(3):
            n = data.draw(st.integers(0, M))
            x = new_batch(rng, cfg, state, n, max_query=max_query)
            if bad:
                x = corrupt(rng, cfg, x, rate=0.15)
            check(p, cfg, x, data.draw(st.integers(n, M)), label=f"seed {seed}, step {step}", **kw)


@emulated
def test_emulated_many_requests(monkeypatch):
    """More requests than a block's tile (the scan's carry), prefills among decodes, dummies."""
    from kvaddr.engines.vllm import VllmStepPlanner

    install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(5)
    cfg, x = random_case(
        rng, max_num_reqs=1500, num_reqs=1300, block_sizes=(16, 64), max_query=4, dummy_fraction=0.1, spare_tokens=20
    )
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, dsa_decode_len=2)
    want = check(p, cfg, x, 1400, dsa_decode_len=2)
    assert (want.outputs.dsa.ks > 0).any() and (want.outputs.dsa.req_id_per_token == -1).any()


@emulated
@pytest.mark.parametrize("M, n", [(1, 1), (60, 1), (60, 3), (300, 2), (2047, 1), (2048, 2), (2049, 1), (2600, 2)])
def test_emulated_edge_batches(monkeypatch, M, n):
    """The batches that select each path of the DSA blocks (tests.support.vllm_dsa_cases.EDGES: only
    decodes, plain or MTP; only prefills; one prefill last or first; dummies only; padding past a
    few tokens; no request) around the staged query_start_loc's and the tile's sizes (2047 to 2049
    requests, several tiles), one step after another: the emulator also checks that each element of
    each DSA output is written by exactly one thread of the launch (token row or DSA row)."""
    from kvaddr.engines.vllm import VllmStepPlanner
    from tests.support.vllm_dsa_cases import EDGES, edge_batch

    install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(M + n)
    cfg, state = random_case(
        rng, max_num_reqs=M, num_reqs=M, block_sizes=(16, 64), max_query=40, spare_tokens=M * 20 + 300
    )
    p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, dsa_decode_len=n)
    seen = set()
    for kind in EDGES + EDGES[::-1]:
        x = edge_batch(rng, cfg, state, kind, M, n=n)
        want = check(p, cfg, x, M, label=f"M {M} n {n} {kind}", dsa_decode_len=n).outputs.dsa
        seen.add((kind, bool((want.ke > 0).any()), bool((want.req_id_per_token >= 0).any())))
    # the prefill batches have prefill tokens, the decode and dummy batches none
    assert ("prefills", True, True) in seen and any(k == "decodes" and not pre for k, pre, _ in seen)
    assert ("dummy_prefills", False, False) in seen and ("empty", False, False) in seen


def test_planner_arguments(monkeypatch):
    from kvaddr.engines.vllm import VllmStepPlanner

    install(monkeypatch)
    kw = dict(max_num_reqs=4, max_num_batched_tokens=8, block_sizes=[4, 16], widths=[2, 2])
    with pytest.raises(TypeError, match="dsa must be a bool"):
        VllmStepPlanner(**kw, dsa=1)
    with pytest.raises(ValueError, match="dsa_cache"):
        VllmStepPlanner(**kw, dsa=True, dsa_cache=2)
    with pytest.raises(ValueError, match="dsa_decode_len"):
        VllmStepPlanner(**kw, dsa=True, dsa_decode_len=0)
    p = VllmStepPlanner(**kw, dsa=True)
    assert p.dsa_cache == 1 and p.kernel_name == "vllm_step<false, true>"
    assert p.outputs.dsa.cu_seq_lens.shape == (5,) and p.outputs.dsa.value_offsets.shape == (8,)


@emulated
@pytest.mark.parametrize("n, groups", [(1, (64,)), (2, (4, 13)), (3, (16, 64, 5))])
def test_emulated_decodes_and_prefills(monkeypatch, n, groups):
    """tests.support.vllm_dsa_cases' batches (the GPU tests'): decodes of n tokens, prefill chunks,
    dummy rows, each group as the indexer cache's, the bound step too."""
    from kvaddr.engines.vllm import VllmStepPlanner
    from tests.support.vllm_dsa_cases import dsa_batch

    install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(n)
    M = 60
    cfg, state = random_case(rng, max_num_reqs=M, num_reqs=M, block_sizes=groups, max_query=40, spare_tokens=M * 8)
    for g in range(len(groups)):
        kw = dict(dsa_cache=g, dsa_decode_len=n)
        p = VllmStepPlanner(**planner_kwargs(cfg), dsa=True, **kw)
        for i, num_reqs in enumerate([M, 20, 0, M]):
            x = dsa_batch(rng, cfg, state, num_reqs, n=n, prefill=0.3)
            want = check(p, cfg, x, min(M, num_reqs + 3), label=f"group {g} step {i}", **kw)
        assert (want.outputs.dsa.ke > 0).any() and (
            want.outputs.dsa.req_id_per_token[: int(x["query_start_loc"][-1])] == -1
        ).any()
        f = on_fake(state)
        bound = p.bind(f["num_computed_tokens"], f["block_tables"], f["num_blocks"])
        x = dsa_batch(rng, cfg, state, 50, n=n, prefill=0.3)
        fx = on_fake(x)
        got = bound.launch(fx["idx_mapping"], fx["query_start_loc"], num_reqs_padded=M)
        want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, num_reqs_padded=M, dsa=True, **kw)
        for name in DSA_FIELDS:
            assert _host(getattr(got.dsa, name)).tolist() == getattr(want.outputs.dsa, name).tolist(), name


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 50, 2047, 2048, 2049, 5000]), st.booleans())
def test_block_model_equals_the_reference(seed, M, bad):
    """The DSA blocks' votes, tiles and scan (tests/support/vllm_dsa_model.py) give the reference's
    cu_seq_lens and the prefill tokens' ks, across tile boundaries, with dummies, bad inputs and
    saturating sums."""
    from tests.support.vllm_dsa_cases import dsa_batch
    from tests.support.vllm_dsa_model import model_cu_and_ks

    rng = np.random.default_rng(seed)
    cfg, state = random_case(rng, max_num_reqs=M, num_reqs=0, block_sizes=(16,), max_query=6, spare_tokens=M * 3)
    x = dsa_batch(rng, cfg, state, int(rng.integers(0, M + 1)), n=2, prefill=0.3, max_chunk=6)
    if bad:
        x = corrupt(rng, cfg, x, rate=0.05)
    if rng.random() < 0.3:  # lengths whose sum passes 2^31 - 1
        x["num_computed_tokens"] = np.where(x["num_computed_tokens"] >= 0, 2**30, x["num_computed_tokens"]).astype(I32)
    want = vllm_step_reference(cfg, **{k: x[k] for k in NAMES}, dsa=True, dsa_decode_len=2).outputs.dsa
    cu, ks = model_cu_and_ks(
        x["idx_mapping"], x["query_start_loc"], x["num_computed_tokens"], M, cfg.max_num_batched_tokens, 2
    )
    assert cu.tolist() == want.cu_seq_lens.tolist()
    assert np.where(ks >= 0, ks, 0).tolist() == want.ks.tolist()
    # the DSA blocks write exactly the prefill tokens' ks (ke = ks + ctx > 0), the token blocks the others'
    assert (ks >= 0).tolist() == (want.ke > 0).tolist()
