"""A CUDA launch faked for the torch ops' CUDA kernels on the CPU (tests/unit/test_torch_*.py).

``fake_cuda_launch`` is a pytest fixture: import it into a test module (``# noqa: F401``) and
name it as an argument. The ops' CUDA kernels then run on CPU tensors, ``describe()`` taking
them as device 0's, and every ``cuLaunchKernel`` call is recorded instead of made (its function
pointer is ``tests.support.fake_cupy.function_ptr`` of the kernel the dispatch table chose).
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from tests.support.fake_cupy import function_ptr


@pytest.fixture
def fake_cuda_launch(monkeypatch):
    """Run the CUDA kernels on CPU tensors: describe() takes them as device 0's, launches are recorded."""
    import torch

    from kvaddr import bound_step, validation
    from kvaddr.torch import ops

    calls = []
    driver = types.SimpleNamespace(launchKernel=lambda *a: calls.append(a))
    cuda = types.ModuleType("cupy.cuda")
    cuda.driver = driver
    cp = types.ModuleType("cupy")
    cp.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(ops.kernel_loader, "get_function", lambda name, dev=None: types.SimpleNamespace(ptr=0xF00))
    # each library kernel its own pointer (tests.support.fake_cupy.function_ptr): a launch names its kernel
    monkeypatch.setattr(
        ops.kernel_loader,
        "load_kernels",
        lambda names, dev=None: {n: types.SimpleNamespace(ptr=function_ptr(n)) for n in names},
    )
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: 0x5)
    monkeypatch.setitem(ops._state, "multi_device", False)

    def describe(name, x):
        if isinstance(x, torch.Tensor):
            return validation.ArrayInfo(x.data_ptr(), tuple(x.shape), x.stride(), np.dtype(np.int32), 0, x)
        return validation.describe(name, x)

    monkeypatch.setattr(bound_step, "describe", describe)
    ops.clear_cache()
    yield calls
    ops.clear_cache()
    ops.set_debug(False)


def launch_params(call):
    """The ``KvStepParams`` a recorded launch passed (its kernelParams' one pointer)."""
    from kvaddr import kernel_loader

    return kernel_loader.StepParams.from_address(ctypes.c_void_p.from_address(call[9]).value)
