"""Host-side input checks shared by the reference, the CPU path and the device path.

Messages follow one pattern: ``<argument> must be <what>, got <what it was>``.
Device arrays are described without touching their data: CuPy arrays and PyTorch
tensors through their own attributes, anything else through
``__cuda_array_interface__`` or ``__dlpack__``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvaddr.constants import INT32_MAX

INT32 = np.dtype(np.int32)
#: The most requests one step may carry (the error key holds 27 bits of request).
MAX_REQUESTS = 1 << 27


class ArrayInfo(NamedTuple):
    """What the checks and the launch need of an array, read without copying."""

    ptr: int
    shape: tuple
    strides: tuple  # in elements
    dtype: np.dtype
    device: int  # CUDA device ordinal, -1 for host memory
    obj: Any  # keeps the owner alive


#: ``ArrayInfo`` from a tuple of its six fields without the generated ``__new__``'s Python frame.
_new_info = tuple.__new__

_TORCH_DTYPES: dict = {}


def _torch_info(x) -> ArrayInfo:
    if not _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES.update(
            {
                torch.int32: INT32,
                torch.int64: np.dtype(np.int64),
                torch.float32: np.dtype(np.float32),
                torch.float64: np.dtype(np.float64),
                torch.int16: np.dtype(np.int16),
                torch.int8: np.dtype(np.int8),
                torch.uint8: np.dtype(np.uint8),
                torch.bool: np.dtype(np.bool_),
                torch.float16: np.dtype(np.float16),
            }
        )
    dt = _TORCH_DTYPES.get(x.dtype, _VOID)
    # get_device(): the CUDA ordinal, -1 for a CPU tensor (cheaper than building x.device)
    return _new_info(ArrayInfo, (x.data_ptr(), tuple(x.shape), x.stride(), dt, x.get_device() if x.is_cuda else -1, x))


_VOID = np.dtype(np.void)


def _cupy_info(x) -> ArrayInfo:
    """A CuPy array's info: one attribute read each, strides in elements without a generator."""
    mem = x.data
    isz = x.itemsize
    st = x.strides
    n = len(st)
    if n == 1:
        el = (st[0] // isz,)
    elif n == 2:
        el = (st[0] // isz, st[1] // isz)
    else:
        el = tuple(s // isz for s in st)
    dev = getattr(mem, "device_id", None)  # MemoryPointer.device_id; x.device builds a Device
    if dev is None:
        dev = x.device.id
    return _new_info(ArrayInfo, (mem.ptr, x.shape, el, x.dtype, dev, x))


_OTHER, _CUPY, _TORCH = 0, 1, 2
#: Which path of describe() a class takes, decided once per class (by its module and name).
_KINDS: dict = {}


def _kind_of(cls) -> int:
    mod = cls.__module__
    if mod.startswith("cupy"):
        return _CUPY
    if mod == "torch" and cls.__name__ in ("Tensor", "Parameter"):
        return _TORCH
    return _OTHER


def array_kind(x) -> str:
    """Which path :func:`describe` takes for ``x``: ``"cupy"``, ``"torch"`` (a tensor) or ``""``
    (anything else); decided once per class."""
    cls = x.__class__
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind_of(cls)
    return ("", "cupy", "torch")[kind]


def describe(name: str, x) -> ArrayInfo:
    """Describe a device array: CuPy, PyTorch, __cuda_array_interface__ or __dlpack__.

    Raises TypeError naming ``name`` for host arrays and for unknown objects.
    """
    cls = type(x)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind_of(cls)
    if kind == _CUPY:
        return _cupy_info(x)
    if kind == _TORCH:
        info = _torch_info(x)
        if info.device < 0:
            raise TypeError(f"{name} must be a CUDA array, got a torch tensor on {x.device}")
        return info
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a CUDA array (CuPy, PyTorch, or any __cuda_array_interface__ "
            f"or __dlpack__ object), got numpy.ndarray (host memory)"
        )
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is None:
            el, acc = [], 1
            for n in reversed(shape):
                el.append(acc)
                acc *= n
            strides = tuple(reversed(el))
        else:
            strides = tuple(s // dt.itemsize for s in strides)
        ptr = int(cai["data"][0])
        return ArrayInfo(ptr, shape, strides, dt, _device_of_pointer(ptr), x)
    if hasattr(x, "__dlpack__"):
        import cupy

        try:
            arr = cupy.from_dlpack(x)
        except Exception as exc:  # host DLPack tensors and the like
            raise TypeError(f"{name} must be a CUDA array; __dlpack__ export failed: {exc}") from None
        return describe(name, arr)
    raise TypeError(
        f"{name} must be a CUDA array (CuPy, PyTorch, or any __cuda_array_interface__ or "
        f"__dlpack__ object), got {cls.__module__}.{cls.__qualname__}"
    )


#: ``ArrayInfo.device`` of pinned host memory read through its device pointer (UVA): every device
#: may read it, so no device check applies (as for an empty array).
MAPPED_DEVICE = -2


def _pointer_kind(ptr: int) -> tuple[bool, int]:
    """``cudaPointerGetAttributes`` of ``ptr``: (whether it is pinned host memory, its device
    pointer); (False, 0) where the attributes cannot be read (older drivers refuse pageable host
    pointers outright)."""
    from cupy.cuda import runtime

    try:
        attrs = runtime.pointerGetAttributes(ptr)
    except Exception:
        return False, 0
    kind = getattr(attrs, "type", getattr(attrs, "memoryType", -1))
    return kind == getattr(runtime, "memoryTypeHost", 1), int(getattr(attrs, "devicePointer", 0) or 0)


def mapped_pointer(name: str, ptr: int) -> int:
    """The device pointer of host address ``ptr`` in pinned (page-locked, mapped) host memory, which
    a kernel reads through unified virtual addressing; 0 for 0. Raises TypeError naming ``name``
    for pageable host memory (no device may read it)."""
    if ptr == 0:
        return 0
    host, dptr = _pointer_kind(ptr)
    if not host or dptr == 0:
        raise TypeError(
            f"{name} must be a CUDA array or pinned host memory (torch pin_memory(), "
            f"cupyx.empty_pinned), got pageable host memory"
        )
    return dptr


def host_memory(ptr: int) -> bool:
    """Whether device pointer ``ptr`` addresses pinned host memory (read through UVA over PCIe), as
    ``cudaPointerGetAttributes`` reports it: a mapped view of a pinned buffer, whatever array type
    (a CuPy or torch CUDA tensor over vLLM's pinned ``num_blocks``, say) holds it. False for device
    memory and where the attributes cannot be read."""
    return ptr != 0 and _pointer_kind(ptr)[0]


def describe_mapped(name: str, x) -> ArrayInfo:
    """:func:`describe`, also accepting pinned host memory that kernels read through UVA: a pinned
    torch CPU tensor (``pin_memory()``), a NumPy array in pinned memory (``cupyx.empty_pinned``) or
    a ``__cuda_array_interface__`` view of pinned host memory. Its info then holds the memory's
    device pointer and device :data:`MAPPED_DEVICE` (readable from every device). Device arrays
    are described as :func:`describe` does; pageable host memory raises TypeError naming ``name``."""
    cls = type(x)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind_of(cls)
    if kind == _TORCH and not x.is_cuda:
        if x.device.type != "cpu" or not x.is_pinned():
            raise TypeError(
                f"{name} must be a CUDA array or pinned host memory (torch pin_memory(), cupyx.empty_pinned), "
                f"got a torch tensor in pageable memory on {x.device}"
            )
        info = _torch_info(x)
        return info._replace(ptr=mapped_pointer(name, info.ptr), device=MAPPED_DEVICE)
    if isinstance(x, np.ndarray):
        info = host_info(x)
        ptr = x.__array_interface__["data"][0] if x.size else 0
        return info._replace(ptr=mapped_pointer(name, ptr), device=MAPPED_DEVICE, obj=x)
    info = describe(name, x)
    if info.device == -1:  # a __cuda_array_interface__ object over host memory
        return info._replace(ptr=mapped_pointer(name, info.ptr), device=MAPPED_DEVICE)
    return info


def _cupy_signature(x) -> tuple:
    m = x.data
    return (m.ptr, m.device_id, x.shape, x.strides, x.dtype)


#: Memo signatures of CuPy arrays read ``_shape``/``_strides`` (the lists CuPy makes from its C++
#: vectors) instead of ``shape``/``strides`` (the same lists, then turned into tuples): the same
#: values, one conversion fewer per field; only for a class whose ``_shape`` and ``_strides`` read as
#: lists. Off until timed on a GPU (``scripts/gpu/vhost_profile.py`` times both); read when a memo
#: is made, so set it before the checked call that makes one.
CUPY_VECTOR_SIGNATURE = False
_VECTORS: dict = {}  # class -> whether its _shape and _strides read as lists


def _cupy_signature_vectors(x) -> tuple:
    m = x.data
    return (m.ptr, m.device_id, x._shape, x._strides, x.dtype)


def _has_vectors(x) -> bool:
    cls = x.__class__
    v = _VECTORS.get(cls)
    if v is None:
        v = _VECTORS[cls] = isinstance(getattr(x, "_shape", None), list) and isinstance(
            getattr(x, "_strides", None), list
        )
    return v


def _cupy_signature_no_device_id(x) -> tuple:  # a MemoryPointer-like without device_id
    return (x.data.ptr, x.device.id, x.shape, x.strides, x.dtype)


def _torch_signature(x) -> tuple:
    return (x.data_ptr(), x.get_device(), x.shape, x.stride(), x.dtype)


def signature_getter(arrays):
    """A function reading an array's exact signature, for memoising the checks of ``arrays``.

    The signature is ``(pointer, device, shape, strides, dtype)`` read straight from the
    array's own attributes: everything :func:`describe` and :func:`check_info` look at.
    Two equal signatures of one array object mean the same checks pass (and the same
    pointer is launched), so a caller holding a reference to the object (its ``id``
    cannot be reused) may skip the checks while the signature stays equal. Returns one
    function for all of ``arrays`` (all CuPy or all PyTorch), or None (mixed kinds,
    ``__cuda_array_interface__`` and DLPack objects: those are described every time).
    """
    return _getter_and_distinct(arrays)[0]


def _getter_and_distinct(arrays) -> tuple:
    """``(signature getter or None, the distinct objects of arrays)`` in one pass (memo_guard runs it
    on every checked call)."""
    getter, distinct, ids = None, [], set()
    for x in arrays:
        i = id(x)  # (the objects are alive: their ids are theirs)
        if i in ids:
            continue
        ids.add(i)
        distinct.append(x)
        cls = x.__class__
        kind = _KINDS.get(cls)
        if kind is None:
            kind = _KINDS[cls] = _kind_of(cls)
        if kind == _CUPY:
            if not hasattr(x.data, "device_id"):
                g = _cupy_signature_no_device_id
            elif CUPY_VECTOR_SIGNATURE and _has_vectors(x):
                g = _cupy_signature_vectors
            else:
                g = _cupy_signature
        elif kind == _TORCH:
            g = _torch_signature
        else:
            return None, distinct
        if g is not getter:
            if getter is not None:
                return None, distinct
            getter = g
    return getter, distinct


#: Each signature getter's fields as source text over an array ``a`` (``m``: its ``data``, read once).
_SIGNATURE_SOURCE = {
    _cupy_signature: "({m} := {a}.data).ptr, {m}.device_id, {a}.shape, {a}.strides, {a}.dtype",
    _cupy_signature_vectors: "({m} := {a}.data).ptr, {m}.device_id, {a}._shape, {a}._strides, {a}.dtype",
    _cupy_signature_no_device_id: "{a}.data.ptr, {a}.device.id, {a}.shape, {a}.strides, {a}.dtype",
    _torch_signature: "{a}.data_ptr(), {a}.get_device(), {a}.shape, {a}.stride(), {a}.dtype",
}
#: memo_guard's compiled factories, by (signature getter, argument pattern, number of distinct arrays).
_GUARD_FACTORIES: dict = {}
_PLAIN_SEQUENCES = (list, tuple)


def _guard_factory(getter, pattern: tuple, n_arrays: int):
    """Compile (once per key) ``make(o0, .., d0, ..) -> same``: see :func:`memo_guard`.

    ``pattern`` has one entry per argument: -1 for an object compared by identity, k >= 0 for a
    plain list or tuple of k objects compared item by item. ``same(x0, ..)`` is one expression:
    the identity tests, then ONE tuple of every distinct array's signature fields (read in this
    frame, no call per array) compared with the tuple read when the memo was made.
    """
    key = (getter, pattern, n_arrays)
    make = _GUARD_FACTORIES.get(key)
    if make is not None:
        return make
    names, tests = [], []
    for i, k in enumerate(pattern):
        x = f"x{i}"
        if k < 0:
            names.append(f"o{i}")
            tests.append(f"{x} is o{i}")
        else:
            items = [f"o{i}_{j}" for j in range(k)]
            names += items
            tests.append(f"{x}.__class__ in _SEQ and len({x}) == {k}")
            tests += [f"{x}[{j}] is {o}" for j, o in enumerate(items)]
    arrays = [f"d{i}" for i in range(n_arrays)]
    # the signature tuple: each array's fields in turn (CuPy: its data pointer read once, into m<i>)
    # (a getter without inline source, e.g. one a test put in place, is called: its fields unpacked)
    source = _SIGNATURE_SOURCE.get(getter, "*_getter({a})")
    read = ", ".join(source.format(a=a, m=f"m{i}") for i, a in enumerate(arrays))
    args = ", ".join(f"x{i}" for i in range(len(pattern)))
    src = (
        f"def make({', '.join(names + arrays)}):\n"
        f"    sig = ({read},)\n"
        f"    def same({args}):\n"
        f"        return {' and '.join(tests)} and ({read},) == sig\n"
        f"    return same\n"
    )
    ns = {"_SEQ": _PLAIN_SEQUENCES, "_getter": getter}
    exec(compile(src, f"<kvaddr memo guard {pattern} x {n_arrays}>", "exec"), ns)
    make = _GUARD_FACTORIES[key] = ns["make"]
    return make


def memo_guard(args: Sequence, arrays: Sequence | None = None):
    """A function telling whether a call's arguments are the memoised ones, unchanged.

    ``args`` are the arguments of the call just checked, in order: each an object compared by
    identity (an array, None) or a plain ``list``/``tuple`` of objects, compared by its items (a
    list may be changed in place). ``arrays`` are the arrays those checks described (default: every
    argument object, sequences by their items); each distinct object's signature (see
    :func:`signature_getter`) is read now and again at every test. Returns
    ``same(*args) -> bool``: True only for the same objects (sequences: a list or tuple with the
    same items) whose arrays' signatures are all unchanged, i.e. a call whose checks would pass as
    they did. The function holds references to every object (their ids stay theirs). Returns None
    where no guard is possible: arrays without one cheap signature getter (mixed CuPy and
    torch, ``__cuda_array_interface__``, DLPack) or a list/tuple subclass among ``args``.

    The guard is one generated expression (compiled once per argument pattern and cached): its
    cost is a few identity tests and one tuple compare, with no call per array.
    """
    pattern, objects = [], []
    for x in args:
        cls = x.__class__
        if cls is list or cls is tuple:
            pattern.append(len(x))
            objects += x
        elif isinstance(x, _PLAIN_SEQUENCES):  # a subclass may change how it is iterated
            return None
        else:
            pattern.append(-1)
            objects.append(x)
    getter, distinct = _getter_and_distinct(objects if arrays is None else arrays)
    if getter is None:
        return None
    return _guard_factory(getter, tuple(pattern), len(distinct))(*objects, *distinct)


def repeats(args: tuple, last: tuple | None) -> bool:
    """Whether a checked call's ``args`` are the objects of the checked call before (``last``).

    The planners build a memo guard (:func:`memo_guard`) only for a call that repeats the
    objects of the checked call before it: an engine passing new objects every step (slices of
    its buffers) would never hit the memo, so building the guard for it costs every call. Same
    objects: each argument is the same object, or a plain ``list``/``tuple`` with the same items
    as the one before. A heuristic of when to build the guard, not a check: the guard itself is
    built from this call's objects and signatures. The first argument (an array in both
    planners) is tested first, so a call with new objects costs one identity test.
    """
    if last is None or args[0] is not last[0] or len(args) != len(last):
        return False
    for x, y in zip(args, last):
        if x is y:
            continue
        cls = x.__class__
        if (cls is not list and cls is not tuple) or y.__class__ not in _PLAIN_SEQUENCES or len(x) != len(y):
            return False
        for a, b in zip(x, y):
            if a is not b:
                return False
    return True


def _device_of_pointer(ptr: int) -> int:
    if ptr == 0:
        return -2  # empty array: no device to check
    from cupy.cuda import runtime

    attrs = runtime.pointerGetAttributes(ptr)
    if attrs.type in (runtime.memoryTypeDevice, getattr(runtime, "memoryTypeManaged", 3)):
        return attrs.device
    return -1


def host_info(x: np.ndarray) -> ArrayInfo:
    return ArrayInfo(0, x.shape, tuple(s // x.itemsize for s in x.strides), x.dtype, -1, x)


def _shape_text(ndim: int) -> str:
    return "(bsz,)" if ndim == 1 else "(rows >= bsz, max_blocks) with a contiguous last dim"


def _what(ndim: int) -> str:
    return f"int32 with shape {_shape_text(ndim)}"


def check_info(
    name: str, info: ArrayInfo, *, ndim: int, min_rows: int | None = None, device: int | None = None
) -> ArrayInfo:
    """Check dtype int32, rank, contiguity of the last dim, rows and device.

    The hot path of ``StepPlanner.compute``: each check is one comparison and the
    message is built only when one fails.
    """
    shape = info.shape
    if info.dtype != INT32:
        raise TypeError(f"{name} must be {_what(ndim)}, got dtype {info.dtype}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {_what(ndim)}, got shape {shape}")
    if ndim == 1:
        if shape[0] > 1 and info.strides[0] != 1:  # (an empty array has no shape[0] > 1)
            raise ValueError(f"{name} must be contiguous, got a strided view (stride {info.strides[0]} elements)")
    elif ndim == 2:
        rows, width = shape
        empty = rows == 0 or width == 0  # no element to address: strides don't matter
        if not empty and width > 1 and info.strides[1] != 1:
            raise ValueError(
                f"{name} must be {_what(ndim)}, got a last-dim stride of {info.strides[1]} elements "
                f"(a transposed or strided view)"
            )
        if not empty and rows > 1 and info.strides[0] < width:
            raise ValueError(f"{name} must be {_what(ndim)}, got overlapping rows (row stride {info.strides[0]})")
        if width < 1:
            raise ValueError(f"{name} must be {_what(ndim)}, got max_blocks = 0")
    if min_rows is not None and shape[0] < min_rows:
        raise ValueError(f"{name} must be {_what(ndim)}, got {shape[0]} rows for bsz = {min_rows}")
    if device is not None and info.device != device and info.device != -2:
        where = "host memory" if info.device < 0 else f"device {info.device}"
        raise ValueError(f"{name} must be on CUDA device {device}, got an array in {where}")
    return info


def check_host_array(name: str, x, *, ndim: int, min_rows: int | None = None) -> np.ndarray:
    """Check a NumPy input of the reference / CPU path; returns it."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of int32, got {type(x).__module__}.{type(x).__qualname__}")
    check_info(name, host_info(x), ndim=ndim, min_rows=min_rows)
    return x


def check_lengths(bsz: int, *, q: int, enc: int | None = None) -> None:
    if q != bsz:
        raise ValueError(f"seq_lens_this_time must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got ({q},)")
    if enc is not None and enc != bsz:
        raise ValueError(f"seq_lens_encoder must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got ({enc},)")


def check_int(name: str, value, *, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {lo}, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an int {rng}, got {value}")
    return value


def check_block_sizes(block_sizes, *, max_caches: int, allow_empty: bool = False) -> tuple:
    """Block sizes of 1..max_caches caches (0 too with allow_empty), each an int >= 1."""
    if isinstance(block_sizes, numbers.Integral) and not isinstance(block_sizes, bool):
        block_sizes = [block_sizes]
    if not isinstance(block_sizes, Sequence) or isinstance(block_sizes, (str, bytes)):
        raise TypeError(f"block_sizes must be an int >= 1 or a sequence of them, got {block_sizes!r}")
    if not block_sizes and not allow_empty:
        raise ValueError("block_sizes must name at least one cache, got an empty sequence")
    if len(block_sizes) > max_caches:
        raise ValueError(f"block_sizes must hold at most {max_caches} caches, got {len(block_sizes)}")
    return tuple(check_int(f"block_sizes[{g}]", b, lo=1, hi=INT32_MAX) for g, b in enumerate(block_sizes))


def _is_array(x) -> bool:
    return hasattr(x, "shape") or hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")


def normalize_tables(block_tables, num_caches: int) -> list:
    """One table for every cache, or a sequence of exactly ``num_caches`` tables."""
    if _is_array(block_tables):
        return [block_tables] * num_caches
    if isinstance(block_tables, (list, tuple)):
        if len(block_tables) != num_caches:
            raise ValueError(
                f"block_tables must be one array or a sequence of {num_caches} (one per cache), "
                f"got a sequence of {len(block_tables)}"
            )
        return list(block_tables)
    raise TypeError(
        f"block_tables must be an int32 array or a sequence of them, got "
        f"{type(block_tables).__module__}.{type(block_tables).__qualname__}"
    )


def write_tables(block_tables, num_caches: int, bsz: int, device: int, ptrs, strides, widths) -> list:
    """Check a step's block tables (one per cache, each ``[rows >= bsz, max_blocks]`` int32 on
    ``device``) and write each cache's pointer, row stride (elements) and width into the kernel
    parameter arrays ``ptrs``, ``strides`` and ``widths``; returns the tables, one per cache."""
    tables = normalize_tables(block_tables, num_caches)
    many = num_caches > 1 and tables[0] is not tables[1]
    info, last = None, None
    for g, t in enumerate(tables):
        if t is not last:
            info = check_info(
                f"block_tables[{g}]" if many else "block_tables",
                describe("block_tables", t),
                ndim=2,
                min_rows=bsz,
                device=device,
            )
            if info.shape[1] > INT32_MAX:
                raise ValueError("block_tables must have fewer than 2**31 columns")
            last = t
        ptrs[g] = info.ptr  # block_tables[g]: [rows >= bsz, max_blocks], int32
        strides[g] = info.strides[0]  # table_stride[g]: int64, elements
        widths[g] = info.shape[1]  # max_blocks[g]: int32
    return tables


def normalize_caches(block_tables, block_sizes) -> tuple[list, list]:
    sizes = list(check_block_sizes(block_sizes, max_caches=1 << 20))
    return normalize_tables(block_tables, len(sizes)), sizes


def stream_handle(stream) -> int:
    """A raw cudaStream_t from None (CuPy's current stream), a CuPy stream, an int
    handle, or anything with a ``cuda_stream`` attribute (a torch stream)."""
    if stream.__class__ is int:  # the hot path: a raw handle
        return stream
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    ptr = getattr(stream, "ptr", None)
    if ptr.__class__ is int:  # a CuPy stream (the next hot path)
        return ptr
    if isinstance(stream, bool):
        raise TypeError(f"stream must be a CuPy stream, a raw handle or an object with cuda_stream, got {stream!r}")
    if isinstance(stream, numbers.Integral):
        return int(stream)
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, numbers.Integral):
        return int(ptr)
    cs = getattr(stream, "cuda_stream", None)
    if isinstance(cs, numbers.Integral):
        return int(cs)
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        got = protocol()
        if isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, numbers.Integral) for v in got):
            return int(got[1])
        raise TypeError(f"stream.__cuda_stream__() must return (version, handle) as two ints, got {got!r}")
    raise TypeError(
        f"stream must be a CuPy stream, a raw handle (int), an object with a cuda_stream "
        f"attribute or one with __cuda_stream__, got {type(stream).__module__}."
        f"{type(stream).__qualname__}"
    )


class _RawStream:
    """A raw cudaStream_t offered through the CUDA stream protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self) -> tuple:
        return (0, self.handle)


def cupy_stream(handle: int):
    """A CuPy stream object over the raw handle that does not own it (dropping it destroys nothing).

    CuPy 14 deprecates ``cupy.cuda.ExternalStream`` for ``Stream.from_external``;
    older CuPy has only the former.
    """
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_RawStream(handle))
    return cupy.cuda.ExternalStream(int(handle))
