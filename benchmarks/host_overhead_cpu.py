"""The Python overhead of kvaddr's eager launch paths, measured without a GPU.

``cuLaunchKernel`` (``cupy.cuda.driver.launchKernel``) is replaced by a no-op and the
device arrays by stand-ins with CuPy's attributes (``data.ptr``, ``shape``, ``strides``,
``dtype``, ``device.id``), so what is timed is kvaddr's own Python: the checks and
parameter writes of ``StepPlanner.compute()``, ``BoundStep.launch()``, and (with torch
installed) the CUDA kernel of ``torch.ops.kvaddr.step`` called directly on CPU tensors
posing as CUDA ones. Absolute numbers depend on the host; compare rows of one run.
``benchmarks/bench_host.py`` measures the real thing on a GPU.

    PYTHONPATH=. python benchmarks/host_overhead_cpu.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import types

import numpy as np


class _Mem:
    __slots__ = ("device_id", "ptr")

    def __init__(self, ptr):
        self.ptr, self.device_id = ptr, 0


class _Device:
    __slots__ = ("id",)

    def __init__(self, i):
        self.id = i


def fake_cupy_array_class():
    """A stand-in for ``cupy.ndarray`` (its module starts with "cupy", like the real one).

    Its attributes are slots (C-level reads, as CuPy's ``cdef readonly`` ones);
    ``device`` builds an object per read, as CuPy's does.
    """

    class ndarray:  # CuPy's name
        __slots__ = ("data", "dtype", "itemsize", "shape", "strides")
        _next = 0x7000_0000

        def __init__(self, shape, dtype=np.int32):
            self.shape = tuple(shape)
            self.dtype = np.dtype(dtype)
            self.itemsize = self.dtype.itemsize
            n = 1
            for s in shape:
                n *= s
            acc, st = self.itemsize, []
            for s in reversed(self.shape):
                st.append(acc)
                acc *= s
            self.strides = tuple(reversed(st))
            self.data = _Mem(ndarray._next)
            ndarray._next += max(n * self.itemsize, 256)

        @property
        def device(self):
            return _Device(self.data.device_id)

        def __getitem__(self, key):  # views: the outputs' slices (cached per bsz by the planner)
            return self

    ndarray.__module__ = "cupy._core.core"
    return ndarray


def install_fake_cupy():
    """A ``cupy`` module just big enough for ``StepPlanner.__init__`` and ``compute()`` (and the vLLM
    planner's): arrays are
    the slot-based stand-ins above, ``launchKernel`` a no-op; returns the no-op."""
    ndarray = fake_cupy_array_class()

    def noop(*_args):
        return None

    class _Ctx:
        def __init__(self, *_a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    driver = types.SimpleNamespace(launchKernel=noop)
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    cuda = types.ModuleType("cupy.cuda")
    cuda.driver = driver
    cuda.Device = _Ctx
    cuda.get_current_stream = lambda: stream
    cuda.runtime = types.SimpleNamespace(
        getDevice=lambda: 0, getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"multiProcessorCount": 132}
    )
    cp = types.ModuleType("cupy")
    cp.cuda = cuda
    cp.ndarray = ndarray
    cp.zeros = lambda shape, dtype=np.float64: ndarray(shape if isinstance(shape, tuple) else (shape,), dtype)
    cp.full = lambda shape, _v, dtype=np.float64: cp.zeros(shape, dtype)
    cp.asarray = lambda a: ndarray(np.asarray(a).shape, np.asarray(a).dtype)
    sys.modules["cupy"], sys.modules["cupy.cuda"], sys.modules["cupy.cuda.driver"] = cp, cuda, driver
    return noop


def _fake_function(*_args):
    return types.SimpleNamespace(ptr=0xF00)


def fake_loader(kernel_loader) -> None:
    """A kernel loader (kvaddr.kernel_loader, or another tree's) that compiles nothing: every kernel
    is a stand-in function at one address (its launch is the no-op driver call)."""
    kernel_loader.get_function = _fake_function
    if hasattr(kernel_loader, "load_kernels"):  # the library kernels, by name expression
        kernel_loader.load_kernels = lambda names, device_id=None: {n: _fake_function() for n in names}


def planner_without_gpu(max_requests, capacity, block_sizes, **kw):
    """A StepPlanner built by its real ``__init__`` on the fake CuPy (install_fake_cupy() first):
    the Python path of compute() is real, the launch a no-op. Returns ``(planner, ndarray class)``."""
    from kvaddr import device, kernel_loader
    from kvaddr.planner import StepPlanner

    cp = sys.modules["cupy"]
    device._checked[:] = [cp, 1]  # require_cuda: one device
    fake_loader(kernel_loader)
    return StepPlanner(max_requests, capacity, block_sizes, **kw), cp.ndarray


def per_call_us(fn, n: int, repeats: int) -> tuple[float, list]:
    for _ in range(min(n, 2000)):
        fn()
    samples = []
    for _ in range(repeats):
        # thread CPU time: what this thread ran, not the time it waited for a core
        # (this benchmark runs on shared CI-like hosts)
        t = time.thread_time()
        for _ in range(n):
            fn()
        samples.append((time.thread_time() - t) / n * 1e6)
    return statistics.median(samples), samples


def ab_compute(path, planner, dec, q, table, stream, n, repeats) -> dict:
    """compute() with the planner's validation functions from ``path`` and from kvaddr, alternating
    sample by sample (the same noise for both)."""
    import importlib.util

    from kvaddr import planner as planner_module
    from kvaddr import validation

    spec = importlib.util.spec_from_file_location("kvaddr_validation_other", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    names = ("check_info", "describe", "normalize_tables", "stream_handle")
    samples = {"compute(), no memo, --ab validation.py": [], "compute(), no memo, this validation.py": []}

    def fn():
        planner.compute(dec, q, table, stream=stream)

    planner.memoize_checks, planner._memo = False, None  # time the checks themselves
    for _ in range(repeats * 3):
        for label, mod in zip(samples, (other, validation)):
            for name in names:
                setattr(planner_module, name, getattr(mod, name))
            samples[label].append(per_call_us(fn, n, 1)[0])
    for name in names:
        setattr(planner_module, name, getattr(validation, name))
    planner.memoize_checks = True
    return {label: (statistics.median(v), v) for label, v in samples.items()}


def ab_memo(planner, dec, q, table, stream, n, repeats) -> dict:
    """compute() with and without its memo of checked inputs (``planner.memoize_checks``),
    alternating sample by sample: the path before the memo against the path after."""
    samples = {"compute(), memoize_checks=False (every check)": [], "compute(), memoize_checks=True": []}

    def fn():
        planner.compute(dec, q, table, stream=stream)

    for _ in range(repeats):
        for label, on in zip(samples, (False, True)):
            planner.memoize_checks = on
            planner._memo = None
            samples[label].append(per_call_us(fn, n, 1)[0])
    planner.memoize_checks = True
    return {label: (statistics.median(v), v) for label, v in samples.items()}


def vllm_vs_core(ndarray, bsz, n, repeats, only_memo=False) -> dict:
    """``VllmStepPlanner.compute()`` against ``StepPlanner.compute()`` on the same batch
    size, one and two groups (caches), each with its memo on and off (``memoize_checks``),
    interleaved sample by sample (the same noise for all). The inputs are what
    ``benchmarks/bench_vllm.py`` passes: one table per group (distinct arrays), vLLM's
    ``num_blocks`` as a list of one array per group; plus a vLLM row with the same table object
    passed for both groups, and rows with the memo on but new idx_mapping/query_start_loc (core:
    dec/q) objects every call (an engine passing fresh slices: the memo never hits, what it costs
    is the checked path alone since the memo is made only for repeated objects). The ``bind()``
    rows: ``VllmStepPlanner.bind(nct, tables, num_blocks)`` once, then ``launch(idx_mapping,
    query_start_loc, num_reqs_padded)`` with new or the same batch objects (the batch checked every
    launch, the bound state's signatures compared). The last rows: vLLM minus core, best sample
    against best sample."""
    from kvaddr.engines.vllm import VllmStepPlanner

    M, T, stream = max(bsz, 1), 256, 0x1234
    calls = {}

    def vllm_call(pl, idx, qsl, nct, tables, nbs):
        return lambda: pl.compute(idx, qsl, nct, tables, nbs, bsz, stream=stream)

    def core_call(pl, dec, q, tables):
        return lambda: pl.compute(dec, q, tables, stream=stream)

    def bound_call(b, idx, qsl):
        return lambda: b.launch(idx, qsl, bsz, stream=stream)

    def fresh(make, k=8):  # a call on new objects every time (k sets of them in turn)
        calls = itertools.cycle([make() for _ in range(k)])
        return lambda: next(calls)()

    for G in (1, 2):
        sizes, widths = [16, 64][:G], [32, 8][:G]
        idx, qsl, nct = ndarray((bsz,)), ndarray((bsz + 1,)), ndarray((M,))
        tables = [ndarray((M, w)) for w in widths]
        nbs = [ndarray((M,)) for _ in range(G)]
        vp = VllmStepPlanner(M, T, sizes, widths)
        calls[f"vLLM G={G}"] = (vp, vllm_call(vp, idx, qsl, nct, tables, nbs), True)
        core, _ = planner_without_gpu(M, T, sizes)
        ctables = [ndarray((bsz, w)) for w in widths]
        calls[f"core G={G}"] = (core, core_call(core, ndarray((bsz,)), ndarray((bsz,)), ctables), True)
        if G == 2:
            vs = VllmStepPlanner(M, T, [16, 16], [32, 32])
            same = [tables[0]] * 2
            calls["vLLM G=2, one table object for both"] = (vs, vllm_call(vs, idx, qsl, nct, same, nbs), True)
        calls[f"vLLM G={G}, new idx/qsl objects every call"] = (
            vp,
            fresh(
                lambda vp=vp, t=tables, nb=nbs, nct=nct: vllm_call(vp, ndarray((bsz,)), ndarray((bsz + 1,)), nct, t, nb)
            ),
            False,
        )
        calls[f"core G={G}, new dec/q objects every call"] = (
            core,
            fresh(lambda c=core, t=ctables: core_call(c, ndarray((bsz,)), ndarray((bsz,)), t)),
            False,
        )
        # VllmStepPlanner.bind(): the request state bound once, the batch checked every launch
        vb = VllmStepPlanner(M, T, sizes, widths)
        bound = vb.bind(nct, tables, nbs)
        calls[f"vLLM G={G}, bind(): launch, new idx/qsl objects every call"] = (
            vb,
            fresh(lambda b=bound: bound_call(b, ndarray((bsz,)), ndarray((bsz + 1,)))),
            False,
        )
        calls[f"vLLM G={G}, bind(): launch, the same idx/qsl objects"] = (
            vb,
            bound_call(bound, idx, qsl),
            False,
        )
    modes = (True,) if only_memo else (True, False)
    samples = {(k, on): [] for on in modes for k in calls if on or calls[k][2]}
    for _ in range(repeats):
        for (k, on), v in samples.items():
            pl, fn, _ = calls[k]
            pl.memoize_checks = on
            if not on:
                pl._memo = None
            v.append(per_call_us(fn, n, 1)[0])
    for pl, _fn, _ in calls.values():
        pl.memoize_checks = True
    rows = {
        (k if "bind()" in k else f"{k}: compute(), {'memo' if on else 'no memo'}"): (statistics.median(v), v)
        for (k, on), v in samples.items()
    }
    best = {key: min(v) for key, v in samples.items()}
    for on in modes:
        for G in (1, 2):
            label = f"vLLM - core, G={G}, {'memo' if on else 'no memo'} (best, us)"
            diff = best[(f"vLLM G={G}", on)] - best[(f"core G={G}", on)]
            rows[label] = (diff, [diff])
    return rows


def vllm_new_paths(ndarray, bsz, n, repeats) -> dict:
    """The vLLM step's host paths for an engine that passes two ints, or fresh slices every step:
    ``bind(state, idx_mapping=buffer, query_start_loc=buffer)`` then ``launch(num_reqs,
    num_reqs_padded, stream)``; and (with torch installed) ``bind(state).launch(slices)`` and
    ``compute(slices, state)`` with torch CPU tensors posing as device -1's (the torch batch check
    built with ``require_cuda=False``: the two ``is_cuda`` reads of the real check are not timed),
    8 sets of fresh slices of two persistent buffers taken in turn, the stream an int handle or a
    torch stream object new at every call (a stand-in of ``torch.cuda.Stream`` with ``cuda_stream``;
    8 made beforehand, in turn). One and two groups, interleaved sample by sample."""
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.engines.vllm_bound import torch_batch_check

    try:
        import torch
    except ImportError:
        torch = None
    M, T, stream = max(bsz, 1), 256, 0x1234
    calls = {}

    class Stream:  # torch.cuda.Stream's stand-in: a new object per torch.cuda.current_stream() call
        def __init__(self, h):
            self.cuda_stream = h

    Stream.__module__ = "torch.cuda.streams"
    for G in (1, 2):
        sizes, widths = [16, 64][:G], [32, 8][:G]
        nct, tables, nbs = ndarray((M,)), [ndarray((M, w)) for w in widths], ndarray((G, M))
        pb = VllmStepPlanner(M, T, sizes, widths)
        bb = pb.bind(nct, tables, nbs, idx_mapping=ndarray((M,)), query_start_loc=ndarray((M + 1,)))
        calls[f"vLLM G={G}, bind(batch buffers): launch(num_reqs, num_reqs_padded), stream=handle"] = lambda b=bb: (
            b.launch(bsz, bsz, stream)
        )
        objects = itertools.cycle([Stream(stream) for _ in range(8)])
        calls[f"vLLM G={G}, bind(batch buffers): launch(num_reqs, num_reqs_padded), torch stream object"] = (
            lambda b=bb, c=objects: b.launch(bsz, bsz, next(c))
        )
        if torch is None:
            continue
        ibuf, qbuf = torch.zeros(M, dtype=torch.int32), torch.zeros(M + 1, dtype=torch.int32)
        fast = torch_batch_check(M, -1, torch.int32, torch.int64, require_cuda=False)
        key = (torch.Tensor, torch.Tensor)
        bound = VllmStepPlanner(M, T, sizes, widths).bind(nct, tables, nbs)
        bound._fast_checks[key] = fast
        pc = VllmStepPlanner(M, T, sizes, widths)
        for _ in range(2):  # two checked calls over the state: compute() binds it for fresh batch objects
            pc.compute(ndarray((bsz,)), ndarray((bsz + 1,)), nct, tables, nbs, bsz, stream=stream)
        pc._state_bound._fast_checks[key] = fast
        for label, obj in (("bind(): launch", bound), ("compute()", pc)):
            slices = itertools.cycle([(ibuf[:bsz], qbuf[: bsz + 1]) for _ in range(8)])
            streams = itertools.cycle([Stream(stream) for _ in range(8)])
            if obj is bound:
                fn = lambda o=obj, c=slices: o.launch(*next(c), bsz, stream=stream)  # noqa: E731
                fs = lambda o=obj, c=slices, s=streams: o.launch(*next(c), bsz, stream=next(s))  # noqa: E731
            else:
                st = (nct, tables, nbs)
                fn = lambda o=obj, c=slices, st=st: o.compute(*next(c), *st, bsz, stream=stream)  # noqa: E731
                fs = lambda o=obj, c=slices, s=streams, st=st: o.compute(  # noqa: E731
                    *next(c), *st, bsz, stream=next(s)
                )
            calls[f"vLLM G={G}, {label}, fresh torch slices, stream=handle"] = fn
            calls[f"vLLM G={G}, {label}, fresh torch slices, torch stream object"] = fs
    if torch is not None:
        ibuf, qbuf = torch.zeros(M, dtype=torch.int32), torch.zeros(M + 1, dtype=torch.int32)
        calls["torch alone: 2 slices (the engine's cost, no kvaddr call)"] = lambda: (ibuf[:bsz], qbuf[: bsz + 1])
    samples = {k: [] for k in calls}
    for fn in calls.values():
        per_call_us(fn, min(n, 500), 1)
    for _ in range(repeats):
        for k, fn in calls.items():
            samples[k].append(per_call_us(fn, n, 1)[0])
    return {k: (statistics.median(v), v) for k, v in samples.items()}


def load_tree_as(tree: str, name: str = "kvaddr_base"):
    """Another checkout's ``kvaddr`` package (``tree``: its repository root, e.g. ``git archive REV |
    tar -x -C DIR``) importable as ``name`` beside this one: copied to a temporary directory with its
    ``kvaddr`` imports renamed. Call after install_fake_cupy(); returns the package module."""
    import importlib
    import re
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="kvaddr_ab_"))
    shutil.copytree(Path(tree) / "kvaddr", root / name)
    pattern = re.compile(r"\b(from|import) kvaddr\b|\"kvaddr\.")
    for f in (root / name).rglob("*.py"):
        text = f.read_text()
        f.write_text(pattern.sub(lambda m: m.group(0).replace("kvaddr", name), text))
    sys.path.insert(0, str(root))
    pkg = importlib.import_module(name)
    dev = importlib.import_module(f"{name}.device")
    loader = importlib.import_module(f"{name}.kernel_loader")
    dev._checked[:] = [sys.modules["cupy"], 1]
    fake_loader(loader)
    return pkg


def ab_tree(tree: str, ndarray, bsz: int, n: int, repeats: int) -> dict:
    """compute() of the vLLM step and of the core step from another checkout (``tree``, e.g. the
    commit before a change) against this one, in one process, interleaved sample by sample: the
    memo hit (the same objects), new batch objects every call (8 sets in turn; the ``next()`` and
    star call of the harness cost about 0.5 us of these rows, in both trees), the memo off; and
    this tree's ``bind()`` launch. One and two groups."""
    import importlib

    load_tree_as(tree)
    base_vllm = importlib.import_module("kvaddr_base.engines.vllm").VllmStepPlanner
    base_core = importlib.import_module("kvaddr_base.planner").StepPlanner
    from kvaddr.engines.vllm import VllmStepPlanner
    from kvaddr.planner import StepPlanner

    M, T, stream = max(bsz, 1), 256, 0x1234
    calls = {}
    for G in (1, 2):
        sizes, widths = [16, 64][:G], [32, 8][:G]
        nct, tables, nbs = ndarray((M,)), [ndarray((M, w)) for w in widths], [ndarray((M,)) for _ in range(G)]
        sets = [(ndarray((bsz,)), ndarray((bsz + 1,))) for _ in range(8)]
        csets = [(ndarray((bsz,)), ndarray((bsz,))) for _ in range(8)]
        ctables = [ndarray((bsz, w)) for w in widths]
        for tag, V, C in (("before", base_vllm, base_core), ("after", VllmStepPlanner, StepPlanner)):
            hit, new, off = (V(M, T, sizes, widths) for _ in range(3))
            off.memoize_checks = False
            chit, cnew = C(M, T, sizes), C(M, T, sizes)
            cyc, ccyc = itertools.cycle(sets), itertools.cycle(csets)
            i0, q0 = sets[0]
            calls[f"{tag}: vLLM G={G} compute(), memo hit"] = lambda p=hit, i0=i0, q0=q0, a=(nct, tables, nbs): (
                p.compute(i0, q0, *a, bsz, stream=stream)
            )
            calls[f"{tag}: vLLM G={G} compute(), new objects"] = lambda p=new, c=cyc, a=(nct, tables, nbs): p.compute(
                *next(c), *a, bsz, stream=stream
            )
            calls[f"{tag}: vLLM G={G} compute(), no memo"] = lambda p=off, i0=i0, q0=q0, a=(nct, tables, nbs): (
                p.compute(i0, q0, *a, bsz, stream=stream)
            )
            calls[f"{tag}: core G={G} compute(), memo hit"] = lambda p=chit, d=csets[0], t=ctables: p.compute(
                *d, t, stream=stream
            )
            calls[f"{tag}: core G={G} compute(), new objects"] = lambda p=cnew, c=ccyc, t=ctables: p.compute(
                *next(c), t, stream=stream
            )
        bound = VllmStepPlanner(M, T, sizes, widths).bind(nct, tables, nbs)
        bcyc = itertools.cycle(sets)
        calls[f"after: vLLM G={G} bind() launch, new objects"] = lambda b=bound, c=bcyc: b.launch(
            *next(c), bsz, stream=stream
        )
        calls[f"after: vLLM G={G} bind() launch, the same objects"] = lambda b=bound, s=sets[0]: b.launch(
            *s, bsz, stream=stream
        )
    samples = {k: [] for k in calls}
    for fn in calls.values():
        per_call_us(fn, min(n, 500), 1)
    for _ in range(repeats):
        for k, fn in calls.items():
            samples[k].append(per_call_us(fn, n, 1)[0])
    return {k: (statistics.median(v), v) for k, v in samples.items()}


def dispatch_floor(torch, n, repeats) -> tuple:
    """``torch.ops.<lib>.step.default`` with kvaddr's schema and a no-op Python kernel: what
    torch's dispatcher alone costs per call of the op on this host (CPU tensors)."""
    from kvaddr.torch.ops import SCHEMA

    lib = torch.library.Library("kvaddr_host_bench", "DEF")
    lib.define(SCHEMA)
    lib.impl("step", lambda *a: None, "CPU")
    op = torch.ops.kvaddr_host_bench.step.default
    d = torch.zeros(4, dtype=torch.int32)
    args = (d, d, [d], [64, 64], d, d, d, d, d, d, torch.zeros(4, dtype=torch.int64))
    result = per_call_us(lambda: op(*args), n, repeats)
    lib._destroy()
    return result


def ab_ops(torch, ops, bufs, tdec, tq, ttab, n, repeats) -> dict:
    """The op through torch's dispatcher with its real CUDA kernel body (registered for CPU on a scratch
    library, launch faked): the old schema (``kvaddr::step``, 11 arguments) against the packed one
    (``kvaddr::step_into``, 5 arguments), and ``kvaddr.torch.step`` on the packed one; interleaved
    sample by sample."""
    lib = torch.library.Library("kvaddr_host_ab", "DEF")
    lib.define(ops.SCHEMA)
    lib.define(ops.SCHEMA_INTO)
    lib.define(ops.SCHEMA_INTO_TABLES)
    lib.impl("step", ops._step_cuda, "CPU")
    lib.impl("step_into", ops._into_cuda, "CPU")
    lib.impl("step_into.tables", ops._into_tables_cuda, "CPU")
    for name in ("step", "step_into", "step_into.tables"):
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    ns = torch.ops.kvaddr_host_ab
    old, one, many = ns.step.default, ns.step_into.default, ns.step_into.tables
    tables, sizes, outs, st, lay = [ttab], bufs.block_sizes, bufs.outputs_args, bufs.storage, bufs.layout
    real = ops._op_one, ops._op_tables
    ops._op_one, ops._op_tables = one, many  # kvaddr.torch.step on the scratch ops
    fns = {
        "torch op, old schema (step, 11 args): dispatcher + CUDA body": lambda: old(tdec, tq, tables, sizes, *outs),
        "torch op step_into (5 args): dispatcher + CUDA body": lambda: one(tdec, tq, ttab, st, lay),
        "torch op step_into.tables (5 args): dispatcher + CUDA body": lambda: many(tdec, tq, tables, st, lay),
        "kvaddr.torch.step (step_into + cached views)": lambda: ops.step(tdec, tq, ttab, bufs),
    }
    samples = {k: [] for k in fns}
    try:
        for fn in fns.values():
            per_call_us(fn, n, 1)
        for _ in range(repeats):
            for k, fn in fns.items():
                samples[k].append(per_call_us(fn, n, 1)[0])
    finally:
        ops._op_one, ops._op_tables = real
        lib._destroy()
    return {k: (statistics.median(v), v) for k, v in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=25, help="samples")
    ap.add_argument("--bsz", type=int, default=64)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--ab",
        metavar="VALIDATION_PY",
        help="also time compute() with this other kvaddr/validation.py, interleaved with the current one "
        "(e.g. git show a17b426:kvaddr/validation.py > /tmp/old.py; --ab /tmp/old.py)",
    )
    ap.add_argument(
        "--vllm-only", action="store_true", help="only the vLLM step against the core step (memo and no memo)"
    )
    ap.add_argument(
        "--ab-tree",
        metavar="DIR",
        help="only compute() (vLLM and core) from another checkout against this one, interleaved in one "
        "process, plus bind() (e.g. mkdir /tmp/base && git archive 37e2a4c | tar -x -C /tmp/base; --ab-tree /tmp/base)",
    )
    args = ap.parse_args(argv)

    noop = install_fake_cupy()
    bsz = args.bsz
    planner, ndarray = planner_without_gpu(max(bsz, 1), 256, [64, 64])
    dec, q, table = ndarray((bsz,)), ndarray((bsz,)), ndarray((bsz, 32))
    stream = 0x1234
    rows = {}
    if args.ab_tree:
        return _print(ab_tree(args.ab_tree, ndarray, bsz, args.n, args.repeats), args)
    rows.update(vllm_vs_core(ndarray, bsz, args.n, args.repeats))
    rows.update(vllm_new_paths(ndarray, bsz, args.n, args.repeats))
    if args.vllm_only:
        return _print(rows, args)
    rows["launchKernel stand-in (no-op, 11 args)"] = per_call_us(
        lambda: noop(0xF00, 1, 1, 1, 256, 1, 1, 0, stream, 0, 0), args.n, args.repeats
    )
    rows["compute() (full checks), stream=handle"] = per_call_us(
        lambda: planner.compute(dec, q, table, stream=stream), args.n, args.repeats
    )
    rows["compute() (full checks), stream=None"] = per_call_us(
        lambda: planner.compute(dec, q, table), args.n, args.repeats
    )
    tables2 = [table, table]
    rows["compute(), two tables (one list)"] = per_call_us(
        lambda: planner.compute(dec, q, tables2, stream=stream), args.n, args.repeats
    )
    rows.update(ab_memo(planner, dec, q, table, stream, args.n, args.repeats))
    if args.ab:
        rows.update(ab_compute(args.ab, planner, dec, q, table, stream, args.n, args.repeats))
    bound = planner.bind(dec, q, table, stream=stream) if hasattr(planner, "bind") else None
    if bound is not None:
        rows["BoundStep.launch(bsz)"] = per_call_us(lambda: bound.launch(bsz), args.n, args.repeats)
    try:
        import torch

        from kvaddr.torch import StepBuffers, ops
    except ImportError:
        torch = None
    if torch is not None:
        fake_loader(ops.kernel_loader)
        bufs = StepBuffers(max(bsz, 1), 256, [64, 64], device="cpu")
        tdec = torch.zeros(bsz, dtype=torch.int32)
        tq = torch.ones(bsz, dtype=torch.int32)
        ttab = torch.zeros(bsz, 32, dtype=torch.int32)
        tables = [ttab]
        sizes = [64, 64]
        outs = bufs.outputs_args
        # the CUDA kernel's Python, on CPU tensors (device index None; raw stream faked)
        ops._raw_stream = lambda dev: stream
        ops._state["multi_device"] = False
        from kvaddr import bound_step, validation

        def describe_cpu_as_cuda(name, x):  # CPU tensors pass as device 0's
            if isinstance(x, torch.Tensor):
                return validation._torch_info(x)._replace(device=0)
            return validation.describe(name, x)

        bound_step.describe = describe_cpu_as_cuda
        cuda_impl = ops._step_cuda
        rows["torch op CUDA kernel body, remembered args"] = per_call_us(
            lambda: cuda_impl(tdec, tq, tables, sizes, *outs), args.n, args.repeats
        )
        rows["torch op step_into CUDA kernel body, remembered args"] = per_call_us(
            lambda: ops._into_cuda(tdec, tq, ttab, bufs.storage, bufs.layout), args.n, args.repeats
        )
        rows.update(ab_ops(torch, ops, bufs, tdec, tq, ttab, args.n, args.repeats))
        rows["torch dispatcher alone (old schema, no-op kernel)"] = dispatch_floor(torch, args.n, args.repeats)
        ops.set_debug(True)
        rows["torch op CUDA kernel body, debug (full checks)"] = per_call_us(
            lambda: cuda_impl(tdec, tq, tables, sizes, *outs), args.n // 4, args.repeats
        )
        ops.set_debug(False)
    return _print(rows, args)


def _print(rows: dict, args) -> int:
    width = max(len(k) for k in rows)
    print(f"{'path':<{width}}  host us/call: median, best of {args.repeats} samples of {args.n} calls")
    for k, (med, samples) in rows.items():
        print(f"{k:<{width}}  {med:8.3f}  {min(samples):8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {k: {"median_us": m, "best_us": min(s), "samples_us": s} for k, (m, s) in rows.items()}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
