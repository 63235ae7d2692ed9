"""validation.memo_guard: the one test both planners' memoised fast paths make per call.

The guard is a generated expression (identity tests, then one tuple of every distinct array's
signature compared with the one read when the memo was made). Each test here makes a guard,
changes ONE remembered value (an argument object, an item of a list, one field of one array's
signature) and expects False; the unchanged call expects True. The planners' own memo tests
(test_compute_memo.py, test_vllm_compute_memo.py) prove the checked path then runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import validation
from kvaddr.validation import memo_guard
from tests.support.fake_cupy import FakeDeviceArray
from tests.support.vllm_fake_cupy import FakeArray  # CuPy-like without MemoryPointer.device_id


class Tensor:
    """A CPU stand-in for a torch tensor (the class describe() and signature_getter take for
    torch's): data_ptr(), get_device(), shape, stride(), dtype, changed in place through ``a``."""

    def __init__(self, a, dev=0):
        self.a, self.dev = a, dev

    def data_ptr(self):
        return self.a.ctypes.data

    def get_device(self):
        return self.dev

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)


Tensor.__module__ = "torch"


class VecArray(FakeDeviceArray):
    """CuPy-like with CuPy's public ``_shape``/``_strides`` (lists, as CuPy's vectors read), for the
    vector signature (``validation.CUPY_VECTOR_SIGNATURE``, on in this file)."""

    _shape = property(lambda self: list(self.a.shape))
    _strides = property(lambda self: list(self.a.strides))


VecArray.__module__ = "cupy._core.core"
KINDS = [FakeDeviceArray, FakeArray, Tensor, VecArray]


@pytest.fixture(autouse=True)
def vector_signature(monkeypatch):
    """Every guard here is made with the vector signature on: VecArray takes it, the others cannot."""
    monkeypatch.setattr(validation, "CUPY_VECTOR_SIGNATURE", True)


def test_the_vector_signature_is_taken_only_when_on_and_available(monkeypatch):
    v, f = _vec(VecArray), _vec(FakeDeviceArray)
    assert validation.signature_getter([v]) is validation._cupy_signature_vectors
    assert validation.signature_getter([f]) is validation._cupy_signature  # no _shape: the tuples
    sv, st = validation._cupy_signature_vectors(v), validation._cupy_signature(v)
    assert sv[:2] == st[:2] and sv[4] == st[4] and tuple(sv[2]) == st[2] and tuple(sv[3]) == st[3]
    monkeypatch.setattr(validation, "CUPY_VECTOR_SIGNATURE", False)
    assert validation.signature_getter([v]) is validation._cupy_signature


def test_the_vector_signature_reads_no_tuple():
    reads = []

    class Counted(VecArray):
        shape = property(lambda self: reads.append("shape") or self.a.shape)
        strides = property(lambda self: reads.append("strides") or self.a.strides)

    Counted.__module__ = "cupy._core.core"
    a, t = Counted(np.zeros(4, np.int32)), Counted(np.zeros((4, 3), np.int32))
    same = memo_guard((a, [t]))
    reads.clear()
    assert same(a, [t])
    assert reads == []
    t.a = np.zeros((3, 4), np.int32)  # the CuPy shape setter's kind of change: same size, new shape
    assert not same(a, [t])


def _vec(kind, n=4):
    return kind(np.arange(2 * n, dtype=np.int32)[:n])  # (room for a view with twice the stride)


def _mat(kind, rows=4, cols=3):
    return kind(np.zeros((2 * rows, cols), np.int32)[:rows])


def _twice_the_stride(a):
    return np.lib.stride_tricks.as_strided(a, a.shape, (2 * a.strides[0], *a.strides[1:]))


#: Each changes exactly one field of an array's signature.
CHANGES = {
    "pointer": lambda x: x.a.copy(),
    "shape": lambda x: x.a[:-1],
    "strides": lambda x: _twice_the_stride(x.a),
    "dtype": lambda x: x.a.view(np.float32),
}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("field", [*CHANGES, "device"])
@pytest.mark.parametrize("which", range(5))
def test_each_signature_field_of_each_array(kind, field, which):
    """vLLM's argument pattern with two groups: three arrays, a list of two tables, a list of two counts."""
    idx, qsl, nct = _vec(kind), _vec(kind, 5), _vec(kind)
    tables, nbs = [_mat(kind), _mat(kind, cols=5)], [_vec(kind), _vec(kind)]
    args = (idx, qsl, nct, tables, nbs)
    same = memo_guard(args, [idx, qsl, nct, *tables, *nbs])
    assert same(*args)
    x = [idx, qsl, nct, tables[1], nbs[0]][which]
    before = validation.signature_getter([x])(x)
    if field == "device":
        x.dev = 1
    else:
        x.a = CHANGES[field](x)
    after = validation.signature_getter([x])(x)
    assert sum(u != v for u, v in zip(before, after)) == 1  # one field changed
    assert not same(*args)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_one_table_object_for_two_groups_resized_in_place(kind):
    """The same table passed for both groups: its signature is read once, and still read."""
    idx, qsl, nct, nb = _vec(kind), _vec(kind, 5), _vec(kind), _vec(kind)
    t = _mat(kind)
    args = (idx, qsl, nct, [t, t], [nb, nb])
    same = memo_guard(args, [idx, qsl, nct, t, t, nb, nb])
    assert same(*args) and same(idx, qsl, nct, (t, t), [nb, nb])
    t.a = np.zeros((8, 3), np.int32)  # resize_ in place: same object, new pointer and shape
    assert not same(*args)
    t.a = np.zeros((4, 3), np.int32)[:, :3]
    assert not same(*args)  # (a new pointer again)


