"""StepPlanner.compute()'s memo of checked inputs, on the CPU (fake CuPy, launches recorded).

compute() skips its checks when it gets the same argument objects as the last checked call
and each array's signature (pointer, device, shape, strides, dtype) is unchanged. These
tests change each part of the signature in place after a memoised call and prove the full
checks run again: a bad change raises the same error as on a first call, a good one is
launched with the new pointer, stride, width or bsz.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import planner as planner_module
from kvaddr import validation as validation_module
from kvaddr.validation import signature_getter
from tests.support.fake_cupy import FakeDeviceArray, install_planner_fake

BSZ, WIDTH = 3, 4


@pytest.fixture
def fake(monkeypatch):
    ns = install_planner_fake(monkeypatch)
    described = []
    real = planner_module.describe
    counting = lambda name, x: described.append(name) or real(name, x)  # noqa: E731
    # the planner describes its batch arrays; validation.write_tables its block tables
    monkeypatch.setattr(planner_module, "describe", counting)
    monkeypatch.setattr(validation_module, "describe", counting)
    ns.described = described
    return ns


def _planner(block_sizes=(4, 2), **kw):
    return planner_module.StepPlanner(8, 16, list(block_sizes), **kw)


def _inputs(fake, bsz=BSZ, width=WIDTH):
    dec = fake.array(np.arange(bsz) + 1)
    q = fake.array(np.ones(bsz))
    table = fake.array(np.arange(bsz * width).reshape(bsz, width))
    return dec, q, table


def _last(fake):
    return fake.launches[-1]


def test_the_same_inputs_are_checked_once_and_launched_every_time(fake):
    p = _planner()
    dec, q, table = _inputs(fake)
    p.compute(dec, q, table, stream=9)
    assert len(fake.described) == 3 and p._memo is None  # no memo for a call's first objects
    p.compute(dec, q, table, stream=9)  # the same objects again: checked, and the memo is made
    checked = len(fake.described)
    assert checked == 6 and p._memo is not None
    out = [p.compute(dec, q, table, stream=9) for _ in range(3)]
    assert len(fake.described) == checked, "a memoised call described an input again"
    assert len(fake.launches) == 5 and all(o is out[0] for o in out)
    first, last = fake.launches[0], fake.launches[-1]
    assert (first["grid"], first["block"], first["stream"]) == (last["grid"], last["block"], last["stream"])
    assert bytes(first["params"]) == bytes(last["params"])
    assert last["params"].seq_lens_decoder == dec.data.ptr and last["params"].bsz == BSZ


def test_memoize_checks_false_checks_every_call(fake):
    p = _planner()
    p.memoize_checks = False
    dec, q, table = _inputs(fake)
    for _ in range(3):
        p.compute(dec, q, table, stream=9)
    assert len(fake.described) == 9 and p._memo is None


@pytest.mark.parametrize("which", ["dec", "q", "table"])
def test_a_new_pointer_is_seen(fake, which):
    p = _planner()
    arrays = dict(zip(("dec", "q", "table"), _inputs(fake)))
    p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)
    x = arrays[which]
    x.a = x.a.copy()  # same object, same metadata, new memory
    p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)
    P = _last(fake)["params"]
    got = {"dec": P.seq_lens_decoder, "q": P.seq_lens_this_time, "table": P.block_tables[0]}[which]
    assert got == x.data.ptr
    assert len(fake.described) == 6


def test_a_new_bsz_is_seen_and_launched(fake):
    p = _planner()
    dec, q, table = _inputs(fake, bsz=3)
    p.compute(dec, q, table, stream=9)
    dec.a, q.a = np.arange(2, dtype=np.int32), np.ones(2, np.int32)  # a CuPy shape change in place
    out = p.compute(dec, q, table, stream=9)
    assert _last(fake)["params"].bsz == 2 and out.seq_lens_kv.shape == (2,)


def test_bsz_beyond_max_requests_is_refused_after_a_memoised_call(fake):
    p = _planner()
    dec, q, table = _inputs(fake)
    p.compute(dec, q, table, stream=9)
    dec.a, q.a = np.zeros(9, np.int32), np.zeros(9, np.int32)
    table.a = np.zeros((9, WIDTH), np.int32)
    with pytest.raises(ValueError, match="seq_lens_decoder must have at most max_requests = 8 entries, got 9"):
        p.compute(dec, q, table, stream=9)


@pytest.mark.parametrize(
    "which, change, exc, message",
    [
        ("dec", lambda a: a.astype(np.int64), TypeError, "seq_lens_decoder must be int32 with shape"),
        ("q", lambda a: a.astype(np.uint32), TypeError, "seq_lens_this_time must be int32 with shape"),
        ("table", lambda a: a.astype(np.int64), TypeError, "block_tables must be int32"),
        ("dec", lambda a: a.reshape(1, -1), ValueError, r"seq_lens_decoder must be int32 with shape \(bsz,\)"),
        ("q", lambda a: a[:2], ValueError, r"seq_lens_this_time must have shape \(bsz,\) = \(3,\)"),
        ("dec", lambda a: np.repeat(a, 2)[::2], ValueError, "seq_lens_decoder must be contiguous"),
        ("table", lambda a: np.ascontiguousarray(a.T).T, ValueError, "got a last-dim stride of 3 elements"),
        ("table", lambda a: a[:2], ValueError, "got 2 rows for bsz = 3"),
        ("table", lambda a: a.ravel(), ValueError, "block_tables must be int32 with shape"),
        ("table", lambda a: a[:, :0], ValueError, "got max_blocks = 0"),
    ],
)
def test_a_bad_change_in_place_raises_as_on_a_first_call(fake, which, change, exc, message):
    p = _planner()
    arrays = dict(zip(("dec", "q", "table"), _inputs(fake)))
    p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)
    p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)  # memoised
    x = arrays[which]
    x.a = change(x.a)
    n = len(fake.launches)
    with pytest.raises(exc, match=message):
        p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)
    assert len(fake.launches) == n, "launched after a failed check"
    with pytest.raises(exc, match=message):  # and again: a failed check memoises nothing
        p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)


def test_a_new_row_stride_is_seen(fake):
    p = _planner()
    dec, q, table = _inputs(fake)
    p.compute(dec, q, table, stream=9)
    wide = np.zeros((BSZ, 10), np.int32)
    table.a = wide[:, :WIDTH]  # same width, row stride 10
    p.compute(dec, q, table, stream=9)
    P = _last(fake)["params"]
    assert list(P.table_stride)[:2] == [10, 10] and list(P.max_blocks)[:2] == [WIDTH, WIDTH]
    table.a = np.zeros((BSZ, 6), np.int32)  # a new width
    p.compute(dec, q, table, stream=9)
    assert list(_last(fake)["params"].max_blocks)[:2] == [6, 6]


@pytest.mark.parametrize("which", ["dec", "q", "table"])
def test_a_new_device_is_seen(fake, which):
    p = _planner()
    arrays = dict(zip(("dec", "q", "table"), _inputs(fake)))
    p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)
    arrays[which].dev = 1
    with pytest.raises(ValueError, match="must be on CUDA device 0, got an array in device 1"):
        p.compute(arrays["dec"], arrays["q"], arrays["table"], stream=9)


def test_other_objects_are_checked(fake):
    p = _planner()
    dec, q, table = _inputs(fake)
    p.compute(dec, q, table, stream=9)
    other = FakeDeviceArray(table.a.copy())  # equal contents and metadata, another object
    p.compute(dec, q, other, stream=9)
    assert len(fake.described) == 6 and _last(fake)["params"].block_tables[0] == other.data.ptr
    enc = fake.array(np.zeros(BSZ))
    p.compute(dec, q, other, seq_lens_encoder=enc, stream=9)
    assert len(fake.described) == 10
    enc.a = np.zeros(BSZ + 1, np.int32)
    with pytest.raises(ValueError, match=r"seq_lens_encoder must have shape \(bsz,\) = \(3,\)"):
        p.compute(dec, q, other, seq_lens_encoder=enc, stream=9)


def test_a_table_list_changed_in_place_is_seen(fake):
    p = _planner()
    dec, q, t0 = _inputs(fake)
    t1 = fake.array(np.zeros((BSZ, 5)))
    tables = [t0, t1]
    p.compute(dec, q, tables, stream=9)
    p.compute(dec, q, tables, stream=9)
    p.compute(dec, q, tables, stream=9)
    assert len(fake.described) == 8 and p._memo is not None  # (memoised by the second call)
    t2 = fake.array(np.zeros((BSZ, 7)))
    tables[1] = t2  # the same list object, another table
    p.compute(dec, q, tables, stream=9)
    P = _last(fake)["params"]
    assert P.block_tables[1] == t2.data.ptr and P.max_blocks[1] == 7
    tables.append(t2)
    with pytest.raises(ValueError, match="sequence of 2 .one per cache., got a sequence of 3"):
        p.compute(dec, q, tables, stream=9)
    tables[:] = [t0, fake.array(np.zeros((BSZ, 5)), dtype=np.int64)]
    with pytest.raises(TypeError, match=r"block_tables\[1\] must be int32"):
        p.compute(dec, q, tables, stream=9)


def test_a_failed_check_forgets_the_memo_and_launch_args_rewrites_it(fake):
    p = _planner()
    dec, q, table = _inputs(fake)
    p.compute(dec, q, table, stream=9)
    d2, q2, t2 = _inputs(fake, bsz=2)
    p.launch_args(d2, q2, t2)  # rewrites the parameter struct for other inputs
    p.compute(dec, q, table, stream=9)  # so these are checked and written again
    P = _last(fake)["params"]
    assert (P.seq_lens_decoder, P.bsz, P.block_tables[0]) == (dec.data.ptr, BSZ, table.data.ptr)
    assert len(fake.described) == 9
    with pytest.raises(ValueError):
        p.compute(dec, q2, table, stream=9)
    assert p._memo is None


def test_streams(fake):
    p = _planner()
    dec, q, table = _inputs(fake)

    class TorchLikeStream:
        def __init__(self, h):
            self.cuda_stream = h

    s1, s2 = TorchLikeStream(0x77), TorchLikeStream(0x78)
    for s, want in ((s1, 0x77), (s1, 0x77), (s2, 0x78), (12, 12), (s1, 0x77)):
        p.compute(dec, q, table, stream=s)
        assert _last(fake)["stream"] == want
    s1.cuda_stream = 0x79  # an object of unknown kind may change its handle: not remembered
    p.compute(dec, q, table, stream=s1)
    assert _last(fake)["stream"] == 0x79

    class CupyLikeStream:
        def __init__(self, ptr):
            self.ptr = ptr

    CupyLikeStream.__module__ = "cupy.cuda.stream"
    c = CupyLikeStream(0x80)
    p.compute(dec, q, table, stream=c)
    assert p._stream._obj is c and p._stream._ptr == 0x80
    p.compute(dec, q, table, stream=c)
    assert _last(fake)["stream"] == 0x80
    p.compute(dec, q, table)  # None: CuPy's current stream, looked up at each call
    assert _last(fake)["stream"] == 0x51
    fake.current.ptr = 0x52
    p.compute(dec, q, table)
    assert _last(fake)["stream"] == 0x52
    with pytest.raises(TypeError, match="stream must be"):
        p.compute(dec, q, table, stream="s")


def test_page_table_outputs_follow_the_memoised_tables(fake):
    p = _planner(block_sizes=(4,), attention="page_table")
    dec, q, table = _inputs(fake)
    out = p.compute(dec, q, table, stream=9)
    first = out.attention.page_table
    bound = p.bind(*_inputs(fake), stream=9)
    bound.launch(2)  # a binding's launch sets the page table to its own tables
    out = p.compute(dec, q, table, stream=9)  # memoised: the page table is this call's again
    assert out.attention.page_table[0].a.ctypes.data == first[0].a.ctypes.data
    assert out.attention.page_table[0].shape == (BSZ, WIDTH)


def test_positions_only_planner(fake):
    p = _planner(block_sizes=())
    dec, q, _ = _inputs(fake)
    p.compute(dec, q, stream=9)
    p.compute(dec, q, stream=9)
    p.compute(dec, q, stream=9)
    assert len(fake.described) == 4 and p._memo is not None
    dec.a = np.zeros(BSZ, np.int64)
    with pytest.raises(TypeError, match="seq_lens_decoder must be int32"):
        p.compute(dec, q, stream=9)


def test_objects_without_a_cheap_signature_are_not_memoised(fake):
    class Cai:
        def __init__(self, a):
            self.a = a
            self.__cuda_array_interface__ = dict(
                shape=a.shape, typestr=a.dtype.str, data=(a.ctypes.data, False), strides=None, version=3
            )

    import sys

    sys.modules["cupy"].cuda.runtime.pointerGetAttributes = lambda ptr: type("A", (), dict(type=2, device=0))()
    sys.modules["cupy"].cuda.runtime.memoryTypeDevice = 2
    p = _planner()
    dec, q, table = _inputs(fake)
    cai = Cai(table.a)
    p.compute(dec, q, cai, stream=9)
    assert p._memo is None
    p.compute(dec, q, cai, stream=9)
    assert len(fake.described) == 6


def test_signature_getter_kinds():
    a = FakeDeviceArray(np.zeros(3, np.int32))
    assert signature_getter([a, a]) is not None
    assert signature_getter([a, object()]) is None
    sig = signature_getter([a])
    before = sig(a)
    a.a = a.a.astype(np.int64)
    assert sig(a) != before


def test_torch_tensors_changed_in_place_are_seen(fake, monkeypatch):
    torch = pytest.importorskip("torch")
    from kvaddr import validation

    def describe(name, x):  # CPU tensors pose as device 0's
        return validation._torch_info(x)._replace(device=0)

    counting = lambda name, x: fake.described.append(name) or describe(name, x)  # noqa: E731
    monkeypatch.setattr(planner_module, "describe", counting)
    monkeypatch.setattr(validation_module, "describe", counting)
    monkeypatch.setattr(validation, "_torch_signature", lambda x: (x.data_ptr(), 0, x.shape, x.stride(), x.dtype))
    p = _planner()
    dec = torch.arange(BSZ, dtype=torch.int32)
    q = torch.ones(BSZ, dtype=torch.int32)
    table = torch.zeros(BSZ, WIDTH, dtype=torch.int32)
    p.compute(dec, q, table, stream=9)
    p.compute(dec, q, table, stream=9)  # the same objects again: checked, and the memo is made
    p.compute(dec, q, table, stream=9)  # the memo's hit
    assert len(fake.described) == 6 and p._memo is not None
    table.resize_(BSZ - 1, WIDTH)
    with pytest.raises(ValueError, match="got 2 rows for bsz = 3"):
        p.compute(dec, q, table, stream=9)
    table.resize_(BSZ, WIDTH)
    p.compute(dec, q, table, stream=9)
    table.as_strided_((BSZ, WIDTH), (1, BSZ))
    with pytest.raises(ValueError, match="last-dim stride of 3 elements"):
        p.compute(dec, q, table, stream=9)
    table.as_strided_((BSZ, WIDTH), (WIDTH, 1))
    p.compute(dec, q, table, stream=9)
    other = torch.zeros(BSZ + 2, dtype=torch.int32)
    dec.set_(other)
    with pytest.raises(ValueError, match=r"seq_lens_this_time must have shape \(bsz,\) = \(5,\)"):
        p.compute(dec, q, table, stream=9)
    dec.set_(torch.zeros(BSZ, dtype=torch.int32))
    p.compute(dec, q, table, stream=9)
    assert _last(fake)["params"].seq_lens_decoder == dec.data_ptr()


def test_one_table_object_for_both_caches_changed_in_place_is_seen(fake):
    """The same table in the list for both caches: its signature is read once per call, and
    a change in place (a new row count, width, stride or pointer) takes the checked path."""
    p = _planner()
    dec, q, t = _inputs(fake)
    tables = [t, t]
    p.compute(dec, q, tables, stream=9)
    p.compute(dec, q, tables, stream=9)
    p.compute(dec, q, tables, stream=9)
    assert len(fake.described) == 6 and p._memo is not None  # (the checks describe one object once too)
    good = t.a
    t.a = good[:2]  # fewer rows than bsz (a resize_ in place)
    with pytest.raises(ValueError, match=r"block_tables must .* got 2 rows for bsz = 3"):
        p.compute(dec, q, tables, stream=9)
    t.a = np.zeros((BSZ, 6), np.int32)  # wider, new pointer
    p.compute(dec, q, tables, stream=9)
    P = _last(fake)["params"]
    assert list(P.block_tables[:2]) == [t.data.ptr] * 2 and list(P.max_blocks[:2]) == [6, 6]
    n = len(fake.described)
    p.compute(dec, q, tables, stream=9)
    assert len(fake.described) == n  # memoised again
    t.a = np.zeros((2 * BSZ, 6), np.int32)[::2]  # same shape, twice the row stride
    p.compute(dec, q, tables, stream=9)
    assert len(fake.described) > n and list(_last(fake)["params"].table_stride[:2]) == [12, 12]


def test_no_guard_for_new_objects_every_call_and_one_when_they_repeat(fake, monkeypatch):
    """An engine passing new dec / q objects every step never gets a guard built (it could never
    hit); the second checked call with the same objects builds it, and later calls use it."""
    from kvaddr import planner as planner_module

    built = []
    real = planner_module.memo_guard
    monkeypatch.setattr(planner_module, "memo_guard", lambda *a: built.append(a) or real(*a))
    p = _planner()
    dec, q, table = _inputs(fake)
    for _ in range(4):
        d2, q2, _ = _inputs(fake)
        p.compute(d2, q2, table, stream=9)
        assert _last(fake)["params"].seq_lens_decoder == d2.data.ptr
    assert built == [] and p._memo is None
    p.compute(dec, q, table, stream=9)
    assert built == []
    p.compute(dec, q, table, stream=9)
    assert len(built) == 1 and p._memo is not None
    n = len(fake.described)
    p.compute(dec, q, [table, table], stream=9)  # a list of the same table: another argument pattern
    p.compute(dec, q, table, stream=9)
    assert len(fake.described) == n + 2 * 3 and len(built) == 1
    p.compute(dec, q, table, stream=9)  # repeats the call before: guard built, then used
    p.compute(dec, q, table, stream=9)
    assert len(fake.described) == n + 3 * 3 and len(built) == 2
    dec.a = dec.a.copy()  # a signature changed in place: checked again, the guard rebuilt
    p.compute(dec, q, table, stream=9)
    assert len(fake.described) == n + 4 * 3 and len(built) == 3
    assert _last(fake)["params"].seq_lens_decoder == dec.data.ptr
