"""A fake CuPy under which kvaddr/dsa.py's host code runs whole on the CPU: arrays are NumPy
arrays dressed as CuPy ones (tests/support/vllm_fake_cupy.py's FakeArray), and each launch of
``dsa_topk_slots`` / ``kvaddr_dsa_topk_baseline`` runs in the CPU emulator of kernels/dsa.cuh
(tests/support/dsa_emulator.py) on the parameters the launch passed."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np

from kvaddr import kernel_loader
from tests.support import dsa_emulator
from tests.support.vllm_fake_cupy import FakeArray


class DsaFakeArray(FakeArray):
    """A FakeArray that also takes item assignment (``errors[:, 0] = 0``)."""

    def __setitem__(self, k, v):
        self.a[k] = v

    def __getitem__(self, k):
        return DsaFakeArray(self.a[k], self.dev)

    def reshape(self, shape):
        r = self.a.reshape(shape)
        assert np.shares_memory(r, self.a) or r.size == 0
        return DsaFakeArray(r, self.dev)


DsaFakeArray.__module__ = "cupy._core.core"  # described as a CuPy array


def on_fake(a) -> DsaFakeArray:
    """A NumPy array as a fake device array (the same memory)."""
    return DsaFakeArray(a)


class _Stream:
    ptr = 0

    def synchronize(self):
        pass

    def __enter__(self):  # `with stream:` makes it current (nothing to do here)
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def from_external(obj):
        return _Stream()


class _Dev:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install(monkeypatch) -> list:
    """Install the fake CuPy and the emulated launches; returns the list of launched kernel names."""
    from kvaddr.dsa import DsaTopkParams

    launched: list = []
    names: dict = {}

    def launch(fptr, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        arg0 = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        size = ctypes.sizeof(DsaTopkParams)
        buf = ctypes.create_string_buffer(size)
        ctypes.memmove(buf, arg0, size)
        launched.append((names[fptr], (gx, gy), bx))
        dsa_emulator.run(names[fptr], ctypes.addressof(buf), gx, gy)

    stream = _Stream()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=_Dev,
        Stream=_Stream,
        get_current_stream=lambda: stream,
        driver=types.SimpleNamespace(launchKernel=launch),
    )
    cupy.empty = lambda shape, dtype: DsaFakeArray(np.full(shape, 0x5A5A5A5A, dtype))
    cupy.full = lambda shape, v, dtype: DsaFakeArray(np.full(shape, v, dtype))
    cupy.asarray = lambda a, dtype=None: a if isinstance(a, FakeArray) else DsaFakeArray(np.array(a, dtype=dtype))
    cupy.int32 = np.int32
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)

    def fn(name, device_id=None):
        ptr = 7000 + len(names)
        names[ptr] = name
        return types.SimpleNamespace(ptr=ptr)

    monkeypatch.setattr(kernel_loader, "get_function", fn)
    monkeypatch.setattr(kernel_loader, "load_kernels", lambda ks, device_id=None: {k: fn(k) for k in ks})
    return launched
