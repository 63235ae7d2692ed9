"""kvaddr.dsa.topk_to_slots (kernels/dsa.cuh) on the CPU: the kernel's device code run by the
emulator (tests/support/dsa_emulator.py) behind the real host wrapper, against the NumPy
reference (kvaddr.dsa_reference) on the worked example and random inputs (plain, compacting,
layers, DCP, vectorized and scalar rows, one and several rows per block), the device-only
cases (padding tokens, rows outside the table, slots past int32), sticky error records, the
wrapper's argument checks, and the engines' design (the baseline kernel) on valid input.
Skips without a C++ compiler."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.dsa import ERR_SLOT_RANGE, DsaTopkParams, topk_kernel, topk_slot_errors, topk_to_slots
from kvaddr.dsa_reference import (
    ERR_BLOCK_INDEX,
    ERR_NEGATIVE_BLOCK,
    ERR_PAST_CONTEXT,
    NO_ERROR_KEY,
    decode_topk_error_key,
    topk_error_key,
)
from kvaddr.dsa_reference import topk_to_slots as reference
from tests.support import dsa_emulator

pytestmark = pytest.mark.skipif(dsa_emulator.CXX is None, reason="no C++ compiler for the kernel emulator")

EX_TOPK = [[6, 1, 3, 5], [0, 1, 2, -1], [0, 1, 2, 3], [4, 0, 2, 3]]
EX_REQ = [0, 1, 1, 1]
EX_TABLE = [[5, 2], [9, 3]]
EX_CTX = [7, 3, 4, 5]


@pytest.fixture
def gpu(monkeypatch):
    from tests.support import dsa_fake_gpu

    return dsa_fake_gpu.install(monkeypatch)


def i32(x):
    return np.ascontiguousarray(np.asarray(x, dtype=np.int32))


def run(topk, req, table, b, ctx, **kw):
    """The wrapper on fake device arrays; (slots, counts, masks [L], keys [L]) as NumPy."""
    from tests.support.dsa_fake_gpu import on_fake

    topk = i32(topk)
    out = topk_to_slots(on_fake(topk), on_fake(i32(req)), on_fake(i32(table)), b, on_fake(i32(ctx)), **kw)
    masks, keys = topk_slot_errors(out.errors)
    return out.slots.a, out.valid_counts.a, masks, keys


def assert_matches(topk, req, table, b, ctx, **kw):
    got = run(topk, req, table, b, ctx, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("compact", "cp_size", "cp_rank", "cp_interleave")}
    want = reference(np.asarray(topk), req, np.asarray(table).reshape(len(table), -1), b, ctx, **ref_kw)
    slots, counts, masks, keys = got
    np.testing.assert_array_equal(slots, want.slots)
    np.testing.assert_array_equal(counts, want.valid_counts)
    np.testing.assert_array_equal(masks, np.atleast_1d(want.error_mask))
    np.testing.assert_array_equal(keys, np.atleast_1d(np.asarray(want.error_key, dtype=np.uint64)))
    return got


def test_params_mirror_the_c_struct():
    out = (ctypes.c_longlong * 32)()
    n = dsa_emulator.library().emu_dsa_layout(out)
    offsets = [getattr(DsaTopkParams, f).offset for f, _ in DsaTopkParams._fields_]
    assert list(out[:n]) == [ctypes.sizeof(DsaTopkParams), *offsets]


def test_geometry():
    assert topk_kernel(2048, 4) == (8, 1)
    assert topk_kernel(2048, 1) == (8, 1)
    assert topk_kernel(256, 4) == (5, 8)
    assert topk_kernel(257, 4) == (6, 4)
    assert topk_kernel(4, 1) == (5, 8)


@pytest.mark.parametrize("compact", [False, True])
def test_worked_example(gpu, compact):
    slots, counts, masks, _ = assert_matches(EX_TOPK, EX_REQ, EX_TABLE, 4, EX_CTX, compact=compact)
    assert slots.tolist() == [[10, 21, 23, 9], [36, 37, 38, -1], [36, 37, 38, 39], [12, 36, 38, 39]]
    assert counts.tolist() == [4, 3, 4, 4] and masks.tolist() == [0]
    assert gpu[-1][0] == f"dsa_topk_slots_pow2<{'true' if compact else 'false'}>"


def test_worked_example_short_context_is_flagged(gpu):
    slots, counts, masks, keys = assert_matches(EX_TOPK, EX_REQ, EX_TABLE, 4, [7, 3, 4, 4])
    assert slots[3].tolist() == [-1, 36, 38, 39] and counts[3] == 3
    assert masks.tolist() == [ERR_PAST_CONTEXT]
    assert decode_topk_error_key(int(keys[0])) == (3, 0, ERR_PAST_CONTEXT)


@st.composite
def steps(draw, max_layers=1, max_k=64):
    b = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 16, 64]))
    rows = draw(st.integers(1, 8))
    width = draw(st.integers(0, 6))
    t = draw(st.integers(1, 40))
    k = draw(st.one_of(st.integers(1, max_k), st.sampled_from([4, 8, 128, 256, 260, 1024])))
    layers = draw(st.integers(1, max_layers))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = rng.integers(-3, 50, size=(rows, width))
    req = rng.integers(0, rows, size=t)
    ctx = rng.integers(0, b * (width + 1) + 2, size=t)
    topk = rng.integers(-1, b * (width + 2) + 3, size=(layers, t, k))
    cut = rng.integers(0, k + 1, size=(layers, t, 1))  # short rows: a tail of -1s
    topk = np.where(np.arange(k)[None, None, :] >= cut, -1, topk)
    return topk, req, table, b, ctx


@settings(max_examples=40, deadline=None)
@given(steps(), st.booleans())
def test_random_rows_match_the_reference(step, compact):
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        from tests.support import dsa_fake_gpu

        dsa_fake_gpu.install(mp)
        topk, req, table, b, ctx = step
        assert_matches(topk[0], req, table, b, ctx, compact=compact)


@settings(max_examples=25, deadline=None)
@given(steps(max_layers=4), st.booleans())
def test_layers_at_once_match_the_reference(step, compact):
    with pytest.MonkeyPatch.context() as mp:
        from tests.support import dsa_fake_gpu

        dsa_fake_gpu.install(mp)
        topk, req, table, b, ctx = step
        assert_matches(topk, req, table, b, ctx, compact=compact)


@st.composite
def pow2_steps(draw):
    """Steps the power-of-two forms take: B a power of two, K a multiple of 4 (rows of one chunk
    up to K = 2048), padding tokens (req_id < 0) and rows of width 0."""
    b = draw(st.sampled_from([1, 2, 4, 16, 64]))
    rows = draw(st.integers(1, 6))
    width = draw(st.integers(0, 6))
    t = draw(st.integers(1, 40))
    k = 4 * draw(st.one_of(st.integers(0, 20), st.sampled_from([32, 63, 64, 65, 128, 129, 256, 511, 512])))
    layers = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = rng.integers(-3, 50, size=(rows, width))
    table[rng.random((rows, width)) < 0.7] = rng.integers(0, 50, size=1)  # mostly valid ids
    req = rng.integers(-1, rows, size=t)
    ctx = rng.integers(0, b * (width + 1) + 2, size=t)
    topk = rng.integers(-1, b * (width + 2) + 3, size=(layers, t, k))
    cut = rng.integers(0, k + 1, size=(layers, t, 1))
    topk = np.where(np.arange(k)[None, None, :] >= cut, -1, topk)
    # rows of good entries only, then a tail of -1s (already compact: what the indexer writes),
    # beside rows with holes and bad entries in the same blocks
    clean = rng.random((layers, t)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    for layer, i in zip(*np.nonzero(clean)):
        good = [q for q in range(min(int(ctx[i]), width * b)) if req[i] >= 0 and table[req[i], q // b] >= 0]
        n = min(len(good), int(cut[layer, i, 0]))
        topk[layer, i] = -1
        topk[layer, i, :n] = rng.choice(good, size=n, replace=False) if n else []
    return topk, req, table, b, ctx


@settings(max_examples=40, deadline=None)
@given(pow2_steps(), st.booleans())
def test_power_of_two_forms_match_the_reference(step, compact):
    """Layers, padding tokens (req_id < 0), rows of width 0, past-context entries and negative ids
    through dsa_topk_slots_pow2 (compacting: every row of one chunk); a row past the table:
    test_row_outside_the_table_reads_nothing."""
    with pytest.MonkeyPatch.context() as mp:
        from tests.support import dsa_fake_gpu

        launched = dsa_fake_gpu.install(mp)
        topk, req, table, b, ctx = step
        # the reference knows no padding token: its rows are checked against an all -1 row
        pad = np.asarray(req) < 0
        slots, counts, masks, keys = run(topk, req, table, b, ctx, compact=compact)
        assert launched[-1][0] == f"dsa_topk_slots_pow2<{str(compact).lower()}>"
        want = reference(np.where(pad[None, :, None], -1, topk), np.where(pad, 0, req), table, b, ctx, compact=compact)
        np.testing.assert_array_equal(slots, want.slots)
        np.testing.assert_array_equal(counts, want.valid_counts)
        np.testing.assert_array_equal(masks, np.atleast_1d(want.error_mask))
        np.testing.assert_array_equal(keys, np.atleast_1d(np.asarray(want.error_key, dtype=np.uint64)))


@settings(max_examples=30, deadline=None)
@given(steps(max_layers=2), st.integers(1, 4), st.integers(1, 5), st.booleans(), st.data())
def test_dcp_matches_the_reference(step, cp, inter, compact, data):
    rank = data.draw(st.integers(0, cp - 1))
    with pytest.MonkeyPatch.context() as mp:
        from tests.support import dsa_fake_gpu

        dsa_fake_gpu.install(mp)
        topk, req, table, b, ctx = step
        assert_matches(topk, req, table, b, ctx, compact=compact, cp_size=cp, cp_rank=rank, cp_interleave=inter)


@pytest.mark.parametrize("k", [2048, 2047, 3000, 4100])
@pytest.mark.parametrize("compact", [False, True])
def test_long_rows_over_several_chunks(gpu, k, compact):
    rng = np.random.default_rng(k)
    t, b, width = 3, 64, 80
    table = rng.integers(0, 10_000, size=(2, width))
    req = np.array([0, 1, 1])
    ctx = np.array([5000, 3000, 100])
    topk = rng.integers(-1, 5200, size=(t, k))
    topk[0, k // 2 :] = -1  # a short request
    assert_matches(topk, req, table, b, ctx, compact=compact)


@pytest.mark.parametrize("k", [12, 256, 1000, 2048])
def test_compacting_rows_with_one_hole(gpu, k):
    """Rows of good entries but for one -1 (at each end of every int4 near the ends of both
    halves of the row's columns, at each end of a warp's columns), each in a block of rows that
    are already compact."""
    from kvaddr.dsa import topk_kernel

    shift, per_block = topk_kernel(k, 4)
    half = 4 << shift
    b, rng = 16, np.random.default_rng(k)
    width = k // b + 2
    ctx = width * b
    table = rng.permutation(10 * width)[: 2 * width].reshape(2, width)
    # rows of a half or all columns, a hole at either end of a warp's 128 columns of a half
    cases = [(k, None)] + [
        (n, h) for n in {min(half, k), k} for j in range(1, n // 128 + 1) for h in (128 * j - 1, 128 * j) if h < n
    ]
    for n in {1, 2, 4, 5, 8, half - 1, half, half + 1, half + 5, k - 1, k}:
        if 1 <= n <= k:
            cases += [
                (n, h) for h in {0, n - 1, n - 2, n - 3, 4 * ((n - 1) // 4), 4 * ((n - 1) // 4) + 1} if 0 <= h < n
            ]
    rows = []
    for n, h in cases:  # the row under test first in its block, then rows already compact
        for j in range(per_block):
            row = np.full(k, -1)
            m = n if j == 0 else rng.integers(0, k + 1)
            row[:m] = rng.permutation(ctx)[:m]
            if j == 0 and h is not None:
                row[h] = -1
            rows.append(row)
    topk = np.array(rows)
    req = rng.integers(0, 2, size=len(rows))
    assert_matches(topk, req, table, b, np.full(len(rows), ctx), compact=True)
    assert gpu[-1][0] == "dsa_topk_slots_pow2<true>"


def test_many_rows_per_block_and_a_partial_last_block(gpu):
    rng = np.random.default_rng(3)
    t, k, b = 1029, 12, 16  # 8 rows per block, 1029 rows: the last block holds 5
    table = rng.integers(0, 1000, size=(70, 8))
    req = rng.integers(0, 70, size=t)
    ctx = rng.integers(0, 140, size=t)
    topk = rng.integers(-1, 140, size=(t, k))
    for compact in (False, True):
        assert_matches(topk, req, table, b, ctx, compact=compact)
    assert gpu[-1][1] == (-(-t // 8), 1)


@pytest.mark.parametrize("b", [1, 3, 4])
def test_staged_and_unstaged_table_rows_in_one_block(gpu, b):
    # 8 rows per block share the staged table entries (256 a row): a row whose reachable table
    # prefix (min(ceil(ctx / B), W)) fits is looked up in shared memory, a longer one in global
    # memory; rows of both kinds, positions past the context and negative block ids, side by side.
    rng = np.random.default_rng(b)
    t, k, width = 37, 12, 600
    table = rng.integers(-2, 100_000, size=(5, width))
    req = rng.integers(0, 5, size=t)
    ctx = rng.choice([0, 1, 255 * b, 256 * b, 256 * b + 1, 600 * b, 10_000], size=t)
    topk = rng.integers(-1, 610 * b, size=(t, k))
    for compact in (False, True):
        slots, _, masks, _ = assert_matches(topk, req, table, b, ctx, compact=compact)
        assert masks[0] & ERR_PAST_CONTEXT and (slots >= 0).sum() > t


@pytest.mark.parametrize(
    "b, cp, k, compact, want",
    [
        (4, 1, 8, False, "dsa_topk_slots_pow2<false>"),
        (4, 1, 2048, False, "dsa_topk_slots_pow2<false>"),
        (4, 1, 2052, False, "dsa_topk_slots<false, 4>"),
        (6, 1, 8, False, "dsa_topk_slots<false, 4>"),
        (4, 2, 8, False, "dsa_topk_slots<false, 4>"),
        (4, 1, 8, True, "dsa_topk_slots_pow2<true>"),
        (4, 1, 2048, True, "dsa_topk_slots_pow2<true>"),
        (4, 1, 2052, True, "dsa_topk_slots<true, 4>"),
        (6, 1, 8, True, "dsa_topk_slots<true, 4>"),
        (4, 2, 8, True, "dsa_topk_slots<true, 4>"),
        (4, 1, 9, True, "dsa_topk_slots<true, 1>"),
    ],
)
def test_kernel_choice(gpu, b, cp, k, compact, want):
    """The power-of-two forms without DCP (compacting: rows of one chunk, read as int4), else the
    general one; each as the reference."""
    rng = np.random.default_rng(b + cp + k)
    topk = rng.integers(-1, 40, size=(5, k)).astype(np.int32)
    table = rng.integers(0, 100, size=(3, 10)).astype(np.int32)
    kw = {"cp_size": cp, "cp_rank": cp - 1, "cp_interleave": 1} if cp > 1 else {}
    slots, _, _, _ = assert_matches(topk, [0, 1, 2, 0, 1], table, b, [40, 9, 40, 40, 3], compact=compact, **kw)
    assert gpu[-1][0] == want
    assert (slots >= 0).any() and (slots < 0).any()


def test_unaligned_rows_take_the_scalar_path(gpu):
    topk = i32(np.arange(4 * 9).reshape(4, 9) % 7)
    from tests.support.dsa_fake_gpu import on_fake

    out = topk_to_slots(
        on_fake(topk), on_fake(i32([0, 0, 0, 0])), on_fake(i32([[3, 4]])), 4, on_fake(i32([8, 8, 8, 8]))
    )
    assert gpu[-1][0] == "dsa_topk_slots<false, 1>"
    want = reference(topk, [0] * 4, [[3, 4]], 4, [8] * 4)
    np.testing.assert_array_equal(out.slots.a, want.slots)


def test_padding_tokens_give_empty_rows_without_errors(gpu):
    topk = [[0, 1, 2, 3], [5, -1, 9, 1], [0, 1, 2, 3]]
    for compact in (False, True):
        slots, counts, masks, _ = run(topk, [0, -1, 0], [[5, 2]], 4, [4, 0, 4], compact=compact)
        assert slots[1].tolist() == [-1] * 4 and counts.tolist() == [4, 0, 4] and masks.tolist() == [0]
        assert slots[0].tolist() == [20, 21, 22, 23]
        assert gpu[-1][0] == f"dsa_topk_slots_pow2<{str(compact).lower()}>"


@pytest.mark.parametrize("compact", [False, True])
def test_row_outside_the_table_reads_nothing(gpu, compact):
    slots, counts, masks, keys = run([[0, 9, -1, 1]], [5], [[5, 2]], 4, [5], compact=compact)
    assert gpu[-1][0] == f"dsa_topk_slots_pow2<{str(compact).lower()}>"
    assert slots.tolist() == [[-1, -1, -1, -1]] and counts.tolist() == [0]
    assert masks.tolist() == [ERR_BLOCK_INDEX | ERR_PAST_CONTEXT]
    assert int(keys[0]) == topk_error_key(0, 0, ERR_BLOCK_INDEX)


def test_slot_past_int32_is_refused(gpu):
    big = (1 << 31) // 64  # block id whose slots pass int32 with B = 64
    slots, counts, masks, keys = run([[0, 64, 65]], [0], [[1, big]], 64, [100])
    assert slots.tolist() == [[64, -1, -1]] and counts.tolist() == [1]
    assert masks.tolist() == [ERR_SLOT_RANGE]
    assert decode_topk_error_key(int(keys[0]))[:2] == (0, 1)
    assert int(keys[0]) & 7 == 3


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("b", [64, 48])
def test_block_ids_at_the_int32_limit(gpu, b, compact):
    """Ids at and just past the largest one all of whose slots fit int32 (with B = 48 the first id
    past it still has slots that fit: offsets up to 31); the reference refuses such tables, so the
    slots are spelled out here."""
    top = ((1 << 31) - b) // b
    table = [top, top + 1, -3]
    topk = [[0, b - 1, b, b + 31, b + 32, 2 * b - 1, 2 * b, 1], [b + 31, 3, b, 2 * b + 1, b - 1, -1, b + 1, 0]]

    def slot(v):
        s = table[v // b] * b + v % b if v >= 0 and table[v // b] >= 0 else -1
        return s if s < 1 << 31 else -1

    want = [[slot(v) for v in row] for row in topk]
    if compact:
        want = [[s for s in row if s >= 0] + [-1] * sum(s < 0 for s in row) for row in want]
    slots, counts, masks, keys = run(topk, [0, 0], [table], b, [3 * b, 3 * b], compact=compact)
    assert slots.tolist() == want
    assert counts.tolist() == [sum(s >= 0 for s in row) for row in want]
    assert masks.tolist() == [ERR_SLOT_RANGE | ERR_NEGATIVE_BLOCK]
    first = next(c for c, v in enumerate(topk[0]) if slot(v) < 0)
    assert decode_topk_error_key(int(keys[0]))[:2] == (0, first)
    assert gpu[-1][0] == (
        f"dsa_topk_slots_pow2<{str(compact).lower()}>" if b == 64 else f"dsa_topk_slots<{str(compact).lower()}, 4>"
    )


def test_records_are_sticky_until_read(gpu):
    from tests.support.dsa_fake_gpu import on_fake

    errors = on_fake(np.array([[0, NO_ERROR_KEY]], dtype=np.uint64))
    args = (on_fake(i32([[9]])), on_fake(i32([0])), on_fake(i32([[1, 2, 3]])), 4)
    topk_to_slots(*args, on_fake(i32([3])), errors=errors)  # 9 >= 3: past the context
    topk_to_slots(*args, on_fake(i32([10])), errors=errors)  # clean: the record stays
    masks, keys = topk_slot_errors(errors)
    assert masks.tolist() == [ERR_PAST_CONTEXT] and int(keys[0]) == topk_error_key(0, 0, ERR_PAST_CONTEXT)
    masks, keys = topk_slot_errors(errors)
    assert masks.tolist() == [0] and int(keys[0]) == NO_ERROR_KEY


def test_every_output_element_is_written(gpu):
    from tests.support.dsa_fake_gpu import on_fake

    rng = np.random.default_rng(5)
    topk = i32(rng.integers(-1, 40, size=(2, 37, 16)))
    out = on_fake(np.full(topk.shape, 0x7EADBEEF, np.int32))
    counts = on_fake(np.full(topk.shape[:2], 0x7EADBEEF, np.int32))
    req = i32(rng.integers(-1, 3, size=37))
    for compact in (False, True):
        topk_to_slots(
            on_fake(topk),
            on_fake(req),
            on_fake(i32(rng.integers(0, 9, size=(3, 10)))),
            4,
            on_fake(i32(np.full(37, 40))),
            out=out,
            counts=counts,
            compact=compact,
        )
        assert (out.a != 0x7EADBEEF).all() and (counts.a != 0x7EADBEEF).all()
        assert (out.a >= -1).all() and (counts.a == (out.a >= 0).sum(axis=2)).all()


def test_empty_inputs(gpu):
    from tests.support.dsa_fake_gpu import on_fake

    out = topk_to_slots(
        on_fake(np.zeros((0, 8), np.int32)),
        on_fake(np.zeros(0, np.int32)),
        on_fake(i32([[1]])),
        64,
        on_fake(np.zeros(0, np.int32)),
    )
    assert out.slots.shape == (0, 8) and gpu == []
    _slots, counts, masks, _ = run(np.zeros((3, 0), np.int32), [0, 0, 0], [[1]], 4, [1, 1, 1])
    assert counts.tolist() == [0, 0, 0] and masks.tolist() == [0]


def test_baseline_equals_kvaddr_on_valid_input(gpu):
    from kvaddr.strategies.dsa_topk import BaselineTopkSlots
    from tests.support.dsa_fake_gpu import on_fake

    rng = np.random.default_rng(11)
    t, k, b = 9, 300, 64
    ctx = rng.integers(1, 2000, size=t)
    table = rng.integers(0, 5000, size=(4, 32))
    req = rng.integers(0, 4, size=t)
    topk = np.where(rng.random((t, k)) < 0.2, -1, (rng.random((t, k)) * ctx[:, None]).astype(np.int64))
    base = BaselineTopkSlots(t, k, b, device=0)
    got = base.compute(on_fake(i32(topk)), on_fake(i32(req)), on_fake(i32(table)), on_fake(i32(ctx)))
    want = reference(topk, req, table, b, ctx)
    assert want.error_mask == 0
    np.testing.assert_array_equal(got.slots.a, want.slots)
    assert gpu[-1] == ("kvaddr_dsa_topk_baseline", (t, 3), 128)


def _fake_args():
    from tests.support.dsa_fake_gpu import on_fake

    return {
        "topk": on_fake(i32([[0, 1, 2, 3]])),
        "req_id": on_fake(i32([0])),
        "block_table": on_fake(i32([[1]])),
        "block_size": 4,
        "ctx": on_fake(i32([4])),
    }


@pytest.mark.parametrize(
    "change, exc, name",
    [
        ({"topk": np.zeros((1, 4), np.int32)}, TypeError, "topk"),
        ({"topk": "int64"}, TypeError, "topk"),
        ({"topk": "1d"}, ValueError, "topk"),
        ({"topk": "strided"}, ValueError, "topk"),
        ({"req_id": "int64"}, TypeError, "req_id"),
        ({"req_id": "long"}, ValueError, "req_id"),
        ({"ctx": "long"}, ValueError, "ctx"),
        ({"block_table": "1d"}, ValueError, "block_table"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": True}, TypeError, "block_size"),
        ({"compact": 1}, TypeError, "compact"),
        ({"cp_size": 2, "cp_rank": 2}, ValueError, "cp_rank"),
        ({"cp_interleave": 0}, ValueError, "cp_interleave"),
        ({"out": "long"}, ValueError, "out"),
        ({"counts": "int64"}, TypeError, "counts"),
        ({"errors": "short"}, ValueError, "errors"),
        ({"errors": "int32"}, TypeError, "errors"),
        ({"out": "device1"}, ValueError, "out"),
    ],
)
def test_bad_arguments_name_the_argument(gpu, change, exc, name):
    from tests.support.dsa_fake_gpu import DsaFakeArray, on_fake

    args = _fake_args()
    change = dict(change)
    if "cp_rank" in change:
        args["cp_size"] = change.pop("cp_size")
    ((key, what),) = change.items()
    shapes = {"topk": (1, 4), "req_id": (1,), "ctx": (1,), "out": (1, 4), "counts": (1,), "errors": (1, 2)}
    if isinstance(what, np.ndarray) or not isinstance(what, str):
        pass
    elif what == "int64":
        what = on_fake(np.zeros(shapes[key], np.int64))
    elif what == "int32":
        what = on_fake(np.zeros(shapes[key], np.int32))
    elif what == "1d":
        what = on_fake(np.zeros(4, np.int32))
    elif what == "strided":
        what = on_fake(np.zeros((1, 8), np.int32)[:, ::2])
    elif what == "long":
        what = on_fake(np.zeros((2, 4) if key == "out" else (2,), np.int32))
    elif what == "short":
        what = on_fake(np.zeros((1, 1), np.uint64))
    elif what == "device1":
        what = DsaFakeArray(np.zeros(shapes[key], np.int32), dev=1)
    args[key] = what
    with pytest.raises(exc, match=name):
        topk_to_slots(**args)


def test_the_strategy_relaunches_the_same_arrays_unchecked(gpu, monkeypatch):
    from kvaddr.strategies.dsa_topk import KvaddrTopkSlots
    from tests.support.dsa_fake_gpu import on_fake

    rng = np.random.default_rng(2)
    host = [i32(rng.integers(-1, 60, size=(7, 12))), i32(rng.integers(0, 3, size=7)), i32(rng.integers(0, 50, (3, 9)))]
    host.append(i32(rng.integers(0, 60, size=7)))
    args = [on_fake(x) for x in host]
    conv = KvaddrTopkSlots(10, 12, 7, compact=True, device=0)
    conv.compute(*args)
    prepared = []
    monkeypatch.setattr(conv, "_shape", lambda topk: prepared.append(topk) or KvaddrTopkSlots._shape(conv, topk))
    host[0][...] = rng.integers(-1, 60, size=(7, 12))  # new values in the same memory
    out = conv.compute(*args)
    want = reference(host[0], host[1], host[2], 7, host[3], compact=True)
    np.testing.assert_array_equal(out.slots.a, want.slots)
    np.testing.assert_array_equal(out.valid_counts.a, want.valid_counts)
    assert prepared == [] and len(gpu) == 2  # no second check, two launches
