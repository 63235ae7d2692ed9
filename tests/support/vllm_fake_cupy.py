"""A minimal fake CuPy for the vLLM planner's host side on the CPU.

Arrays are NumPy arrays dressed as CuPy ones (their host address stands for the
device pointer); launches are recorded with the parameter struct they received
and, optionally, handed to a callback (the kernel emulator)."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np

from kvaddr import kernel_loader


class _Mem:
    def __init__(self, ptr):
        self.ptr = ptr


class _Dev:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeArray:
    """A NumPy array dressed as a CuPy one. ``a`` (the array: pointer, shape, strides,
    dtype) and ``dev`` (the device ordinal) may be replaced in place, as CuPy's shape
    setter or torch's ``set_``/``resize_`` change an array object's metadata."""

    def __init__(self, a, dev=0):
        self.a = a
        self.dev = dev

    @property
    def data(self):
        return _Mem(self.a.ctypes.data)

    shape = property(lambda self: self.a.shape)
    strides = property(lambda self: self.a.strides)
    itemsize = property(lambda self: self.a.itemsize)
    dtype = property(lambda self: self.a.dtype)
    device = property(lambda self: _Dev(self.dev))
    size = property(lambda self: self.a.size)
    ndim = property(lambda self: self.a.ndim)

    def fill(self, v):
        self.a.fill(v)

    def get(self, stream=None, out=None):
        if out is not None:
            out[...] = self.a
            return out
        return self.a.copy()

    def set(self, host, stream=None):
        self.a[...] = host

    def view(self, dtype):
        return FakeArray(self.a.view(dtype), self.dev)

    def __getitem__(self, k):
        return FakeArray(self.a[k])


FakeArray.__module__ = "cupy._core.core"


def snapshot(p) -> dict:
    out = {}
    for name, _ in type(p)._fields_:
        v = getattr(p, name)
        out[name] = list(v) if hasattr(v, "__len__") else v
    return out


class _Stream:
    ptr = 1234

    def synchronize(self):
        pass

    @staticmethod
    def from_external(obj):
        return _Stream()


def install(monkeypatch, on_launch=None) -> types.SimpleNamespace:
    """Install the fake; returns a namespace with ``launches``, ``names`` (kernel name -> fake pointer)
    and ``pin(array, device_offset=0)`` (marks a NumPy array's memory pinned host memory, whose device
    pointer is its address + device_offset, for ``cudaPointerGetAttributes``)."""
    launches = []
    names: dict = {}
    by_ptr: dict = {}

    def launch(fptr, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        from kvaddr.engines.vllm import VllmStepParams

        arg0 = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        p = VllmStepParams.from_address(arg0)
        launches.append(
            dict(fn=fptr, name=by_ptr[fptr], grid=(gx, gy, gz), block=bx, stream=stream, params=snapshot(p))
        )
        if on_launch is not None:
            on_launch(by_ptr[fptr], arg0, gx, gy)

    stream = _Stream()
    pinned: dict = {}  # host address of a pinned allocation -> (its length in bytes, its device pointer)

    def pointer_attributes(ptr):
        """cudaPointerGetAttributes for host memory: pinned (registered with ``pin``; by its host
        address or its device pointer) or pageable."""
        for start, (size, dptr) in pinned.items():
            if start <= ptr < start + size:
                return types.SimpleNamespace(type=1, device=0, devicePointer=dptr + (ptr - start), hostPointer=ptr)
            if dptr <= ptr < dptr + size:
                return types.SimpleNamespace(type=1, device=0, devicePointer=ptr, hostPointer=start + (ptr - dptr))
        return types.SimpleNamespace(type=0, device=-2, devicePointer=0, hostPointer=0)

    def pin(a: np.ndarray, device_offset: int = 0) -> np.ndarray:
        """Mark NumPy array ``a``'s memory pinned; its device pointer is its address + device_offset."""
        pinned[a.ctypes.data] = (max(a.nbytes, 1), a.ctypes.data + device_offset)
        return a

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            getDevice=lambda: 0, pointerGetAttributes=pointer_attributes, memoryTypeHost=1, memoryTypeDevice=2
        ),
        Device=_Dev,
        Stream=_Stream,
        get_current_stream=lambda: stream,
        driver=types.SimpleNamespace(launchKernel=launch),
    )
    cupy.zeros = lambda shape, dtype: FakeArray(np.zeros(shape, dtype))
    cupy.full = lambda shape, v, dtype: FakeArray(np.full(shape, v, dtype))
    # a FakeArray (a caller's device array) is taken as is, zero-copy, as CuPy takes a device array
    cupy.asarray = lambda a: a if isinstance(a, FakeArray) else FakeArray(np.array(a))
    cupy.uint64 = np.uint64
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)

    def get_function(name, device_id=None):
        ptr = names.setdefault(name, 1000 + len(names))
        by_ptr[ptr] = name
        return types.SimpleNamespace(ptr=ptr)

    monkeypatch.setattr(kernel_loader, "get_function", get_function)
    monkeypatch.setattr(
        kernel_loader, "load_kernels", lambda ks, device_id=None: {k: get_function(k, device_id) for k in ks}
    )
    return types.SimpleNamespace(launches=launches, names=names, pin=pin)


def on_fake(x):
    """Inputs (dict of NumPy arrays / lists of them) as fake device arrays."""
    return {k: ([FakeArray(a) for a in v] if isinstance(v, list) else FakeArray(v)) for k, v in x.items()}
