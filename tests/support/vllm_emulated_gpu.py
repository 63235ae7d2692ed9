"""The fake GPU of the profiler's tests (``fake_gpu``, tests/support/fake_cupy.py) with the vLLM
kernels emulated on the CPU (tests/support/vllm_emulator.py): ``emulated_gpu``, a pytest fixture under
which :class:`~kvaddr.engines.vllm.VllmStepPlanner` and
:class:`~kvaddr.strategies.vllm_three_launch.VllmThreeLaunch` run their real host code and
launches, so the vLLM engine profile (and ``kvaddr profile --engine vllm``) runs end to end.

Tests using it skip when there is no C++ compiler (``vllm_emulator.CXX is None``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvaddr import kernel_loader
from tests.support import vllm_emulator
from tests.support.fake_cupy import FakeStream
from tests.support.vllm_fake_cupy import FakeArray


@pytest.fixture
def emulated_gpu(fake_gpu, monkeypatch):
    import sys
    import types

    from kvaddr.engines.vllm import VllmStepParams

    cp = sys.modules["cupy"]
    names: dict = {}
    default = FakeStream()

    def launch(fptr, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        arg0 = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        size = ctypes.sizeof(VllmStepParams)
        buf = ctypes.create_string_buffer(size)  # the driver copies the parameters at the launch
        ctypes.memmove(buf, arg0, size)
        name = names[fptr]

        def work():
            vllm_emulator.run(name, ctypes.addressof(buf), gx, gy)

        s = FakeStream.current
        if s is not None and s.ptr == stream:
            s.launch(work)
        else:
            work()

    cp.cuda.driver = types.SimpleNamespace(launchKernel=launch)
    cp.cuda.get_current_stream = lambda: FakeStream.current or default
    cp.zeros = lambda shape, dtype: FakeArray(np.zeros(shape, dtype))
    cp.full = lambda shape, v, dtype: FakeArray(np.full(shape, v, dtype))
    cp.asarray = lambda a: FakeArray(np.array(a))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    monkeypatch.setattr(FakeStream, "from_external", staticmethod(lambda obj: default), raising=False)

    class Fn:
        def __init__(self, name):
            self.name = name
            self.ptr = 5000 + len(names)
            names[self.ptr] = name

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            stream.launch(lambda: None)

    monkeypatch.setattr(kernel_loader, "get_function", lambda name, device_id=None: Fn(name))
    monkeypatch.setattr(kernel_loader, "load_kernels", lambda ks, device_id=None: {k: Fn(k) for k in ks})
    return names
