"""VllmStepPlanner.bind(): the request state checked once, the batch checked every launch (CPU, fake CuPy).

A BoundVllmStep launches with its own copy of the parameter block: these tests read back every
launch's struct, grid, kernel and stream (tests/support/vllm_fake_cupy.py) and compare them with
compute()'s for the same inputs; prove each bound array is checked at bind (every bad dtype,
shape, stride and device raises compute()'s message, naming the argument) and again after a
change in place (a resize, a new pointer, a list item replaced); prove idx_mapping and
query_start_loc are checked at every launch (a bad one raises compute()'s message, launches
nothing); and, with the C++ kernel emulator, that bound launches agree with the reference.
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
STATE = NAMES[2:]
M = 4  # the worked example's max_num_reqs


@pytest.fixture
def fake(monkeypatch):
    ns = install(monkeypatch)
    described = []
    real = vllm_module.describe

    def describe(name, x):
        if not name.startswith("out."):
            described.append(name)
        return real(name, x)

    monkeypatch.setattr(vllm_module, "describe", describe)
    ns.described = described
    return ns


def _planner(G=1, **kw):
    return vllm_module.VllmStepPlanner(M, 600, [4] * G, [4] * G, **kw)


def _inputs(G=1, stacked=False):
    _, x = worked_example()
    d = {k: FakeArray(x[k].copy()) for k in NAMES[:3]}
    d["block_tables"] = [FakeArray(x["block_tables"][0].copy()) for _ in range(G)]
    if stacked:
        d["num_blocks"] = FakeArray(np.stack([x["num_blocks"][0]] * G))
    else:
        d["num_blocks"] = [FakeArray(x["num_blocks"][0].copy()) for _ in range(G)]
    return d


def _bind(pl, d, **kw):
    return pl.bind(*(d[k] for k in STATE), **kw)


def _launch(bound, d, padded=3, stream=9):
    return bound.launch(d["idx_mapping"], d["query_start_loc"], padded, stream=stream)


def _compute(pl, d, padded=3, stream=9):
    return pl.compute(*(d[k] for k in NAMES), padded, stream=stream)


def _same_launch(a, b):
    assert (a["fn"], a["grid"], a["block"], a["stream"]) == (b["fn"], b["grid"], b["block"], b["stream"])
    assert a["params"] == b["params"]


@pytest.mark.parametrize("G, stacked", [(1, False), (2, False), (2, True), (3, True)])
def test_launch_parameters_equal_compute(fake, G, stacked):
    d = _inputs(G, stacked)
    pl = _planner(G)
    bound = _bind(pl, d)
    for padded, idx in ((2, [2, 0]), (4, [2, 0]), (None, [2, 0]), (3, [1, -1, 3]), (4, [3]), (1, [3]), (0, [])):
        n = len(idx)
        d["idx_mapping"] = FakeArray(np.array(idx, np.int64 if n == 3 else np.int32))
        d["query_start_loc"] = FakeArray(np.arange(n + 1, dtype=np.int32))
        if padded is not None and padded < n:
            continue
        out = _compute(pl, d, padded)  # (the same planner: the same outputs and device state)
        want = fake.launches[-1]
        got_out = _launch(bound, d, padded)
        _same_launch(fake.launches[-1], want)
        assert got_out is out is pl.outputs
    assert bound.params is not pl._params


def test_the_outputs_are_the_planners_and_out_buffers(fake):
    d = _inputs()
    positions = FakeArray(np.zeros(600, np.int64))
    pl = _planner(out={"positions": positions})
    out = _launch(_bind(pl, d), d)
    assert out is pl.outputs and out.positions is positions
    assert fake.launches[-1]["params"]["positions"] == positions.data.ptr


def test_the_state_is_checked_once_and_the_batch_every_launch(fake):
    d = _inputs(G=2)
    pl = _planner(G=2)
    bound = _bind(pl, d)
    assert fake.described == [
        "num_computed_tokens",
        "block_tables[0]",
        "block_tables[1]",
        "num_blocks[0]",
        "num_blocks[1]",
    ]
    fake.described.clear()
    for _ in range(3):
        _launch(bound, d)
    assert fake.described == []  # the batch: read inline (cupy_batch_check), the state: not again
    for _ in range(2):  # new batch objects every step (vLLM's slices)
        d["idx_mapping"] = FakeArray(d["idx_mapping"].a.copy())
        d["query_start_loc"] = FakeArray(d["query_start_loc"].a.copy())
        _launch(bound, d)
        assert fake.launches[-1]["params"]["idx_mapping"] == d["idx_mapping"].data.ptr
        assert fake.launches[-1]["params"]["query_start_loc"] == d["query_start_loc"].data.ptr
    assert fake.described == []
    assert pl._memo is None  # compute()'s memo is not involved


def _transposed(a):
    return np.ascontiguousarray(a.T).T


#: (argument, change, error, message): each a bad request-state array; compute() raises the same.
BAD_STATE = [
    ("num_computed_tokens", lambda a: a.astype(np.int64), TypeError, "num_computed_tokens must be int32"),
    ("num_computed_tokens", lambda a: a[:3], ValueError, r"num_computed_tokens must be .* got shape \(3,\)"),
    (
        "num_computed_tokens",
        lambda a: a.reshape(2, 2),
        ValueError,
        r"num_computed_tokens must be .* got shape \(2, 2\)",
    ),
    ("num_computed_tokens", lambda a: np.repeat(a, 2)[::2], ValueError, "num_computed_tokens must be contiguous"),
    ("block_tables", lambda a: a.astype(np.int64), TypeError, r"block_tables\[0\] must be int32"),
    ("block_tables", lambda a: a.astype(np.float32), TypeError, r"block_tables\[0\] must be int32"),
    ("block_tables", lambda a: a[:3], ValueError, r"block_tables\[0\] must be .* got shape \(3, 4\)"),
    ("block_tables", lambda a: np.zeros((M, 5), np.int32), ValueError, r"block_tables\[0\] .* got shape \(4, 5\)"),
    ("block_tables", _transposed, ValueError, "contiguous last dim, got a last-dim stride of 4"),
    ("block_tables", lambda a: a.ravel(), ValueError, r"block_tables\[0\] must be .* got shape \(16,\)"),
    ("num_blocks", lambda a: a.astype(np.int64), TypeError, r"num_blocks\[0\] must be int32"),
    ("num_blocks", lambda a: a[:3], ValueError, r"num_blocks\[0\] must be .* got shape \(3,\)"),
    ("num_blocks", lambda a: np.repeat(a, 2)[::2], ValueError, r"num_blocks\[0\] must be contiguous"),
]


def _item(d, which):
    x = d[which]
    return x[0] if isinstance(x, list) else x


@pytest.mark.parametrize("which, change, exc, message", BAD_STATE)
def test_bind_checks_every_bound_array(fake, which, change, exc, message):
    d = _inputs(G=2)
    x = _item(d, which)
    x.a = change(x.a)
    with pytest.raises(exc, match=message):  # what compute() says
        _compute(_planner(G=2), d)
    with pytest.raises(exc, match=message):
        _bind(_planner(G=2), d)
    assert fake.launches == []


@pytest.mark.parametrize("which", STATE)
def test_bind_checks_the_device(fake, which):
    d = _inputs(G=2)
    _item(d, which).dev = 1
    with pytest.raises(ValueError, match=r"must be on CUDA device 0, got an array in device 1"):
        _bind(_planner(G=2), d)


def test_bind_checks_the_sequences_and_stacked_num_blocks(fake):
    d = _inputs(G=2)
    pl = _planner(G=2)
    with pytest.raises(ValueError, match=r"block_tables must be a sequence of 2 arrays .one per group., got 1"):
        pl.bind(d["num_computed_tokens"], d["block_tables"][:1], d["num_blocks"])
    with pytest.raises(ValueError, match=r"num_blocks must be a sequence of 2 arrays .one per group., got 4"):
        pl.bind(d["num_computed_tokens"], d["block_tables"], d["num_blocks"] * 2)
    with pytest.raises(TypeError, match="block_tables must be an array or a sequence"):
        pl.bind(d["num_computed_tokens"], 7, d["num_blocks"])
    stacked = _inputs(G=2, stacked=True)["num_blocks"]
    stacked.a = stacked.a[:, :3]
    with pytest.raises(ValueError, match=r"num_blocks must be int32 with shape \(2, rows >= 4\)"):
        pl.bind(d["num_computed_tokens"], d["block_tables"], stacked)


def test_bind_refuses_the_three_launch_baseline(fake):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    d = _inputs(G=2)
    with pytest.raises(TypeError, match="bind needs a one-launch VllmStepPlanner, got VllmThreeLaunch"):
        _bind(VllmThreeLaunch(M, 600, [4, 4], [4, 4]), d)


@pytest.mark.parametrize("which, change, exc, message", BAD_STATE)
def test_a_bound_array_changed_in_place_is_checked_again(fake, which, change, exc, message):
    d = _inputs(G=2)
    pl = _planner(G=2)
    bound = _bind(pl, d)
    _launch(bound, d)
    x = _item(d, which)
    good = x.a
    x.a = change(good)
    n = len(fake.launches)
    for _ in range(2):  # and again: a failed check binds nothing
        with pytest.raises(exc, match=message):
            _launch(bound, d)
    assert len(fake.launches) == n, "launched after a failed check"
    x.a = good.copy()  # good again, in new memory: checked and bound
    fake.described.clear()
    _launch(bound, d)
    assert len(fake.launches) == n + 1 and len(fake.described) == 5
    _compute(pl, d)
    _same_launch(fake.launches[-2], fake.launches[-1])
    fake.described.clear()
    _launch(bound, d)
    assert fake.described == []  # bound again: checked once


@pytest.mark.parametrize("which", STATE)
def test_a_new_pointer_or_device_of_a_bound_array_is_seen(fake, which):
    d = _inputs(G=2)
    bound = _bind(_planner(G=2), d)
    _launch(bound, d)
    x = _item(d, which)
    x.a = x.a.copy()  # same object, new memory
    _launch(bound, d)
    field = {"num_computed_tokens": "num_computed_tokens", "block_tables": "block_table", "num_blocks": "num_blocks"}
    got = fake.launches[-1]["params"][field[which]]
    assert (got if which == "num_computed_tokens" else got[0]) == x.data.ptr
    x.dev = 1
    with pytest.raises(ValueError, match=r"must be on CUDA device 0, got an array in device 1"):
        _launch(bound, d)


def test_a_resized_table_and_stacked_num_blocks_are_rebound(fake):
    d = _inputs(G=2, stacked=True)
    bound = _bind(_planner(G=2), d)
    _launch(bound, d)
    t = d["block_tables"][1]
    wide = np.zeros((2 * M, 4), np.int32)
    t.a = wide[::2]  # a row stride of 8
    _launch(bound, d)
    assert fake.launches[-1]["params"]["table_stride"][:2] == [4, 8]
    nb = d["num_blocks"]
    nb.a = np.zeros((2, 8), np.int32)[:, :M]
    _launch(bound, d)
    assert fake.launches[-1]["params"]["num_blocks"][:2] == [nb.data.ptr, nb.data.ptr + 4 * 8]


def test_a_bound_list_changed_in_place_is_seen(fake):
    d = _inputs(G=2)
    bound = _bind(_planner(G=2), d)
    _launch(bound, d)
    t2 = FakeArray(np.zeros((M, 4), np.int32))
    d["block_tables"][1] = t2  # the bound list object, another table
    _launch(bound, d)
    assert fake.launches[-1]["params"]["block_table"][1] == t2.data.ptr
    d["num_blocks"][0] = FakeArray(np.zeros(M, np.int64))
    n = len(fake.launches)
    with pytest.raises(TypeError, match=r"num_blocks\[0\] must be int32"):
        _launch(bound, d)
    d["num_blocks"].pop()
    with pytest.raises(ValueError, match=r"num_blocks must be a sequence of 2 arrays .one per group., got 1"):
        _launch(bound, d)
    assert len(fake.launches) == n
    assert bound.bound["block_tables"] is d["block_tables"]


#: (argument, bad value, error, message): compute() raises the same for the same batch.
BAD_BATCH = [
    ("idx_mapping", lambda a: a.astype(np.float32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.astype(np.uint32), TypeError, "idx_mapping must be int32 or int64"),
    ("idx_mapping", lambda a: a.reshape(1, -1), ValueError, r"idx_mapping must be .* got shape \(1, 2\)"),
    ("idx_mapping", lambda a: np.repeat(a, 2)[::2], ValueError, "idx_mapping must be contiguous"),
    ("idx_mapping", lambda a: np.zeros(M + 1, np.int32), ValueError, "at most max_num_reqs = 4 entries, got 5"),
    ("idx_mapping", lambda a: a[:1], ValueError, r"query_start_loc must be .* = \(2,\), got shape \(3,\)"),
    ("query_start_loc", lambda a: a.astype(np.int64), TypeError, "query_start_loc must be int32"),
    ("query_start_loc", lambda a: a[:2], ValueError, r"query_start_loc must be .* = \(3,\), got shape \(2,\)"),
    ("query_start_loc", lambda a: np.zeros(9, np.int32), ValueError, r"query_start_loc must be .* got shape \(9,\)"),
    ("query_start_loc", lambda a: np.repeat(a, 2)[::2], ValueError, "query_start_loc must be contiguous"),
    ("query_start_loc", lambda a: a.reshape(3, 1), ValueError, r"query_start_loc must be .* got shape \(3, 1\)"),
]


@pytest.mark.parametrize("which, change, exc, message", BAD_BATCH)
@pytest.mark.parametrize("same_object", [True, False])
def test_the_batch_is_checked_every_launch(fake, which, change, exc, message, same_object):
    d = _inputs(G=2)
    bound = _bind(_planner(G=2), d)
    _launch(bound, d)
    _launch(bound, d)
    if same_object:  # changed in place after launches with it
        d[which].a = change(d[which].a)
    else:  # a new object
        d[which] = FakeArray(change(d[which].a))
    with pytest.raises(exc, match=message):  # what compute() says
        _compute(_planner(G=2), d)
    n = len(fake.launches)
    with pytest.raises(exc, match=message):
        _launch(bound, d)
    assert len(fake.launches) == n


def test_the_batch_device_and_other_objects(fake):
    d = _inputs()
    bound = _bind(_planner(), d)
    d["query_start_loc"].dev = 1
    with pytest.raises(ValueError, match=r"query_start_loc must be on CUDA device 0, got an array in device 1"):
        _launch(bound, d)
    d["query_start_loc"].dev = 0
    with pytest.raises(TypeError, match="idx_mapping must be a CUDA array"):
        bound.launch(np.array([2, 0], np.int32), d["query_start_loc"], stream=9)
    with pytest.raises(TypeError, match="query_start_loc must be a CUDA array"):
        bound.launch(d["idx_mapping"], [0, 1, 3], stream=9)


def test_num_reqs_padded(fake):
    d = _inputs(G=2)
    bound = _bind(_planner(G=2), d)
    for padded in (2, 3, 4, None, np.int64(3), 2):
        _launch(bound, d, padded)
        assert fake.launches[-1]["params"]["num_reqs_padded"] == (2 if padded is None else int(padded))
    n = len(fake.launches)
    for bad, exc, message in (
        (1, ValueError, r"num_reqs_padded must be an int in \[2, 4\], got 1"),
        (5, ValueError, r"num_reqs_padded must be an int in \[2, 4\], got 5"),
        (True, TypeError, "num_reqs_padded must be an int >= 2, got True"),
        (3.0, TypeError, "num_reqs_padded must be an int >= 2, got 3.0"),
        ("3", TypeError, "num_reqs_padded must be an int >= 2, got '3'"),
    ):
        with pytest.raises(exc, match=message):
            _launch(bound, d, bad)
    assert len(fake.launches) == n


def test_grid_and_lanes_follow_num_reqs(fake):
    pl = vllm_module.VllmStepPlanner(600, 600, [4, 4], [4, 4])
    st = {
        "num_computed_tokens": FakeArray(np.zeros(600, np.int32)),
        "block_tables": [FakeArray(np.zeros((600, 4), np.int32)) for _ in range(2)],
        "num_blocks": [FakeArray(np.zeros(600, np.int32)) for _ in range(2)],
    }
    bound = pl.bind(**st)
    for n, padded in ((2, 2), (2, 600), (300, 300), (3000 // 6, 520), (2, 2), (590, 600), (5, 5)):
        d = dict(st, idx_mapping=FakeArray(np.zeros(n, np.int32)), query_start_loc=FakeArray(np.zeros(n + 1, np.int32)))
        _compute(pl, d, padded)
        want = fake.launches[-1]
        assert want["grid"][0] == pl.grid(padded, n)
        _launch(bound, d, padded)
        _same_launch(fake.launches[-1], want)


def test_streams(fake):
    d = _inputs()
    pl = _planner()
    bound = _bind(pl, d, stream=55)

    class TorchLikeStream:
        def __init__(self, h):
            self.cuda_stream = h

    CupyLike = type("Stream", (), {"__init__": lambda self, p: setattr(self, "ptr", p)})
    CupyLike.__module__ = "cupy.cuda.stream"
    c = CupyLike(0x80)
    for s, want in ((None, 55), (12, 12), (TorchLikeStream(0x77), 0x77), (c, 0x80), (c, 0x80), (None, 55)):
        bound.launch(d["idx_mapping"], d["query_start_loc"], stream=s)
        assert fake.launches[-1]["stream"] == want
    plain = _bind(pl, d)
    plain.launch(d["idx_mapping"], d["query_start_loc"])  # CuPy's current stream
    assert fake.launches[-1]["stream"] == 1234
    with pytest.raises(TypeError, match="stream must be"):
        plain.launch(d["idx_mapping"], d["query_start_loc"], stream="s")


def test_compute_and_bindings_do_not_share_a_parameter_block(fake):
    """compute() with other request state between two bound launches changes nothing of the binding's."""
    d, e = _inputs(G=2), _inputs(G=2)
    pl = _planner(G=2)
    bound = _bind(pl, d)
    _launch(bound, d)
    first = fake.launches[-1]
    other = _bind(pl, e)
    _compute(pl, e)
    _compute(pl, e)
    _launch(other, e)
    _launch(bound, d)
    _same_launch(fake.launches[-1], first)
    assert fake.launches[-2]["params"]["num_computed_tokens"] == e["num_computed_tokens"].data.ptr


