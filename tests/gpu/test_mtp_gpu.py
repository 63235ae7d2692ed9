"""Every MTP substep in one launch (``StepPlanner(draft_steps=k).compute_draft_steps``) against
the NumPy reference (kvaddr.spec_reference) substep by substep, and against ``compute()`` run on
each substep's lengths: random acceptance 0..k, chunked-prefill rows with 0, 1-3 caches with
non-power-of-two block sizes, attention metadata, more than 1024 (and 4096) requests, bad values
(error bits and the first-bad key), every element written, bound launches and graph replays with
new contents. Skipped without a GPU."""

import numpy as np
import pytest

from kvaddr.errors import NO_ERROR_KEY
from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_substep_lengths
from tests.support.gpu import assert_attention_equal, assert_outputs_equal, device_copy, requires_gpu

pytestmark = requires_gpu

ALL = "flashinfer,varlen,page_table"


def _case(seed, bsz, k, sizes, *, capacity=None, bad=False, big_ids=False):
    """Random substep inputs: accept_num in 0..k (0: idle or chunked prefill), tables wide enough
    for every substep (unless ``bad``: short rows, negative ids, negative lengths)."""
    rng = np.random.default_rng(seed)
    dec = rng.integers(0, 300, bsz).astype(np.int32)
    acc = rng.integers(0, k + 1, bsz).astype(np.int32)
    tables = []
    for B in sizes:
        W = -(-(300 + 2 * k + 2) // B)
        hi = 2**31 - 1 if big_ids else 1 << 20
        t = rng.integers(0, hi, (bsz + 3, W)).astype(np.int32)
        if bad:
            t[rng.random(t.shape) < 0.02] = -1
            t = np.ascontiguousarray(t[:, : max(1, W // 2)])
        tables.append(t)
    if bad and bsz:
        dec[rng.integers(0, bsz)] = -5
        acc[rng.integers(0, bsz)] = -1
    tokens = int(np.maximum(acc, 0).sum())
    C = capacity if capacity is not None else max(tokens + int(rng.integers(0, 40)), 1)
    return dec, acc, tables, list(sizes), C


def _expected(dec, acc, tables, sizes, C, k, attention, N, pos_dtype=np.int64):
    refs = []
    for j in range(k):
        dj, qj = mtp_substep_lengths(dec, acc, j)
        refs.append(
            step_addressing(
                dj, qj, tables, sizes, C, position_dtype=pos_dtype, attention=attention, kv_indices_capacity=N
            )
        )
    return refs


def _poison(p):
    d = p._draft
    for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping", "num_tokens"):
        getattr(d, name).fill(0x5A5A5A5A)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "max_seqlen"):
        buf = getattr(d, name)
        if buf is not None:
            buf.fill(0x5A5A5A5A)


def _run(dec, acc, tables, sizes, C, k, *, attention=None, N=None, max_requests=None, pos_dtype=np.int64, label=""):

    from kvaddr import StepPlanner

    bsz = dec.shape[0]
    kw = dict(attention=attention, kv_indices_capacity=N, position_dtype=pos_dtype)
    p = StepPlanner(max(max_requests or bsz, 1), C, sizes, draft_steps=k, **kw)
    dtabs = device_copy(list(tables))
    d_dec, d_acc = device_copy([dec, acc])
    _poison(p)
    out = p.compute_draft_steps(d_dec, d_acc, dtabs)
    mask, key = p.errors()
    refs = _expected(dec, acc, tables, sizes, C, k, attention, N, pos_dtype)
    for j, ref in enumerate(refs):
        got = out.substep(j)
        assert_outputs_equal(got, ref.outputs, f"{label} substep {j}")
        if attention:
            assert_attention_equal(got.attention, ref.outputs.attention, f"{label} substep {j}")
    want_mask = 0
    want_key = NO_ERROR_KEY
    for ref in refs:
        want_mask |= ref.error_mask
        want_key = min(want_key, ref.error_key)
    assert (mask, key) == (want_mask, want_key), label
    return p, out, refs, (d_dec, d_acc, dtabs)


@pytest.mark.parametrize("bsz", [0, 1, 7, 64, 100, 1027, 5000])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_substep_equals_the_reference(bsz, k):
    dec, acc, tables, sizes, C = _case(bsz * 10 + k, bsz, k, (64,))
    _run(dec, acc, tables, sizes, C, k, label=f"bsz={bsz} k={k}")


@pytest.mark.parametrize("sizes", [(5,), (16, 3), (64, 7, 1)])
@pytest.mark.parametrize("attention", [None, "varlen", "flashinfer", "page_table", ALL])
@pytest.mark.parametrize("bsz", [3, 300, 1500])
def test_caches_and_attention(sizes, attention, bsz):
    dec, acc, tables, sizes, C = _case(bsz + len(sizes), bsz, 3, sizes)
    N = None
    if attention and "flashinfer" in attention:
        N = int(sum(-(-(int(d) + 3 + 2) // min(sizes)) for d in dec)) + 17
    _run(dec, acc, tables, sizes, C, 3, attention=attention, N=N, label=f"{sizes} {attention} bsz={bsz}")


@pytest.mark.parametrize("pos_dtype", [np.int64, np.int32])
def test_position_dtypes_and_block_ids_near_int32_max(pos_dtype):
    dec, acc, tables, sizes, C = _case(11, 200, 3, (3, 64), big_ids=True)
    _run(dec, acc, tables, sizes, C, 3, pos_dtype=pos_dtype, attention=ALL, N=40000, label="big ids")


def test_large_odd_block_sizes_and_positions_near_int32_max():
    """A token's block index and offset for block sizes up to 2^30 + 5 and positions around
    2^31 - 1 (below it a multiply by a reciprocal of the block size, past it a division)."""
    rng = np.random.default_rng(5)
    bsz, k = 300, 3
    dec = (2**31 - 1 - rng.integers(0, 5000, bsz)).astype(np.int32)
    dec[::7] = 2**31 - 1
    acc = rng.integers(0, k + 1, bsz).astype(np.int32)
    sizes = [65537, 1048573, 2**30 + 5]
    tables = [rng.integers(0, 1 << 20, (bsz, -(-(2**31 + 2 * k + 2) // B))).astype(np.int32) for B in sizes]
    C = max(int(acc.sum()), 1)
    _run(dec, acc, tables, sizes, C, k, label="large block sizes")


@pytest.mark.parametrize("bsz", [5, 700, 4500])
def test_bad_values_set_the_bits_and_keys_of_each_substep(bsz):
    dec, acc, tables, sizes, C = _case(bsz, bsz, 3, (4, 6), bad=True)
    _run(dec, acc, tables, sizes, C, 3, attention="flashinfer,page_table", N=64, label=f"bad bsz={bsz}")


@pytest.mark.parametrize("attention", [None, ALL])
@pytest.mark.parametrize(("bsz", "capacity"), [(1024, None), (1369, None), (3000, 300), (2500, 700)])
def test_request_windows(bsz, capacity, attention):
    """A batch within one tile over several token blocks (every block scans it whole), one just
    past a tile, and batches of several tiles over two or three token blocks (a block's requests
    span more than a tile; the capacity cuts the tokens: bit 4)."""
    dec, acc, tables, sizes, C = _case(bsz + 7, bsz, 3, (16, 7), capacity=capacity)
    N = 20000 if attention == ALL else None
    _run(dec, acc, tables, sizes, C, 3, attention=attention, N=N, label=f"bsz={bsz} C={C}")


def test_capacity_overflow_drops_tokens_and_sets_bit_4():
    dec, acc, tables, sizes, C = _case(3, 50, 4, (16,), capacity=20)
    assert int(acc.sum()) > 20
    _run(dec, acc, tables, sizes, C, 4, attention="varlen", label="capacity")


@pytest.mark.parametrize("attention", [None, "varlen", ALL])
def test_requests_of_hundreds_of_tokens_over_several_blocks(attention):
    """Substep 0 rows of 700, 513 and 260 tokens (searched, not written by the request's thread)
    among decode rows, the last of them past the capacity."""
    dec, acc, tables, sizes, _ = _case(21, 40, 3, (16, 7))
    acc[[3, 17, 30]] = [700, 513, 260]
    tables = [np.ascontiguousarray(np.tile(t, (1, 12))) for t in tables]
    N = 8000 if attention == ALL else None
    _run(dec, acc, tables, sizes, int(acc.sum()) - 50, 3, attention=attention, N=N, label="long rows")


@pytest.mark.parametrize("attention", ["varlen", ALL])
def test_token_sums_past_int32_saturate(attention):
    dec, acc, tables, sizes, _ = _case(22, 60, 3, (16,))
    acc[[10, 20, 45]] = [2**30 + 5, 2**30 + 7, 2**30 + 9]
    N = 900 if attention == ALL else None
    _run(dec, acc, tables, sizes, 3 * 256, 3, attention=attention, N=N, label="past int32")


@pytest.mark.parametrize("bsz", [1, 5, 37])
def test_token_blocks_past_the_last_request(bsz):
    """A capacity of many token blocks over a few requests: most blocks own no request and only pad."""
    dec, acc, tables, sizes, _ = _case(23 + bsz, bsz, 3, (4, 7))
    _run(dec, acc, tables, sizes, 6 * 256 - 5, 3, attention=ALL, N=700, label=f"bsz={bsz}")


def test_positions_only_planner():
    dec, acc, _, _, C = _case(4, 33, 2, ())
    _run(dec, acc, [], [], C, 2, label="positions only")


def test_smaller_batch_than_max_requests_and_compute_on_each_substep():
    """A planner's own compute() on substep j's lengths gives substep j's outputs."""
    import cupy

    from kvaddr import StepPlanner

    dec, acc, tables, sizes, C = _case(5, 90, 3, (16, 5))
    _, out, _, _ = _run(dec, acc, tables, sizes, C, 3, attention=ALL, N=9000, max_requests=2000, label="90/2000")
    q = StepPlanner(2000, C, sizes, attention=ALL, kv_indices_capacity=9000)
    dtabs = [cupy.asarray(t) for t in tables]
    for j in range(3):
        dj, qj = mtp_substep_lengths(dec, acc, j)
        one = q.compute(cupy.asarray(dj), cupy.asarray(qj), dtabs)
        assert_outputs_equal(out.substep(j), _host(one), f"compute substep {j}")
        assert_attention_equal(out.substep(j).attention, _host_att(one.attention), f"compute substep {j}")


def _host(o):
    from kvaddr.outputs import StepOutputs

    return StepOutputs(**{f: getattr(o, f).get() for f in o.as_dict()})


def _host_att(a):
    from kvaddr.outputs import AttentionOutputs

    out = AttentionOutputs()
    for name, v in a.as_dict().items():
        setattr(out, name, tuple(t.get() for t in v) if name == "page_table" else v.get())
    return out


def test_normal_step_unchanged_beside_the_substeps():
    """compute() on the same planner is the core step's, before and after the MTP launch."""
    import cupy

    from kvaddr import StepPlanner

    dec, acc, tables, sizes, C = _case(8, 40, 3, (16,))
    p = StepPlanner(64, C, sizes, draft_steps=3)
    d = [cupy.asarray(x) for x in (dec, acc)]
    t = cupy.asarray(tables[0])
    q = np.maximum(acc, 0).astype(np.int32)
    want = step_addressing(dec, q, tables, sizes, C)
    assert_outputs_equal(_host(p.compute(d[0], cupy.asarray(q), t)), want.outputs, "before")
    p.compute_draft_steps(d[0], d[1], t)
    assert_outputs_equal(_host(p.compute(d[0], cupy.asarray(q), t)), want.outputs, "after")


def test_bound_launch_and_graph_replay_with_new_contents():
    import cupy

    from kvaddr import StepPlanner

    k, bsz = 3, 1100
    dec, acc, tables, sizes, C = _case(21, bsz, k, (16, 3), capacity=4 * bsz)
    N = 80000
    p = StepPlanner(bsz, C, sizes, draft_steps=k, attention=ALL, kv_indices_capacity=N)
    d_dec, d_acc = device_copy([dec, acc])
    dtabs = device_copy(list(tables))
    bound = p.bind_draft_steps(d_dec, d_acc, dtabs)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        bound.launch(stream)  # warm
        stream.begin_capture()
        out = bound.launch(stream)
        graph = stream.end_capture()
    stream.synchronize()
    for seed in range(3):
        dec2, acc2, tables2, _, _ = _case(100 + seed, bsz, k, sizes, capacity=C)
        d_dec.set(dec2)
        d_acc.set(acc2)
        for dt, t in zip(dtabs, tables2):
            dt.set(t)
        _poison(p)
        cupy.cuda.runtime.deviceSynchronize()
        graph.launch(stream)
        stream.synchronize()
        refs = _expected(dec2, acc2, tables2, sizes, C, k, ALL, N)
        for j, ref in enumerate(refs):
            assert_outputs_equal(out.substep(j), ref.outputs, f"replay {seed} substep {j}")
            assert_attention_equal(out.substep(j).attention, ref.outputs.attention, f"replay {seed} substep {j}")
        assert p.errors(stream) == (0, NO_ERROR_KEY)


def test_host_checks_name_the_argument():
    import cupy

    from kvaddr import StepPlanner

    p = StepPlanner(8, 16, [4], draft_steps=2)
    dec = cupy.zeros(4, np.int32)
    t = cupy.zeros((4, 4), np.int32)
    with pytest.raises(TypeError, match="accept_num"):
        p.compute_draft_steps(dec, cupy.zeros(4, np.int64), t)
    with pytest.raises(ValueError, match="accept_num"):
        p.compute_draft_steps(dec, cupy.zeros(3, np.int32), t)
    with pytest.raises(ValueError, match="draft_steps"):
        StepPlanner(8, 16, [4]).compute_draft_steps(dec, dec, t)


def test_torch_op_on_the_gpu_opcheck_compile_and_graph():
    """torch.ops.kvaddr.draft_steps: equal to the planner's launch, opcheck, torch.compile(fullgraph),
    a torch CUDA graph replayed after the inputs' contents change."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch op test needs it")
    from torch.library import opcheck

    import kvaddr.torch as kt

    k, bsz, sizes = 3, 1300, [16, 5]
    dec, acc, tables, _, C = _case(31, bsz, k, sizes)
    td, ta = torch.from_numpy(dec).cuda(), torch.from_numpy(acc).cuda()
    tt = [torch.from_numpy(t).cuda() for t in tables]
    buf = kt.DraftStepBuffers(bsz, C, sizes, k, device="cuda")

    def expect(d, a, t):
        for j, ref in enumerate(_expected(d, a, t, sizes, C, k, None, None)):
            got = out.substep(j)
            for f, want in ref.outputs.as_dict().items():
                np.testing.assert_array_equal(getattr(got, f).cpu().numpy(), want, err_msg=f"{j} {f}")

    out = kt.draft_steps(td, ta, tt, buf)
    expect(dec, acc, tables)
    assert kt.draft_errors(buf) == (0, NO_ERROR_KEY)
    result = opcheck(torch.ops.kvaddr.draft_steps.default, (td, ta, tt, sizes, *buf.outputs_args))
    assert all(v == "SUCCESS" for v in result.values()), result

    def model(d, a, t0, t1):
        o = kt.draft_steps(d, a, [t0, t1], buf)
        return o.slot_mapping.clone()

    got = torch.compile(model, fullgraph=True)(td, ta, *tt)
    assert torch.equal(got, buf.slot_mapping)

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kt.draft_steps(td, ta, tt, buf)
        with torch.cuda.graph(g, stream=s):
            out = kt.draft_steps(td, ta, tt, buf)
    torch.cuda.synchronize()
    dec2, acc2, tables2, _, _ = _case(32, bsz, k, sizes, capacity=C)
    td.copy_(torch.from_numpy(dec2))
    ta.copy_(torch.from_numpy(acc2))
    for x, t in zip(tt, tables2):
        x.copy_(torch.from_numpy(t))
    buf.slot_mapping.fill_(12345)
    g.replay()
    torch.cuda.synchronize()
    expect(dec2, acc2, tables2)


def test_docs_snippet_prints_what_it_says():
    from tests.unit.test_spec_doc_mtp import run_snippet

    got, want = run_snippet("mtp-cupy")
    assert got == want


def test_profile_rows_check_then_time_both_designs():
    """kvaddr.measure.mtp_profile (``kvaddr profile --spec-tokens k`` on a GPU): a row per batch,
    FastDeploy's design checked equal to the one launch and timed up to 512 requests."""
    from kvaddr.measure import mtp_profile
    from kvaddr.measure.workload import Workload

    w = Workload(model="deepseek-v3.2", num_layers=2, num_caches=2, block_sizes=(64, 64), spec_tokens=3)
    section = mtp_profile.measure(w, [8, 64, 600], budget_s=0.05)
    rows = {r["batch"]: r for r in section["rows"]}
    assert section["substeps"] == 3 and sorted(rows) == [8, 64, 600]
    for b in (8, 64):
        assert rows[b]["fastdeploy"]["us"] > 0 and rows[b]["kvaddr"]["us"] > 0
        assert rows[b]["fastdeploy"]["launches"] == 6 and rows[b]["fastdeploy"]["host_syncs"] == 3
    assert "not_run" in rows[600]["fastdeploy"] and rows[600]["kvaddr"]["us"] > 0
