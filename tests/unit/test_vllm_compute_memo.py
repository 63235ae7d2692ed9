"""VllmStepPlanner.compute()'s memo of checked inputs, on the CPU (fake CuPy, launches recorded).

compute() skips its checks when it gets the same argument objects as the last checked call
and each array's signature (pointer, device, shape, strides, dtype) is unchanged; only
num_reqs_padded and the stream are taken per call. These tests change each remembered value
after a memoised call (each array's pointer, dtype, shape, strides and device, the items of
the table and num_blocks lists, num_reqs_padded, the stream, the gather lanes) and prove that
the full checks run again: a bad change raises the error a first call raises, without a
launch; a good one is launched with the new pointer, stride, length or grid.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.engines import vllm as vllm_module
from kvaddr.engines.vllm_reference import vllm_step_reference
from tests.support import vllm_emulator
from tests.support.vllm_cases import assert_same, new_batch, planner_kwargs, random_case, worked_example
from tests.support.vllm_fake_cupy import FakeArray, install

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")
M = 4  # the worked example's max_num_reqs


def _counting(described: list, real):
    """describe() recording the names of the inputs it describes (not the outputs')."""

    def describe(name, x):
        if not name.startswith("out."):
            described.append(name)
        return real(name, x)

    return describe


@pytest.fixture
def fake(monkeypatch):
    ns = install(monkeypatch)
    described = []
    real = vllm_module.describe
    monkeypatch.setattr(vllm_module, "describe", _counting(described, real))
    ns.described = described
    return ns


def _planner(G=1, **kw):
    return vllm_module.VllmStepPlanner(M, 600, [4] * G, [4] * G, **kw)


def _inputs(G=1, stacked=False):
    """The worked example on fake device arrays: a dict of the five arguments (lists per group)."""
    _, x = worked_example()
    d = {k: FakeArray(x[k]) for k in NAMES[:3]}
    d["block_tables"] = [FakeArray(x["block_tables"][0].copy()) for _ in range(G)]
    if stacked:
        d["num_blocks"] = FakeArray(np.stack([x["num_blocks"][0]] * G))
    else:
        d["num_blocks"] = [FakeArray(x["num_blocks"][0].copy()) for _ in range(G)]
    return d


def _call(pl, d, padded=3, stream=9):
    return pl.compute(*(d[k] for k in NAMES), padded, stream=stream)


def _last(fake):
    return fake.launches[-1]


def test_the_same_inputs_are_checked_once_and_launched_every_time(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    out = _call(pl, d)
    assert len(fake.described) == 7 and pl._memo is None  # idx, qsl, nct, 2 tables, 2 num_blocks
    _call(pl, d)  # the same objects again: checked (idx, qsl: the state is remembered), memoised
    checked = len(fake.described)
    assert checked == 7 + 2 and pl._memo is not None
    outs = [_call(pl, d) for _ in range(3)]
    assert len(fake.described) == checked, "a memoised call described an input again"
    assert len(fake.launches) == 5 and all(o is out for o in outs)
    first, last = fake.launches[0], _last(fake)
    assert (first["fn"], first["grid"], first["block"], first["stream"]) == (
        last["fn"],
        last["grid"],
        last["block"],
        last["stream"],
    )
    assert first["params"] == last["params"]
    assert last["params"]["idx_mapping"] == d["idx_mapping"].data.ptr and last["params"]["num_reqs"] == 2


def test_memoize_checks_false_checks_every_call(fake):
    pl = _planner(G=2)
    pl.memoize_checks = False
    d = _inputs(G=2)
    for _ in range(3):
        _call(pl, d)
    # idx_mapping and query_start_loc every call; the request state once (remembered by identity
    # and signature, as before the memo)
    assert len(fake.described) == 7 + 2 + 2 and pl._memo is None
    assert len(fake.launches) == 3


def test_memoize_checks_off_after_a_memoised_call(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)
    assert pl._memo is not None
    pl.memoize_checks = False  # forgets the memo (and the last call's objects)
    assert pl._memo is None and pl.memoize_checks is False
    _call(pl, d)
    assert len(fake.described) == 7 + 2 + 2
    pl.memoize_checks = True
    _call(pl, d)  # checked: the first call since the memo was turned on
    _call(pl, d)  # checked again, memoised
    _call(pl, d)
    assert len(fake.described) == 7 + 2 + 2 + 2 + 2 and pl._memo is not None


def _field(params, which, g=0):
    return {
        "idx_mapping": params["idx_mapping"],
        "query_start_loc": params["query_start_loc"],
        "num_computed_tokens": params["num_computed_tokens"],
        "block_tables": params["block_table"][g],
        "num_blocks": params["num_blocks"][g],
    }[which]


def _get(d, which, g=0):
    x = d[which]
    return x[g] if isinstance(x, list) else x


@pytest.mark.parametrize("which", NAMES)
@pytest.mark.parametrize("g", [0, 1])
def test_a_new_pointer_is_seen(fake, which, g):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)
    x = _get(d, which, g)
    x.a = x.a.copy()  # same object, same metadata, new memory
    _call(pl, d)
    assert _field(_last(fake)["params"], which, g) == x.data.ptr
    _call(pl, d)  # and memoised again with the new pointer
    assert _field(_last(fake)["params"], which, g) == x.data.ptr


def test_a_new_pointer_of_stacked_num_blocks_is_seen(fake):
    pl = _planner(G=2)
    d = _inputs(G=2, stacked=True)
    _call(pl, d)
    _call(pl, d)
    nb = d["num_blocks"]
    nb.a = nb.a.copy()
    _call(pl, d)
    assert _last(fake)["params"]["num_blocks"][:2] == [nb.data.ptr, nb.data.ptr + 4 * M]
    wide = np.zeros((2, 8), np.int32)
    nb.a = wide[:, :M]  # same shape, row stride 8
    _call(pl, d)
    assert _last(fake)["params"]["num_blocks"][:2] == [nb.data.ptr, nb.data.ptr + 4 * 8]


def test_a_new_num_reqs_is_seen_and_launched(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    grid2 = _last(fake)["grid"]
    d["idx_mapping"].a = np.array([2, 0, -1], np.int32)  # a shape change in place
    d["query_start_loc"].a = np.array([0, 1, 3, 3], np.int32)
    _call(pl, d)
    L = _last(fake)
    assert L["params"]["num_reqs"] == 3 and L["params"]["num_reqs_padded"] == 3
    # 3 token blocks + 1 request block + 2 groups x 3 rows x 32 lanes / 256 = 1
    assert L["grid"] == grid2 == (5, 1, 1)
    d["idx_mapping"].a = np.array([2, 0, -1], np.int64)  # int64 idx_mapping: allowed, flagged
    _call(pl, d)
    assert _last(fake)["params"]["idx_is_64"] == 1
    d["idx_mapping"].a = np.array([2, 0, -1], np.int32)
    _call(pl, d)
    assert _last(fake)["params"]["idx_is_64"] == 0


def _transposed(a):
    return np.ascontiguousarray(a.T).T


BAD_CHANGES = [
    ("idx_mapping", lambda a: a.astype(np.float32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.astype(np.uint32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.reshape(1, -1), ValueError, r"idx_mapping must be .* got shape \(1, 2\)"),
    ("idx_mapping", lambda a: np.repeat(a, 2)[::2], ValueError, "idx_mapping must be contiguous"),
    ("idx_mapping", lambda a: np.zeros(M + 1, np.int32), ValueError, "at most max_num_reqs = 4 entries, got 5"),
    ("idx_mapping", lambda a: a[:1], ValueError, r"query_start_loc must be .* = \(2,\), got shape \(3,\)"),
    ("query_start_loc", lambda a: a.astype(np.int64), TypeError, "query_start_loc must be int32"),
    ("query_start_loc", lambda a: a[:2], ValueError, r"query_start_loc must be .* = \(3,\), got shape \(2,\)"),
    ("query_start_loc", lambda a: np.repeat(a, 2)[::2], ValueError, "query_start_loc must be contiguous"),
    ("num_computed_tokens", lambda a: a.astype(np.int64), TypeError, "num_computed_tokens must be int32"),
    ("num_computed_tokens", lambda a: a[:3], ValueError, r"num_computed_tokens must be .* got shape \(3,\)"),
    ("num_computed_tokens", lambda a: np.repeat(a, 2)[::2], ValueError, "num_computed_tokens must be contiguous"),
    ("block_tables", lambda a: a.astype(np.int64), TypeError, r"block_tables\[0\] must be int32"),
    ("block_tables", lambda a: a[:3], ValueError, r"block_tables\[0\] must be .* got shape \(3, 4\)"),
    ("block_tables", lambda a: np.zeros((M, 5), np.int32), ValueError, r"block_tables\[0\] .* got shape \(4, 5\)"),
    ("block_tables", _transposed, ValueError, "contiguous last dim, got a last-dim stride of 4"),
    ("block_tables", lambda a: a.ravel(), ValueError, r"block_tables\[0\] must be .* got shape \(16,\)"),
    ("num_blocks", lambda a: a.astype(np.int64), TypeError, r"num_blocks\[0\] must be int32"),
    ("num_blocks", lambda a: a[:3], ValueError, r"num_blocks\[0\] must be .* got shape \(3,\)"),
    ("num_blocks", lambda a: np.repeat(a, 2)[::2], ValueError, r"num_blocks\[0\] must be contiguous"),
]


@pytest.mark.parametrize("which, change, exc, message", BAD_CHANGES)
def test_a_bad_change_in_place_raises_as_on_a_first_call(fake, which, change, exc, message):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)  # memoised
    x = _get(d, which)
    good = x.a
    x.a = change(x.a)
    with pytest.raises(exc, match=message):  # what a first call with these inputs says
        _call(_planner(G=2), d)
    n = len(fake.launches)
    with pytest.raises(exc, match=message):
        _call(pl, d)
    assert len(fake.launches) == n, "launched after a failed check"
    assert pl._memo is None
    with pytest.raises(exc, match=message):  # and again: a failed check memoises nothing
        _call(pl, d)
    x.a = good  # back to the checked metadata: accepted and memoised again
    _call(pl, d)
    assert len(fake.launches) == n + 1 and pl._memo is not None


@pytest.mark.parametrize("which", NAMES)
def test_a_new_device_is_seen(fake, which):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)
    _get(d, which, 1).dev = 1
    with pytest.raises(ValueError, match=r"must be on CUDA device 0, got an array in device 1"):
        _call(pl, d)


@pytest.mark.parametrize(
    "change, exc, message",
    [
        (lambda a: a.astype(np.int64), ValueError, r"num_blocks must be int32 with shape \(2, rows >= 4\)"),
        (lambda a: a[:, :3], ValueError, r"got dtype int32 shape \(2, 3\)"),
        (lambda a: a[:1], ValueError, r"got dtype int32 shape \(1, 4\)"),
        (lambda a: _transposed(a), ValueError, "num_blocks must have a contiguous last dim, got stride 2"),
    ],
)
def test_a_bad_change_of_stacked_num_blocks_is_seen(fake, change, exc, message):
    pl = _planner(G=2)
    d = _inputs(G=2, stacked=True)
    _call(pl, d)
    _call(pl, d)
    d["num_blocks"].a = change(d["num_blocks"].a)
    n = len(fake.launches)
    with pytest.raises(exc, match=message):
        _call(pl, d)
    assert len(fake.launches) == n


def test_lists_changed_in_place_are_seen(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)
    assert len(fake.described) == 7 + 2 and pl._memo is not None
    t2 = FakeArray(np.zeros((M, 4), np.int32))
    d["block_tables"][1] = t2  # the same list object, another table
    _call(pl, d)
    assert _last(fake)["params"]["block_table"][1] == t2.data.ptr
    nb2 = FakeArray(np.zeros(M, np.int32))
    d["num_blocks"][0] = nb2
    _call(pl, d)
    assert _last(fake)["params"]["num_blocks"][0] == nb2.data.ptr
    n = len(fake.launches)
    d["block_tables"].append(t2)
    with pytest.raises(ValueError, match=r"block_tables must be a sequence of 2 arrays .one per group., got 3"):
        _call(pl, d)
    d["block_tables"].pop()
    d["num_blocks"].pop()
    with pytest.raises(ValueError, match=r"num_blocks must be a sequence of 2 arrays .one per group., got 1"):
        _call(pl, d)
    d["num_blocks"].append(FakeArray(np.zeros(M, np.int64)))
    with pytest.raises(TypeError, match=r"num_blocks\[1\] must be int32"):
        _call(pl, d)
    d["block_tables"][0] = FakeArray(np.zeros((M, 4), np.int64))
    with pytest.raises(TypeError, match=r"block_tables\[0\] must be int32"):
        _call(pl, d)
    assert len(fake.launches) == n


def test_tuples_and_a_single_table_are_memoised(fake):
    pl = _planner(G=1)
    d = _inputs(G=1)
    d["block_tables"] = d["block_tables"][0]  # one array for one group
    d["num_blocks"] = tuple(d["num_blocks"])
    _call(pl, d)
    _call(pl, d)
    assert len(fake.described) == 5 + 2 and pl._memo is not None
    d["num_blocks"] = (FakeArray(np.zeros(M, np.int32)),)  # a new tuple
    _call(pl, d)
    assert _last(fake)["params"]["num_blocks"][0] == d["num_blocks"][0].data.ptr


def test_list_subclasses_are_checked_every_call(fake):
    class Tables(list):
        pass

    pl = _planner(G=2)
    d = _inputs(G=2)
    d["block_tables"] = Tables(d["block_tables"])
    _call(pl, d)
    _call(pl, d)
    assert len(fake.described) == 7 + 2  # idx_mapping and query_start_loc again
    d["block_tables"][0] = FakeArray(np.zeros((M, 4), np.int64))
    with pytest.raises(TypeError, match=r"block_tables\[0\] must be int32"):
        _call(pl, d)


def test_other_objects_are_checked(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    for which in ("idx_mapping", "query_start_loc", "num_computed_tokens"):
        d[which] = FakeArray(d[which].a.copy())  # equal contents and metadata, another object
        n = len(fake.described)
        _call(pl, d)
        assert len(fake.described) > n and _field(_last(fake)["params"], which) == d[which].data.ptr
    d["block_tables"] = list(d["block_tables"])  # another list, the same tables: compared by items
    n = len(fake.described)
    _call(pl, d)  # the objects of the checked call before: checked (idx, qsl) and memoised
    assert len(fake.described) == n + 2 and pl._memo is not None
    d["block_tables"] = list(d["block_tables"])
    n = len(fake.launches), len(fake.described)
    _call(pl, d)
    assert (len(fake.launches), len(fake.described)) == (n[0] + 1, n[1])


def test_num_reqs_padded_per_call(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d, padded=2)
    for padded in (3, 4, 2, None):
        _call(pl, d, padded=padded)
        assert _last(fake)["params"]["num_reqs_padded"] == (2 if padded is None else padded)
    assert len(fake.described) == 7 + 2  # (the second call made the memo)
    n = len(fake.launches)
    for bad, exc, message in (
        (1, ValueError, r"num_reqs_padded must be an int in \[2, 4\], got 1"),
        (5, ValueError, r"num_reqs_padded must be an int in \[2, 4\], got 5"),
        (True, TypeError, "num_reqs_padded must be an int >= 2, got True"),
        (3.0, TypeError, "num_reqs_padded must be an int >= 2, got 3.0"),
    ):
        with pytest.raises(exc, match=message):
            _call(pl, d, padded=bad)
    assert len(fake.launches) == n
    _call(pl, d, padded=np.int64(3))  # an integral of another type: the checked path
    assert _last(fake)["params"]["num_reqs_padded"] == 3


def test_num_reqs_padded_remembered_object_and_every_order(fake):
    """The fast path skips the struct write for the same num_reqs_padded object as the last launch's:
    every sequence of ints, None and NumPy ints launches the value asked for (and its grid)."""
    pl = _planner(G=2)
    d = _inputs(G=2)
    grids = {}
    for v in (2, 3, 4):
        ref = _planner(G=2)
        _call(ref, d, padded=v)
        grids[v] = _last(fake)["grid"]
    before = len(fake.described)
    three = 3
    seq = [np.int64(3), None, None, 4, 4, three, three, None, np.int64(4), np.int64(4), 2, None, 3, np.int64(2), 2]
    for padded in seq:
        _call(pl, d, padded=padded)
        want = 2 if padded is None else int(padded)
        assert _last(fake)["params"]["num_reqs_padded"] == want, (seq, padded)
        assert _last(fake)["grid"] == grids[want], (seq, padded)
    # a NumPy int takes the checked path (7 descriptions of the first call, 2 for each later one, and
    # 2 for the second call, which made the memo)
    assert len(fake.described) - before == 7 + 2 + 2 * 3


def test_a_grid_call_for_another_batch_leaves_the_next_launch_alone(fake):
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    _call(pl, d)
    want = _last(fake)
    assert want["params"]["pair_lanes"] == pl.auto_pair_lanes(4)  # 2 groups x 2 rows
    pl.grid(4000)  # writes the struct's lanes for another batch (8000 pairs)
    assert pl._params.pair_lanes == pl.auto_pair_lanes(8000) != want["params"]["pair_lanes"]
    _call(pl, d)
    assert _last(fake)["params"] == want["params"] and _last(fake)["grid"] == want["grid"] == (3 + 1 + 1, 1, 1)


def test_streams(fake):
    pl = _planner()
    d = _inputs()

    class TorchLikeStream:
        def __init__(self, h):
            self.cuda_stream = h

    s1, s2 = TorchLikeStream(0x77), TorchLikeStream(0x78)
    for s, want in ((s1, 0x77), (s1, 0x77), (s2, 0x78), (12, 12), (s1, 0x77)):
        _call(pl, d, stream=s)
        assert _last(fake)["stream"] == want
    s1.cuda_stream = 0x79  # an object of unknown kind may change its handle: not remembered
    _call(pl, d, stream=s1)
    assert _last(fake)["stream"] == 0x79

    class CupyLikeStream:
        def __init__(self, ptr):
            self.ptr = ptr

    CupyLikeStream.__module__ = "cupy.cuda.stream"
    c = CupyLikeStream(0x80)
    _call(pl, d, stream=c)
    assert pl._stream._obj is c and pl._stream._ptr == 0x80
    _call(pl, d, stream=c)
    assert _last(fake)["stream"] == 0x80
    _call(pl, d, stream=None)  # CuPy's current stream, looked up at each call
    assert _last(fake)["stream"] == 1234
    with pytest.raises(TypeError, match="stream must be"):
        _call(pl, d, stream="s")


def test_request_state_changed_in_place_is_checked_with_the_memo_off(fake):
    """The identity cache of the request state compares signatures too (it did not before)."""
    pl = _planner(G=2)
    pl.memoize_checks = False
    d = _inputs(G=2)
    _call(pl, d)
    d["num_computed_tokens"].a = d["num_computed_tokens"].a[:3]
    with pytest.raises(ValueError, match=r"num_computed_tokens must be .* got shape \(3,\)"):
        _call(pl, d)
    d["num_computed_tokens"].a = np.zeros(M, np.int32)
    _call(pl, d)
    assert _last(fake)["params"]["num_computed_tokens"] == d["num_computed_tokens"].data.ptr
    d["block_tables"][1].a = np.zeros((M, 4), np.int32)
    d["num_blocks"][1].dev = 1
    with pytest.raises(ValueError, match=r"num_blocks\[1\] must be on CUDA device 0"):
        _call(pl, d)
    d["num_blocks"][1].dev = 0
    _call(pl, d)
    assert _last(fake)["params"]["block_table"][1] == d["block_tables"][1].data.ptr


def test_forget_inputs_and_the_three_launch_baseline(fake):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    pl.forget_inputs()
    assert pl._memo is None
    _call(pl, d)
    assert len(fake.described) == 14
    three = VllmThreeLaunch(M, 600, [4, 4], [4, 4])
    n = len(fake.described)
    _call(three, d)
    _call(three, d)
    assert len(fake.described) == n + 7 + 2 and three._memo is None  # unchanged: no memo there
    assert [L["name"] for L in fake.launches[-3:]] == [
        "kvaddr_vllm3_prepare",
        "kvaddr_vllm3_gather",
        "kvaddr_vllm3_slots",
    ]


def test_objects_without_a_cheap_signature_are_not_memoised(fake, monkeypatch):
    class Cai:
        def __init__(self, a):
            self.a = a
            self.__cuda_array_interface__ = dict(
                shape=a.shape, typestr=a.dtype.str, data=(a.ctypes.data, False), strides=None, version=3
            )

    from kvaddr import validation

    monkeypatch.setattr(validation, "_device_of_pointer", lambda ptr: 0)
    pl = _planner()
    d = _inputs()
    d["query_start_loc"] = Cai(d["query_start_loc"].a)
    _call(pl, d)
    assert pl._memo is None
    _call(pl, d)
    assert len(fake.described) == 5 + 2


@pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")
def test_the_memoised_path_matches_the_emulated_kernel(monkeypatch):
    """Steps on the same objects with new contents in the same memory (an engine's persistent
    buffers): every memoised launch agrees with the reference, outputs and error record."""
    install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(7)
    cfg, x = random_case(rng, max_num_reqs=40, num_reqs=30, block_sizes=(4, 16), max_query=3)
    pl = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
    d = {k: ([FakeArray(a.copy()) for a in v] if isinstance(v, list) else FakeArray(v.copy())) for k, v in x.items()}
    described = []
    real = vllm_module.describe
    monkeypatch.setattr(vllm_module, "describe", _counting(described, real))
    for step in range(5):
        padded = 30 + step
        out = pl.compute(*(d[k] for k in NAMES), padded)
        host = {k: ([a.a for a in v] if isinstance(v, list) else v.a) for k, v in d.items()}
        want = vllm_step_reference(cfg, **host, num_reqs_padded=padded)
        got = {
            k: (tuple(t.a.copy() for t in v) if isinstance(v, tuple) else v.a.copy()) for k, v in out.as_dict().items()
        }
        assert_same(got, want.outputs.as_dict(), f"step {step}")
        assert pl.errors() == (want.error_mask, want.error_key), f"step {step}"
        # the next step: new contents in the same memory (a new batch over the same state, and a
        # corrupted table entry every other step)
        nxt = new_batch(rng, cfg, host, 30, max_query=1)
        d["idx_mapping"].a[:] = nxt["idx_mapping"]
        d["query_start_loc"].a[:] = nxt["query_start_loc"]
        if step % 2 == 0:
            d["block_tables"][1].a[rng.integers(0, 40), 0] = -5
    assert len(described) == 7 + 2 and pl._memo is not None  # (the second step made the memo)


def test_one_table_object_for_two_groups_changed_in_place_is_seen(fake):
    """The same table (and the same num_blocks array) passed for both groups: each distinct
    object's signature is read once per call, and a change in place of it (a resize, a new
    dtype, a new pointer) takes the checked path for both groups."""
    pl = _planner(G=2)
    d = _inputs(G=2)
    t, nb = d["block_tables"][0], d["num_blocks"][0]
    d["block_tables"], d["num_blocks"] = [t, t], [nb, nb]
    _call(pl, d)
    _call(pl, d)
    checked = len(fake.described)
    _call(pl, d)
    assert len(fake.described) == checked and pl._memo is not None
    good = t.a
    t.a = good[:3]  # fewer rows than max_num_reqs (a resize_ in place)
    n = len(fake.launches)
    with pytest.raises(ValueError, match=r"block_tables\[0\] must .* got shape \(3, 4\)"):
        _call(pl, d)
    assert len(fake.launches) == n and pl._memo is None
    t.a = good.astype(np.int64)
    with pytest.raises(TypeError, match=r"block_tables\[0\] must be int32"):
        _call(pl, d)
    t.a = good.copy()  # a new pointer
    _call(pl, d)
    assert _last(fake)["params"]["block_table"][:2] == [t.data.ptr] * 2
    checked = len(fake.described)
    _call(pl, d)
    assert len(fake.described) == checked  # memoised again
    nb.a = nb.a[:3]
    with pytest.raises(ValueError, match=r"num_blocks\[0\] must .* got shape \(3,\)"):
        _call(pl, d)
    nb.a = np.zeros(M, np.int32)
    _call(pl, d)
    assert _last(fake)["params"]["num_blocks"][:2] == [nb.data.ptr] * 2


def test_an_array_passed_in_two_roles_is_checked_in_both(fake):
    """num_computed_tokens also passed as num_blocks[1] (legal: both int32 [rows]); a change of it
    in place is seen by the one signature read."""
    pl = _planner(G=2)
    d = _inputs(G=2)
    d["num_blocks"][1] = d["num_computed_tokens"]
    _call(pl, d)
    _call(pl, d)
    x = d["num_computed_tokens"]
    x.a = x.a[:3]
    with pytest.raises(ValueError, match=r"num_computed_tokens must be .* got shape \(3,\)"):
        _call(pl, d)


def _counting_guards(monkeypatch, module):
    """memo_guard of ``module``, counting the guards it builds."""
    built = []
    real = module.memo_guard

    def memo_guard(*a, **kw):
        built.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(module, "memo_guard", memo_guard)
    return built


def test_no_guard_is_built_for_new_objects_every_call(fake, monkeypatch):
    """vLLM's pattern: new idx_mapping / query_start_loc objects (slices) every step. No call repeats
    the objects of the one before, so no memo guard is built (it could never hit). The request state
    repeats: the second call binds it (taking the pointers it just checked, describing nothing), and
    from the third call on the batch is checked inline (the binding's fast batch check, nothing
    described) while every launch carries the new objects' pointers."""
    built = _counting_guards(monkeypatch, vllm_module)
    pl = _planner(G=2)
    d = _inputs(G=2)
    for _ in range(5):
        d["idx_mapping"] = FakeArray(d["idx_mapping"].a.copy())
        d["query_start_loc"] = FakeArray(d["query_start_loc"].a.copy())
        _call(pl, d)
        assert _last(fake)["params"]["idx_mapping"] == d["idx_mapping"].data.ptr
    assert built == [] and pl._memo is None
    assert len(fake.described) == 7 + 2
    assert pl._state_bound is not None and pl._state_bound.bound["num_computed_tokens"] is d["num_computed_tokens"]


def test_the_guard_is_built_when_the_objects_repeat_and_then_used(fake, monkeypatch):
    built = _counting_guards(monkeypatch, vllm_module)
    pl = _planner(G=2)
    d = _inputs(G=2)
    _call(pl, d)
    assert built == [] and pl._memo is None
    _call(pl, d)  # the objects of the checked call before: the guard is built
    assert len(built) == 1 and pl._memo is not None
    n = len(fake.described)
    for _ in range(3):
        _call(pl, d)
    assert len(built) == 1 and len(fake.described) == n  # used: no check, no new guard
    d["block_tables"] = list(d["block_tables"])  # a new list with the same items: still the memo
    _call(pl, d)
    assert len(built) == 1 and len(fake.described) == n
    # an in-place change of a signature: checked again; the same objects, so the guard is rebuilt
    # at once for the new signature (and used by the next call)
    x = d["num_computed_tokens"]
    x.a = x.a.copy()
    _call(pl, d)
    assert len(fake.described) == n + 3 and len(built) == 2
    assert _last(fake)["params"]["num_computed_tokens"] == x.data.ptr
    _call(pl, d)
    assert len(fake.described) == n + 3 and len(built) == 2
    # a bad change in place: checked, refused, no guard; the same objects restored: memoised again
    good = x.a
    x.a = good[:3]
    with pytest.raises(ValueError, match=r"num_computed_tokens must be .* got shape \(3,\)"):
        _call(pl, d)
    assert pl._memo is None and len(built) == 2
    x.a = good
    _call(pl, d)
    assert len(built) == 3 and pl._memo is not None
    # new objects after a memo: checked, the memo dropped, no guard built for them
    d["idx_mapping"] = FakeArray(d["idx_mapping"].a.copy())
    _call(pl, d)
    assert pl._memo is None and len(built) == 3
    assert _last(fake)["params"]["idx_mapping"] == d["idx_mapping"].data.ptr
    # forget_inputs() forgets the last call's objects too: the next call does not build a guard
    pl.forget_inputs()
    _call(pl, d)
    assert pl._memo is None and len(built) == 3