def test_the_binding_holds_its_arrays():
    import gc
    import weakref

    from tests.support import vllm_fake_cupy

    mp = pytest.MonkeyPatch()
    try:
        vllm_fake_cupy.install(mp)
        d = _inputs()
        bound = _bind(_planner(), d)
        refs = [weakref.ref(d[k][0] if isinstance(d[k], list) else d[k]) for k in STATE]
        assert list(bound.bound) == list(STATE)
        del d
        gc.collect()
        assert all(r() is not None for r in refs)
        del bound
        gc.collect()
        assert all(r() is None for r in refs)
    finally:
        mp.undo()


@pytest.mark.skipif(vllm_emulator.CXX is None, reason="no C++ compiler: kernel emulation skipped")
def test_bound_launches_match_the_emulated_kernel(monkeypatch):
    """Steps over persistent request state (new contents in place every step, a corrupted entry
    every other step), a new batch object of a new size every step: every bound launch agrees with
    the reference, outputs and error record."""
    install(monkeypatch, on_launch=vllm_emulator.run)
    rng = np.random.default_rng(11)
    cfg, x = random_case(rng, max_num_reqs=40, num_reqs=30, block_sizes=(4, 16), max_query=3)
    pl = vllm_module.VllmStepPlanner(**planner_kwargs(cfg))
    state = {
        k: ([FakeArray(a.copy()) for a in x[k]] if isinstance(x[k], list) else FakeArray(x[k].copy())) for k in STATE
    }
    bound = pl.bind(**state)
    batch = x
    for step in range(6):
        n = len(batch["idx_mapping"])
        padded = min(n + step, cfg.max_num_reqs)
        out = bound.launch(FakeArray(batch["idx_mapping"].copy()), FakeArray(batch["query_start_loc"].copy()), padded)
        host = {k: ([a.a for a in v] if isinstance(v, list) else v.a) for k, v in state.items()}
        want = vllm_step_reference(cfg, batch["idx_mapping"], batch["query_start_loc"], **host, num_reqs_padded=padded)
        got = {
            k: (tuple(t.a.copy() for t in v) if isinstance(v, tuple) else v.a.copy()) for k, v in out.as_dict().items()
        }
        assert_same(got, want.outputs.as_dict(), f"step {step}")
        assert pl.errors() == (want.error_mask, want.error_key), f"step {step}"
        # the next step: new request-state contents in the same memory, a new batch (new objects, a new
        # size); a corrupted table entry every other step
        state["num_computed_tokens"].a[:] //= 2
        if step % 2 == 0:
            state["block_tables"][1].a[rng.integers(0, 40), 0] = -5
        batch = new_batch(rng, cfg, dict(host, idx_mapping=batch["idx_mapping"]), int(rng.integers(1, 31)), max_query=1)


