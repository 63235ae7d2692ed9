"""``validation.CUPY_VECTOR_SIGNATURE`` on real CuPy arrays: the memo signatures read CuPy's
``_shape``/``_strides`` lists instead of the ``shape``/``strides`` tuples. The values must be the
same (list against tuple) for every layout, and the memoised paths of both planners must still see
CuPy's shape setter (the in-place change the memo guards against), with the reference's outputs
after it. Skips without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import validation
from tests.support.gpu import requires_gpu

pytestmark = requires_gpu


@pytest.fixture
def vectors(monkeypatch):
    monkeypatch.setattr(validation, "CUPY_VECTOR_SIGNATURE", True)


def _layouts():
    import cupy

    base = cupy.arange(96, dtype=cupy.int32)
    m = base.reshape(8, 12)
    return {
        "1-D": base,
        "1-D strided": base[::3],
        "2-D": m,
        "2-D row view": m[:, :5],
        "2-D transposed": m.T,
        "empty": cupy.zeros((0, 4), dtype=cupy.int32),
        "int64": cupy.zeros(5, dtype=cupy.int64),
    }


@pytest.mark.parametrize("name", ["1-D", "1-D strided", "2-D", "2-D row view", "2-D transposed", "empty", "int64"])
def test_the_vector_signature_equals_the_tuple_signature(vectors, name):
    a = _layouts()[name]
    if not validation._has_vectors(a):  # (then the flag changes nothing: the tuples are read)
        assert validation.signature_getter([a]) is validation._cupy_signature
        pytest.skip("this CuPy's _shape/_strides do not read as lists: CUPY_VECTOR_SIGNATURE falls back")
    assert validation.signature_getter([a]) is validation._cupy_signature_vectors
    v, t = validation._cupy_signature_vectors(a), validation._cupy_signature(a)
    assert (v[0], v[1], tuple(v[2]), tuple(v[3]), v[4]) == t
    same = validation.memo_guard((a,))
    assert same(a)
    if a.ndim == 2 and a.flags.c_contiguous and a.size:
        a.shape = (a.shape[1], a.shape[0])  # CuPy's shape setter: same object, same memory
        assert not same(a)


def test_core_planner_sees_the_shape_setter(vectors):
    from tests.gpu import test_compute_memo_gpu

    test_compute_memo_gpu.test_cupy_shape_set_in_place_is_seen()


def test_vllm_planner_sees_the_shape_setter(vectors, monkeypatch):
    from kvaddr.engines import vllm as vllm_module
    from tests.gpu import test_vllm_memo

    names: list = []
    real = vllm_module.describe

    def describe(name, x):
        if not name.startswith("out."):
            names.append(name)
        return real(name, x)

    monkeypatch.setattr(vllm_module, "describe", describe)
    test_vllm_memo.test_cupy_changes_in_place_are_checked(names)


def test_the_planners_memo_uses_the_vector_signature(vectors):
    import cupy

    from kvaddr import StepPlanner

    planner = StepPlanner(64, 4096, [16])
    rng = np.random.default_rng(3)
    dec = cupy.asarray(rng.integers(0, 100, 8).astype(np.int32))
    q = cupy.ones(8, dtype=cupy.int32)
    table = cupy.asarray(rng.integers(0, 1000, (8, 16)).astype(np.int32))
    planner.compute(dec, q, table)
    planner.compute(dec, q, table)  # the same objects again: the memo is made
    same = planner._memo.same
    if not validation._has_vectors(table):
        pytest.skip("this CuPy's _shape/_strides do not read as lists: CUPY_VECTOR_SIGNATURE falls back")
    assert "_shape" in same.__code__.co_names and "shape" not in same.__code__.co_names
