"""The batches kvaddr profile replays: seeded, realistic, and error free."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr.measure.workload import DEFAULT_CONTEXT, PRESETS, Workload, make_batch, make_input_sets
from kvaddr.reference import step_addressing


def _workload(**kw):
    base = dict(model="deepseek-v3.2", num_layers=61, num_caches=2, block_sizes=(64, 64))
    base.update(kw)
    return Workload(**base)


def test_presets():
    ds = PRESETS["deepseek-v3.2"]
    assert (ds.num_layers, ds.num_caches, ds.block_size) == (61, 2, 64)
    glm = PRESETS["glm-5"]
    assert (glm.num_layers, glm.num_caches, glm.block_size) == (78, 2, 64)
    assert "assumption" in glm.source


def test_batch_arrays_are_int32_and_consistent():
    w = _workload()
    b = make_batch(w, 64, 0)
    for arr in (b.seq_lens_decoder, b.seq_lens_this_time, b.seq_lens_encoder):
        assert arr.dtype == np.int32 and arr.shape == (64,)
    assert len(b.block_tables) == 2 and b.block_tables[0] is b.block_tables[1]
    assert isinstance(b.tables_arg, np.ndarray)
    table = b.tables_arg
    assert table.dtype == np.int32 and table.shape == (64, w.max_blocks(64))
    assert b.capacity == int(b.seq_lens_this_time.sum()) == 64
    assert (b.seq_lens_this_time == 1).all() and (b.seq_lens_encoder == 0).all()
    lo, hi = DEFAULT_CONTEXT
    assert b.seq_lens_decoder.min() >= lo and b.seq_lens_decoder.max() <= hi


def test_block_tables_are_fragmented_and_padded():
    w = _workload()
    b = make_batch(w, 64, 0)
    t = b.tables_arg
    need = -(-(b.seq_lens_decoder.astype(np.int64) + b.seq_lens_this_time) // 64)
    for row, n in zip(t, need):
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
    ids = t[t >= 0]
    assert len(np.unique(ids)) == ids.size  # a block belongs to one request
    runs = np.diff(t[0, : need[0]])
    assert not (runs == 1).all()  # not 0, 1, 2, ...: drawn from a shuffled pool


def test_seeded_and_input_sets_differ():
    w = _workload(seed=7)
    a, b = make_batch(w, 16, 0), make_batch(w, 16, 0)
    assert np.array_equal(a.seq_lens_decoder, b.seq_lens_decoder)
    assert np.array_equal(a.tables_arg, b.tables_arg)
    sets = make_input_sets(w, 16)
    assert len(sets) == w.input_sets == 4
    assert len({s.seq_lens_decoder.tobytes() for s in sets}) == 4
    assert len({s.capacity for s in sets}) == 1
    assert len({s.tables_arg.shape for s in sets}) == 1
    other = make_batch(_workload(seed=8), 16, 0)
    assert not np.array_equal(a.seq_lens_decoder, other.seq_lens_decoder)


def test_context_is_log_uniform():
    w = _workload()
    dec = np.concatenate([make_batch(w, 256, i).seq_lens_decoder for i in range(4)]).astype(np.float64)
    lo, hi = DEFAULT_CONTEXT
    # Log-uniform: the median sits near the geometric mean, well below the arithmetic one.
    assert np.median(dec) < (lo + hi) / 2 * 0.6
    assert abs(np.log(np.median(dec)) - (np.log(lo) + np.log(hi)) / 2) < 0.4


def test_fixed_context_and_spec_tokens():
    w = _workload(context=(500, 500), spec_tokens=2)
    b = make_batch(w, 8, 0)
    assert (b.seq_lens_decoder == 500).all() and (b.seq_lens_this_time == 3).all()
    assert b.capacity == 24


def test_prefill_requests_and_continuations():
    w = _workload(prefill=(3, 256))
    sets = make_input_sets(w, 16)
    continuations = 0
    for b in sets:
        pre = b.seq_lens_encoder > 0
        assert pre.sum() == 3
        assert (b.seq_lens_encoder[pre] == 256).all() and (b.seq_lens_this_time[pre] == 256).all()
        assert (b.seq_lens_decoder[pre] % 256 == 0).all()
        continuations += int((b.seq_lens_decoder[pre] > 0).sum())
        assert b.capacity == 13 + 3 * 256 == int(b.seq_lens_this_time.sum())
    assert 0 < continuations < 12


def test_single_prefill_request_alternates_first_and_continuation_chunks():
    w = _workload(prefill=(1, 128))
    decs = [int(b.seq_lens_decoder[b.seq_lens_encoder > 0][0]) for b in make_input_sets(w, 4)]
    assert decs[0] == 0 and decs[1] > 0 and decs[2] == 0 and decs[3] > 0


def test_distinct_block_sizes_get_their_own_tables():
    w = _workload(num_caches=3, block_sizes=(16, 32, 16))
    b = make_batch(w, 8, 0)
    assert b.block_tables[0] is b.block_tables[2]
    assert b.block_tables[0] is not b.block_tables[1]
    assert isinstance(b.tables_arg, list) and len(b.tables_arg) == 3
    assert len(b.distinct_tables()) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 40),
    lo=st.integers(0, 3000),
    span=st.integers(0, 5000),
    spec=st.integers(0, 4),
    prefill_n=st.integers(0, 3),
    prefill_len=st.integers(1, 700),
    sizes=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
    index=st.integers(0, 5),
)
def test_reference_finds_no_bad_address(batch, lo, span, spec, prefill_n, prefill_len, sizes, seed, index):
    w = Workload(
        model="x",
        num_layers=1,
        num_caches=len(sizes),
        block_sizes=tuple(sizes),
        context=(lo, lo + span),
        spec_tokens=spec,
        prefill=(min(prefill_n, batch), prefill_len) if prefill_n else None,
        seed=seed,
    )
    b = make_batch(w, batch, index)
    r = step_addressing(
        b.seq_lens_decoder,
        b.seq_lens_this_time,
        b.tables_arg,
        list(b.block_sizes),
        b.capacity,
        seq_lens_encoder=b.seq_lens_encoder,
    )
    assert r.error_mask == 0
    assert int(r.outputs.num_tokens) == b.capacity == w.capacity(batch)
    assert (r.outputs.slot_mapping >= 0).all()


def test_describe_is_json_ready():
    import json

    w = _workload(prefill=(2, 64), spec_tokens=1)
    d = w.describe()
    json.dumps(d)
    assert d["prefill"] == {"requests": 2, "tokens": 64}
    assert d["context"]["distribution"] == "log-uniform"
    stats = make_batch(w, 8, 0).stats()
    json.dumps(stats)
    assert stats["prefill_requests"] == 2 and stats["decode_requests"] == 6


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_every_preset_makes_a_valid_batch(model):
    p = PRESETS[model]
    w = Workload(
        model=model, num_layers=p.num_layers, num_caches=p.num_caches, block_sizes=(p.block_size,) * p.num_caches
    )
    b = make_batch(w, 64, 0)
    r = step_addressing(b.seq_lens_decoder, b.seq_lens_this_time, b.tables_arg, list(b.block_sizes), b.capacity)
    assert r.error_mask == 0