def test_the_fast_batch_check_agrees_with_check_batch(fake, monkeypatch):
    """cupy_batch_check (the batch read inline) against check_batch (describe + check_vector) on
    good and bad batches of every kind: where the fast check answers, its answer is check_batch's;
    where check_batch raises, the fast check declines (None) and the launch raises check_batch's
    message."""
    from kvaddr.engines.vllm_bound import cupy_batch_check

    check = cupy_batch_check(M, 0)
    rng = np.random.default_rng(5)
    cases = []
    for n in range(M + 2):
        for idt in (np.int32, np.int64, np.uint32, np.float32):
            for qdt in (np.int32, np.int64):
                for qlen in (n, n + 1, n + 2):
                    for step in (1, 2):
                        idx = np.zeros(2 * max(n, 1), idt)[: n * step : step]
                        qsl = np.zeros(2 * qlen, qdt)[::2] if step == 2 and rng.random() < 0.5 else np.zeros(qlen, qdt)
                        cases.append((idx, qsl))
    cases.append((np.zeros((1, 2), np.int32), np.zeros(3, np.int32)))
    cases.append((np.zeros(2, np.int32), np.zeros((3, 1), np.int32)))
    accepted = 0
    for idx, qsl in cases:
        for dev_i, dev_q in ((0, 0), (1, 0), (0, 1)):
            a, b = FakeArray(idx, dev_i), FakeArray(qsl, dev_q)
            got = check(a, b)
            try:
                i, q = vllm_module.check_batch(a, b, M, 0)
            except (TypeError, ValueError):
                assert got is None, (idx.dtype, idx.shape, idx.strides, qsl.dtype, qsl.shape, dev_i, dev_q)
                continue
            if got is not None:  # (it may decline a batch check_batch takes, never the reverse)
                accepted += 1
                assert got == (i.ptr, i.shape[0], i.dtype == np.int64, q.ptr)
    assert accepted >= 2 * (M + 1)