def test_distinct_arrays_are_read_once():
    reads = []

    class Counted(FakeDeviceArray):
        @property
        def data(self):
            reads.append(self)
            return super().data

    Counted.__module__ = "cupy._core.core"
    idx, qsl, nct, nb, t = (Counted(np.zeros(4, np.int32)) for _ in range(5))
    args = (idx, qsl, nct, [t, t], nb)
    same = memo_guard(args, [idx, qsl, nct, t, t, nb])
    reads.clear()
    assert same(*args)
    assert len(reads) == 5 and len({id(r) for r in reads}) == 5


def test_argument_identity_and_sequences():
    a, b, t0, t1 = (_vec(FakeDeviceArray) for _ in range(4))
    tables = [t0, t1]
    same = memo_guard((a, b, tables, None), [a, b, t0, t1])
    assert same(a, b, tables, None)
    assert same(a, b, [t0, t1], None) and same(a, b, (t0, t1), None)  # another list, the same items
    assert not same(b, a, tables, None)  # the same arrays in other places
    assert not same(a, b, tables, a)  # a new seq_lens_encoder
    assert not same(a, b, [t1, t0], None)
    assert not same(a, b, [t0], None) and not same(a, b, [t0, t1, t1], None)
    assert not same(a, b, t0, None)  # an array where a list was

    class Tables(list):
        pass

    assert not same(a, b, Tables(tables), None)  # a subclass may iterate otherwise
    tables[1] = _vec(FakeDeviceArray)  # the list changed in place
    assert not same(a, b, tables, None)
    # an array remembered by identity is not taken for a list of it
    one = memo_guard((a, b, t0, None), [a, b, t0])
    assert one(a, b, t0, None) and not one(a, b, [t0], None) and not one(a, b, t1, None)


def test_no_guard_for_subclasses_mixed_kinds_and_other_objects():
    a, t = _vec(FakeDeviceArray), _mat(FakeDeviceArray)

    class Tables(list):
        pass

    assert memo_guard((a, a, Tables([t]), None), [a, a, t]) is None
    assert memo_guard((a, a, t, None), [a, a, _mat(Tensor)]) is None  # CuPy and torch mixed
    cai = type("Cai", (), {"__cuda_array_interface__": {}})()
    assert memo_guard((a, a, cai, None), [a, a, cai]) is None


def test_guard_code_is_compiled_once_per_pattern(monkeypatch):
    compiled = []
    real = compile
    monkeypatch.setattr(validation, "compile", lambda *a: compiled.append(a[1]) or real(*a), raising=False)
    monkeypatch.setattr(validation, "_GUARD_FACTORIES", {})
    for _ in range(3):
        a, b, t = _vec(FakeDeviceArray), _vec(FakeDeviceArray), _mat(FakeDeviceArray)
        assert memo_guard((a, b, [t, t], None), [a, b, t, t])(a, b, [t, t], None)
    assert len(compiled) == 1
    memo_guard((a, b, [t], None), [a, b, t])
    assert len(compiled) == 2


def test_the_guard_keeps_its_objects_alive():
    import gc
    import weakref

    a, t = _vec(FakeDeviceArray), _mat(FakeDeviceArray)
    same = memo_guard((a, [t]), [a, t])
    refs = weakref.ref(a), weakref.ref(t)
    del a, t
    gc.collect()
    assert all(r() is not None for r in refs)  # their ids cannot be reused while the memo lives
    del same
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_getter_without_inline_source_is_called(monkeypatch):
    """A signature getter put in place of the known ones (as a test does for CPU tensors posing
    as CUDA ones) is called per array by the generated guard, with the same semantics."""
    monkeypatch.setattr(validation, "_GUARD_FACTORIES", {})
    monkeypatch.setattr(validation, "_torch_signature", lambda x: (x.data_ptr(), 0, x.shape, x.stride(), x.dtype))
    a, t = _vec(Tensor), _mat(Tensor)
    same = memo_guard((a, [t, t]), [a, t, t])
    assert same(a, [t, t]) and not same(t, [t, t])
    t.a = t.a[:-1]
    assert not same(a, [t, t])


def test_repeats_compares_objects_and_sequence_items():
    """validation.repeats: when a checked call's arguments are the objects of the checked call before
    (the planners then build the memo guard)."""
    from kvaddr.validation import repeats

    a, b, t0, t1 = (_vec(FakeDeviceArray) for _ in range(4))
    tables = [t0, t1]
    last = (a, b, tables, None)
    assert not repeats(last, None)  # no call before
    assert repeats((a, b, tables, None), last)
    assert repeats((a, b, [t0, t1], None), last) and repeats((a, b, (t0, t1), None), last)  # by items
    assert not repeats((b, b, tables, None), last)  # a new first object
    assert not repeats((a, a, tables, None), last)
    assert not repeats((a, b, [t1, t0], None), last) and not repeats((a, b, [t0], None), last)
    assert not repeats((a, b, tables, a), last)  # a new seq_lens_encoder
    assert not repeats((a, b, t0, None), last) and not repeats((a, b, tables), last)

    class Tables(list):
        pass

    assert not repeats((a, b, Tables(tables), None), last)  # (a subclass: never memoised anyway)
    assert repeats((a, b, Tables(tables), None), (a, b, Tables(tables), None)) is False
