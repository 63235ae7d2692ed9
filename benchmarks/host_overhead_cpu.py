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
    def noop(*_args):
        return None

    driver = types.SimpleNamespace(launchKernel=noop)
    stream = types.SimpleNamespace(ptr=0)
    cuda = types.ModuleType("cupy.cuda")
    cuda.driver = driver
    cuda.get_current_stream = lambda: stream
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0)
    cp = types.ModuleType("cupy")
    cp.cuda = cuda
    sys.modules["cupy"], sys.modules["cupy.cuda"], sys.modules["cupy.cuda.driver"] = cp, cuda, driver
    return noop


def planner_without_gpu(max_requests, capacity, block_sizes):
    """A StepPlanner whose __init__ ran on stand-ins: the Python path of compute() is real."""
    from kvaddr import kernel_loader
    from kvaddr.planner import StepPlanner

    ndarray = fake_cupy_array_class()
    p = object.__new__(StepPlanner)
    consts = kernel_loader.constants()
    p.max_requests, p.capacity, p.block_sizes = max_requests, capacity, tuple(block_sizes)
    p.num_caches, p.position_dtype, p.device = len(block_sizes), np.dtype(np.int64), 0
    p._threads, p._tile = consts["KV_THREADS"], consts["KV_TILE"]
    p._num_chunks = -(-capacity // consts["KV_TOKENS"])
    p._max_tiles = 0
    p._fn = types.SimpleNamespace(ptr=0xF00)
    for name, shape, dt in (
        ("cu_seqlens_q", (max_requests + 1,), np.int32),
        ("num_tokens", (), np.int32),
        ("batch_id_per_token", (capacity,), np.int32),
        ("position_ids", (capacity,), np.int64),
        ("seq_lens_kv", (max_requests,), np.int32),
        ("slot_mapping", (len(block_sizes), capacity), np.int64),
    ):
        setattr(p, name, ndarray(shape, dt))
    P = p._params = kernel_loader.StepParams()
    P.capacity, P.num_caches = capacity, len(block_sizes)
    p._p_tables, p._p_strides, p._p_widths = P.block_tables, P.table_stride, P.max_blocks
    p._launcher = kernel_loader.Launcher(p._fn, P, by_value=True)
    # v9 (the default): the small-batch kernel's launcher, as StepPlanner.use_kernel("v9") sets it
    p._one_max_bsz, p._one_threads = min(consts["KV_SB_THREADS"], max_requests), consts["KV_SB_THREADS"]
    p._one_launcher = kernel_loader.Launcher(types.SimpleNamespace(ptr=0xF01), P, by_value=True)
    p._views = {}
    return p, ndarray


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
    samples = {"compute(), --ab validation.py": [], "compute(), this validation.py": []}

    def fn():
        planner.compute(dec, q, table, stream=stream)

    for _ in range(repeats * 3):
        for label, mod in zip(samples, (other, validation)):
            for name in names:
                setattr(planner_module, name, getattr(mod, name))
            samples[label].append(per_call_us(fn, n, 1)[0])
    for name in names:
        setattr(planner_module, name, getattr(validation, name))
    return {label: (statistics.median(v), v) for label, v in samples.items()}


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
    args = ap.parse_args(argv)

    noop = install_fake_cupy()
    bsz = args.bsz
    planner, ndarray = planner_without_gpu(max(bsz, 1), 256, [64, 64])
    dec, q, table = ndarray((bsz,)), ndarray((bsz,)), ndarray((bsz, 32))
    stream = 0x1234
    rows = {}
    rows["launchKernel stand-in (no-op, 11 args)"] = per_call_us(
        lambda: noop(0xF00, 1, 1, 1, 256, 1, 1, 0, stream, 0, 0), args.n, args.repeats
    )
    rows["compute() (full checks), stream=handle"] = per_call_us(
        lambda: planner.compute(dec, q, table, stream=stream), args.n, args.repeats
    )
    rows["compute() (full checks), stream=None"] = per_call_us(
        lambda: planner.compute(dec, q, table), args.n, args.repeats
    )
    rows["compute(), two tables"] = per_call_us(
        lambda: planner.compute(dec, q, [table, table], stream=stream), args.n, args.repeats
    )
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
        ops.kernel_loader.get_function = lambda name, dev=None: types.SimpleNamespace(ptr=0xF00)
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
        ops.set_debug(True)
        rows["torch op CUDA kernel body, debug (full checks)"] = per_call_us(
            lambda: cuda_impl(tdec, tq, tables, sizes, *outs), args.n // 4, args.repeats
        )
        ops.set_debug(False)

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