def test_mixed_and_other_kinds_take_check_batch(fake, monkeypatch):
    from kvaddr import validation

    monkeypatch.setattr(validation, "_device_of_pointer", lambda ptr: 0)
    d = _inputs()
    bound = _bind(_planner(), d)
    assert len(fake.described) == 3

    class Cai:
        def __init__(self, a):
            self.__cuda_array_interface__ = dict(
                shape=a.shape, typestr=a.dtype.str, data=(a.ctypes.data, False), strides=None, version=3
            )

    q = Cai(d["query_start_loc"].a)
    bound.launch(d["idx_mapping"], q, stream=9)  # CuPy and another kind: described and checked
    assert fake.described[3:] == ["idx_mapping", "query_start_loc"]
    assert fake.launches[-1]["params"]["query_start_loc"] == d["query_start_loc"].a.ctypes.data
    q.__cuda_array_interface__["typestr"] = "<i8"
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        bound.launch(d["idx_mapping"], q, stream=9)


def test_torch_tensors_take_the_torch_batch_check(fake, monkeypatch):
    """torch_batch_check on stand-ins of torch tensors (a fake ``torch`` module with its dtypes):
    the same launch as compute()'s for good batches; each bad one declined, raising compute()'s
    message."""
    import sys
    import types

    torch = types.ModuleType("torch")
    torch.int32, torch.int64, torch.float32 = "torch.int32", "torch.int64", "torch.float32"
    monkeypatch.setitem(sys.modules, "torch", torch)
    np_of = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}

    class Tensor:
        def __init__(self, a, dtype, dev=0, cuda=True):
            self.a, self.dtype, self.dev, self.is_cuda = np.asarray(a, np_of[dtype]), dtype, dev, cuda

        shape = property(lambda self: self.a.shape)
        device = property(lambda self: f"cuda:{self.dev}")

        def data_ptr(self):
            return self.a.ctypes.data

        def stride(self, dim=None):
            st = tuple(s // self.a.itemsize for s in self.a.strides)
            return st if dim is None else st[dim]

        def get_device(self):
            return self.dev if self.is_cuda else -1

        def dim(self):
            return self.a.ndim

        def numel(self):
            return self.a.size

        def is_contiguous(self):  # (torch's rule: a dim of size 1 has any stride)
            return self.a.flags.c_contiguous

    Tensor.__module__ = "torch"
    from kvaddr import validation

    monkeypatch.setitem(validation._TORCH_DTYPES, torch.int32, np.dtype(np.int32))
    monkeypatch.setitem(validation._TORCH_DTYPES, torch.int64, np.dtype(np.int64))
    monkeypatch.setitem(validation._TORCH_DTYPES, torch.float32, np.dtype(np.float32))
    d = _inputs(G=2)
    pl = _planner(G=2)
    bound = _bind(pl, d)
    for idx, idt in (([2, 0], torch.int32), ([1, -1, 3], torch.int64), ([], torch.int32)):
        i, q = Tensor(idx, idt), Tensor(np.arange(len(idx) + 1), torch.int32)
        pl.compute(i, q, *(d[k] for k in STATE), 4, stream=9)
        want = fake.launches[-1]
        n = len(fake.described)
        bound.launch(i, q, 4, stream=9)
        assert len(fake.described) == n  # read inline, not described
        _same_launch(fake.launches[-1], want)
    good_i, good_q = Tensor([2, 0], torch.int32), Tensor([0, 1, 3], torch.int32)
    for i, q, exc, message in (
        (Tensor([2, 0], torch.float32), good_q, TypeError, "idx_mapping must be int32 or int64"),
        (Tensor([[2, 0]], torch.int32), good_q, ValueError, r"idx_mapping must be .* got shape \(1, 2\)"),
        (Tensor(np.zeros(5), torch.int32), good_q, ValueError, "at most max_num_reqs = 4 entries, got 5"),
        (good_i, Tensor([0, 1, 3], torch.int64), TypeError, "query_start_loc must be int32"),
        (good_i, Tensor([0, 1], torch.int32), ValueError, r"query_start_loc must be .* = \(3,\), got shape \(2,\)"),
        (good_i, Tensor([0, 1, 3], torch.int32, dev=1), ValueError, "query_start_loc must be on CUDA device 0"),
        (Tensor([2, 0], torch.int32, cuda=False), good_q, TypeError, "idx_mapping must be a CUDA array"),
    ):
        n = len(fake.launches)
        with pytest.raises(exc, match=message):
            pl.compute(i, q, *(d[k] for k in STATE), 4, stream=9)
        with pytest.raises(exc, match=message):
            bound.launch(i, q, 4, stream=9)
        assert len(fake.launches) == n
    strided = Tensor([2, 9, 0, 9], torch.int32)
    strided.a = strided.a[::2]
    with pytest.raises(ValueError, match="idx_mapping must be contiguous"):
        bound.launch(strided, good_q, 4, stream=9)
