"""VllmDraftPlanner's host side behind a fake CuPy (launches run the CPU emulation of the kernel,
tests/support/vllm_draft_emulator.py): every argument check names
its argument, the constructor refuses bad settings, ``bind()`` checks the persistent arrays once
and ``launch`` the batch (a bad batch launches nothing), and the launch geometry."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import vllm_draft_emulator
from tests.support.vllm_fake_cupy import FakeArray

pytestmark = pytest.mark.skipif(vllm_draft_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")


@pytest.fixture
def fake(monkeypatch):
    return vllm_draft_emulator.install(monkeypatch)


def _planner(**kw):
    from kvaddr.engines.vllm_draft import VllmDraftPlanner

    args = dict(
        max_num_reqs=4,
        max_num_batched_tokens=16,
        num_speculative_steps=3,
        block_sizes=[4],
        widths=[5],
        max_model_len=20,
        mask_rejected=True,
    )
    args.update(kw)
    return VllmDraftPlanner(**args)


def _inputs(n=2):
    return dict(
        idx_mapping=FakeArray(np.arange(n, dtype=np.int32)),
        query_start_loc=FakeArray(np.arange(0, 4 * n + 1, 4, dtype=np.int32)),
        seq_lens=FakeArray(np.full(n, 9, dtype=np.int32)),
        num_rejected=FakeArray(np.zeros(n, dtype=np.int32)),
        num_sampled=FakeArray(np.full(n, 4, dtype=np.int32)),
        block_tables=[FakeArray(np.zeros((4, 5), dtype=np.int32))],
        num_blocks=[FakeArray(np.full(4, 5, dtype=np.int32))],
        verify_slot_mappings=FakeArray(np.zeros((1, 8), dtype=np.int64)),
    )


def test_one_launch_with_the_planned_grid(fake):
    p = _planner(attention="flashinfer,varlen", kv_indices_capacity=32)
    p.compute(**_inputs())
    (launch,) = fake.launches
    assert launch["name"] == "vllm_draft_step<true>"
    # request blocks (k - 1) * G * ceil(5 / 256) + attention blocks (k - 1) * G + token blocks ceil(16 / 256)
    assert launch["grid"] == (2 + 2 + 1, 1, 1) and launch["block"] == 256


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(idx_mapping=FakeArray(np.zeros(2, dtype=np.float32))), TypeError, "idx_mapping"),
        (dict(idx_mapping=FakeArray(np.zeros(5, dtype=np.int32))), ValueError, "max_num_reqs"),
        (dict(query_start_loc=FakeArray(np.zeros(2, dtype=np.int32))), ValueError, "query_start_loc"),
        (dict(seq_lens=FakeArray(np.zeros(1, dtype=np.int32))), ValueError, "seq_lens"),
        (dict(num_rejected=FakeArray(np.zeros(2, dtype=np.int64))), TypeError, "num_rejected"),
        (dict(num_sampled=FakeArray(np.zeros((2, 1), dtype=np.int32))), ValueError, "num_sampled"),
        (dict(block_tables=[FakeArray(np.zeros((4, 6), dtype=np.int32))]), ValueError, "block_tables"),
        (dict(block_tables=[]), ValueError, "block_tables"),
        (dict(num_blocks=[FakeArray(np.zeros(4, dtype=np.int64))]), TypeError, "num_blocks"),
        (dict(verify_slot_mappings=FakeArray(np.zeros((1, 17), dtype=np.int64))), ValueError, "verify_slot_mappings"),
        (dict(verify_slot_mappings=FakeArray(np.zeros((2, 8), dtype=np.int64))), ValueError, "verify_slot_mappings"),
        (dict(verify_slot_mappings=None), ValueError, "verify_slot_mappings"),
    ],
)
def test_bad_arguments_name_themselves_and_launch_nothing(fake, change, error, match):
    p = _planner()
    x = _inputs()
    x.update(change)
    with pytest.raises(error, match=match):
        p.compute(**x)
    assert fake.launches == []


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(num_speculative_steps=0), "num_speculative_steps"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(attention="page_table"), "page table"),
        (dict(attention="flashinfer"), "kv_indices_capacity"),
        (dict(mask_rejected=1), "mask_rejected"),
        (dict(out={"positions": FakeArray(np.zeros((2, 5), dtype=np.int64))}), "positions"),
        (dict(out={"kv_indptr": FakeArray(np.zeros((2, 1, 5), dtype=np.int32))}), "kv_indptr"),
        (dict(out={"nothing": FakeArray(np.zeros(1, dtype=np.int32))}), "nothing"),
        (dict(block_sizes=[4, 4], widths=[5]), "widths"),
    ],
)
def test_bad_settings(fake, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _planner(**kw)


def test_out_arrays_are_used_as_given(fake):
    pos = FakeArray(np.zeros((2, 4), dtype=np.int64))
    p = _planner(out={"positions": pos})
    assert p.outputs.positions is pos
    assert p._params.positions == pos.a.ctypes.data


def test_bind_checks_once_and_launch_checks_the_batch(fake):
    p = _planner()
    x = _inputs()
    state = dict(
        seq_lens=FakeArray(np.full(4, 9, dtype=np.int32)),
        num_rejected=FakeArray(np.zeros(4, dtype=np.int32)),
        num_sampled=FakeArray(np.full(4, 4, dtype=np.int32)),
    )
    bound = p.bind(
        **state,
        block_tables=x["block_tables"],
        num_blocks=x["num_blocks"],
        verify_slot_mappings=x["verify_slot_mappings"],
    )
    bound.launch(x["idx_mapping"], x["query_start_loc"])
    bound.launch(x["idx_mapping"], x["query_start_loc"], stream=99)
    assert [L["stream"] for L in fake.launches][1] == 99
    with pytest.raises(TypeError, match="idx_mapping"):
        bound.launch(FakeArray(np.zeros(2, dtype=np.float64)), x["query_start_loc"])
    assert len(fake.launches) == 2
    with pytest.raises(ValueError, match="seq_lens"):  # bound arrays shorter than max_num_reqs
        p.bind(FakeArray(np.zeros(3, dtype=np.int32)), state["num_rejected"], state["num_sampled"], x["block_tables"])
    # a bound array changed in place is checked again at the next launch
    state["seq_lens"].a = np.zeros(2, dtype=np.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        bound.launch(x["idx_mapping"], x["query_start_loc"])
    assert len(fake.launches) == 2


def test_meta_rows_spread_the_attention_blocks():
    from kvaddr.engines.vllm_draft import META_BLOCKS, VllmDraftPlanner, meta_rows

    assert meta_rows(64, 2, 1) == 8  # 9 chunks per (step, group)
    assert meta_rows(4096, 2, 1) == 32  # 129 chunks * 2 <= 512
    assert meta_rows(100000, 7, 4) == 256  # capped at one row per thread
    for M, S, G in ((1, 1, 1), (300, 3, 2), (1025, 2, 1), (5000, 1, 3)):
        rows = meta_rows(M, S, G)
        assert 8 <= rows <= 256 and rows & (rows - 1) == 0
        assert rows == 256 or S * G * -(-(M + 1) // rows) <= META_BLOCKS
        assert rows == 8 or S * G * -(-(M + 1) // (rows // 2)) > META_BLOCKS
    shape = VllmDraftPlanner.error_records_shape(64, 3, 1, True)
    assert shape == ((2 * 1 + 2 * 9) * 8, 2)  # request blocks per (step, group), attention blocks


def test_request_blocks_per_draft_step_and_group():
    from kvaddr.engines.vllm_draft import VllmDraftPlanner, request_blocks

    assert request_blocks(64, 2, 1) == 2  # 65 rows: one block per (step, group)
    assert request_blocks(1024, 2, 2) == 4 * 5  # 1025 rows: five blocks per (step, group)
    assert request_blocks(255, 3, 4) == 12 and request_blocks(256, 3, 4) == 24
    assert request_blocks(100, 0, 3) == 1  # no draft step: one slice (last_token_indices, errors)
    assert VllmDraftPlanner.error_records_shape(1024, 3, 2, False) == (20 * 8, 2)


def _snapshot(out):
    return {k: np.array(v.a) for k, v in out.as_dict().items() if v is not None}


def test_batch_binding_launches_with_one_int(fake):
    from kvaddr.engines.vllm_draft import BoundVllmDraftBatch

    p = _planner(attention="flashinfer,varlen", kv_indices_capacity=32)
    rng = np.random.default_rng(3)
    rows = 4
    idx_buf = FakeArray(np.array([2, 0, 3, 1], dtype=np.int32))
    qsl_buf = FakeArray(np.array([0, 4, 8, 12, 16], dtype=np.int32))
    acc = rng.integers(0, 4, size=rows)
    state = dict(
        seq_lens=FakeArray(rng.integers(4, 16, size=rows).astype(np.int32)),
        num_rejected=FakeArray((3 - acc).astype(np.int32)),
        num_sampled=FakeArray((acc + 1).astype(np.int32)),
        block_tables=[FakeArray(rng.integers(0, 50, size=(4, 5)).astype(np.int32))],
        num_blocks=[FakeArray(np.full(4, 5, dtype=np.int32))],
        verify_slot_mappings=FakeArray(rng.integers(0, 200, size=(1, 16)).astype(np.int64)),
    )
    bound = p.bind(**state, idx_mapping=idx_buf, query_start_loc=qsl_buf)
    assert isinstance(bound, BoundVllmDraftBatch) and bound.max_num_reqs == 4
    for n in (3, 0, 4, 3):
        got = _snapshot(bound.launch(n, stream=7))
        p.compute(
            FakeArray(idx_buf.a[:n].copy()),
            FakeArray(qsl_buf.a[: n + 1].copy()),
            **state,
        )
        want = _snapshot(p.outputs)
        assert got.keys() == want.keys()
        for k in got:
            assert np.array_equal(got[k], want[k]), (n, k)
    assert fake.launches[0]["stream"] == 7 and fake.launches[0]["name"] == "vllm_draft_step<true>"
    assert p.errors()[0] == 0
    before = len(fake.launches)
    for bad, err in ((5, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="num_reqs"):
            bound.launch(bad)
    assert len(fake.launches) == before
    bound.check_bound()
    with pytest.raises(ValueError, match="together"):
        p.bind(**state, idx_mapping=idx_buf)
    with pytest.raises(TypeError, match="idx_mapping"):
        p.bind(**state, idx_mapping=FakeArray(np.zeros(4, np.float32)), query_start_loc=qsl_buf)
    short = p.bind(**state, idx_mapping=idx_buf, query_start_loc=FakeArray(np.zeros(3, np.int32)))
    assert short.max_num_reqs == 2
    with pytest.raises(ValueError, match="num_reqs"):
        short.launch(3)
    state["seq_lens"].a = np.zeros(2, dtype=np.int32)  # changed in place: seen by check_bound only
    with pytest.raises(ValueError, match="bind again|seq_lens"):
        bound.check_bound()
