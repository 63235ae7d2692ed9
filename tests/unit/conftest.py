"""Fixtures of the unit tests."""

from tests.support.fake_cupy import fake_gpu  # noqa: F401  (a fixture: the fake CuPy of the GPU-flow tests)
