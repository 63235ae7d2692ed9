"""Replaying a trace step by step: check every strategy, time every strategy.

For each good step line of a trace (:mod:`kvaddr.traces.format`), in order, holding one
step at a time:

1. the step is padded to a *captured shape*, as a serving engine pads a batch
   to one of its CUDA-graph sizes: requests to the next power of two (the
   extra rows are idle requests, ``seq_lens_this_time = 0``), the capacity C
   to the next power of two of its tokens, and the block-table width to a
   power of two that only grows over the replay (the widest row so far);
2. the NumPy reference computes its addressing; a step whose addresses are bad
   (a token past its request's block list, a negative block id) is a bad line:
   reported with its line number and skipped;
3. every strategy runs the step; its outputs are compared element for element
   with the reference (every ``check_every``-th step, by default every step),
   and the first difference stops the replay (:class:`~kvaddr.measure.correctness.CheckFailed`,
   exit status 1) before any time is reported;
4. each strategy's time on the step is recorded (one sample per strategy and
   step): on the CPU, host wall time of the NumPy strategy; on a GPU, the GPU
   time of one replay of the strategy's CUDA graph for the step's shape
   (graph mode), and the host wall time and GPU time of an eager call
   (eager mode, every ``eager_every``-th step, since a per-layer eager step
   costs milliseconds of host time).

A GPU replayer keeps, per captured shape, static input buffers, the
strategies and their graphs (one-block only on shapes of at most 1024 rows;
:func:`replay_trace` counts the steps it left out) (captured once, after an eager run that is
checked; replays then read the new step's inputs from the same buffers).
Shapes are kept in a least-recently-used cache of :data:`MAX_SHAPES`, so
memory stays bounded.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvaddr.errors import AddressingError, EnvironmentProblem
from kvaddr.measure.correctness import CheckFailed, poison
from kvaddr.measure.profile_run import call_checked, check_outputs, step_fn
from kvaddr.reference import step_addressing
from kvaddr.strategies.names import STRATEGY_NAMES, not_run_reason
from kvaddr.traces.format import BadLine, padded_inputs
from kvaddr.traces.report import ReplayStats

#: Smallest padded request count, token capacity and table width.
MIN_ROWS, MIN_CAPACITY, MIN_WIDTH = 1, 8, 8
#: Captured shapes a replayer keeps (least recently used ones are dropped).
MAX_SHAPES = 64


def bucket(n: int, lo: int = 1) -> int:
    """The next power of two >= max(n, lo)."""
    n = max(int(n), lo, 1)
    return 1 << (n - 1).bit_length()


class CpuReplayer:
    """The NumPy strategies (:mod:`kvaddr.strategies.cpu`), host wall time per step.

    Parameters
    ----------
    num_layers : int
    block_sizes : sequence of int
        B of each cache.
    """

    device = "cpu"
    modes = ("eager",)

    def __init__(self, num_layers: int, block_sizes):
        try:
            from kvaddr.strategies import cpu as cpu_strategies
        except Exception as exc:
            raise EnvironmentProblem(f"cannot load kvaddr.strategies.cpu ({type(exc).__name__}: {exc})") from exc
        self.module = cpu_strategies
        self.num_layers = num_layers
        self.block_sizes = list(block_sizes)
        self._strategies: OrderedDict = OrderedDict()
        self.names = list(cpu_strategies.STRATEGY_NAMES)

    def _get(self, rows: int, capacity: int) -> dict:
        key = (rows, capacity)
        got = self._strategies.get(key)
        if got is not None:
            self._strategies.move_to_end(key)
            return got
        got = {}
        for name in self.names:
            if not_run_reason(name, rows) is not None:
                continue  # one-block beyond 1024 requests: counted by replay_trace
            got[name] = call_checked(
                name,
                "construction",
                lambda name=name: self.module.make_strategy(
                    name, max_requests=rows, capacity=capacity, block_sizes=self.block_sizes, num_layers=self.num_layers
                ),
            )
        self._strategies[key] = got
        if len(self._strategies) > MAX_SHAPES:
            self._strategies.popitem(last=False)
        return got

    def run(self, batch, ref, check: bool, eager: bool, where: str) -> dict:
        """Run (and time) every strategy on one padded step; compare with ``ref`` if ``check``."""
        strategies = self._get(batch.bsz, batch.capacity)
        args = (batch.seq_lens_decoder, batch.seq_lens_this_time, batch.tables_arg, batch.seq_lens_encoder)
        clock = time.perf_counter
        times = {}
        for name, s in strategies.items():
            step = step_fn(s)
            t0 = clock()
            out = call_checked(name, where, step, *args)
            t1 = clock()
            times[name] = (t1 - t0) * 1e6
            if check:
                check_outputs(name, where, out, ref)
        return {("eager", "host"): times}

    def shapes(self) -> int:
        return len(self._strategies)


class _Shape:
    """One captured shape on the GPU: input buffers, strategies, graphs."""

    def __init__(self):
        self.inputs = None
        self.tables = []
        self.strategies = {}
        self.graphs = {}
        self.last_out = {}
        self.names = []  # the strategies this shape runs (one-block not beyond 1024 rows)


class CudaReplayer:
    """The CuPy strategies (:mod:`kvaddr.strategies.gpu`) on one GPU, graph and eager mode.

    Parameters
    ----------
    num_layers : int
    block_sizes : sequence of int
    modes : sequence of str
        ``"graph"`` and/or ``"eager"``.
    device_id : int
    """

    device = "cuda"

    def __init__(self, num_layers: int, block_sizes, modes=("eager", "graph"), device_id: int = 0):
        try:
            import cupy

            from kvaddr import kernel_loader
            from kvaddr.errors import KernelCompileError
            from kvaddr.measure.timing import GpuTimer, measurement_stream
            from kvaddr.strategies import gpu as gpu_strategies
        except Exception as exc:
            raise EnvironmentProblem(f"cannot load kvaddr's GPU strategies ({type(exc).__name__}: {exc})") from exc
        self.cupy, self.module = cupy, gpu_strategies
        self.device_id = device_id
        self.num_layers = num_layers
        self.block_sizes = list(block_sizes)
        self.modes = tuple(modes)
        self.names = list(gpu_strategies.STRATEGY_NAMES)
        self._shapes: OrderedDict = OrderedDict()
        self.captures = 0
        try:
            with cupy.cuda.Device(device_id):
                kernel_loader.get_module(device_id)
                self.stream = measurement_stream(device_id)
                self.timer = GpuTimer(self.stream)
                self._events = [(self.timer.event(), self.timer.event()) for _ in self.names]
        except KernelCompileError as exc:
            raise EnvironmentProblem(str(exc)) from exc
        except Exception as exc:
            raise EnvironmentProblem(f"cannot set up CUDA device {device_id} ({type(exc).__name__}: {exc})") from exc

    def shapes(self) -> int:
        return len(self._shapes)

    def _new_shape(self, batch, ref, where: str) -> _Shape:
        """Buffers for the step's shape, the strategies, an eager check of each, and their graphs."""
        cp, stream = self.cupy, self.stream
        rows, capacity = batch.bsz, batch.capacity
        shape = _Shape()
        distinct = batch.distinct_tables()
        shape.tables = [cp.empty(t.shape, dtype=t.dtype) for t in distinct]
        index = {id(t): i for i, t in enumerate(distinct)}
        per_cache = [shape.tables[index[id(t)]] for t in batch.block_tables]
        tables_arg = per_cache[0] if len(shape.tables) == 1 else per_cache
        shape.inputs = (
            cp.empty(rows, dtype=batch.seq_lens_decoder.dtype),
            cp.empty(rows, dtype=batch.seq_lens_this_time.dtype),
            tables_arg,
            cp.empty(rows, dtype=batch.seq_lens_encoder.dtype),
        )
        self._upload(shape, batch)
        shape.names = [n for n in self.names if not_run_reason(n, rows) is None]
        for name in shape.names:
            s = call_checked(
                name,
                "construction",
                lambda name=name: self.module.make_strategy(
                    name,
                    max_requests=rows,
                    capacity=capacity,
                    block_sizes=self.block_sizes,
                    num_layers=self.num_layers,
                    device=self.device_id,
                ),
            )
            step = step_fn(s, stream)
            context = f"{where}, eager, new shape {rows} x {capacity}"
            out = call_checked(name, context, step, *shape.inputs)
            stream.synchronize()
            check_outputs(name, context, out, ref)
            if hasattr(s, "check"):
                call_checked(name, f"{where}, device error record", s.check, stream)
            shape.strategies[name] = s
            shape.last_out[name] = out
            if "graph" in self.modes:
                try:
                    graph, gout = self.timer.capture(step, shape.inputs)
                except Exception as exc:
                    raise CheckFailed(
                        f"strategy {name!r} (graph capture, {where}) raised {type(exc).__name__}: {exc}"
                    ) from exc
                self.captures += 1
                shape.graphs[name] = (graph, gout)
        return shape

    def _upload(self, shape: _Shape, batch) -> None:
        stream = self.stream
        dec, q, _, enc = shape.inputs
        dec.set(batch.seq_lens_decoder, stream=stream)
        q.set(batch.seq_lens_this_time, stream=stream)
        enc.set(batch.seq_lens_encoder, stream=stream)
        for dev, host in zip(shape.tables, batch.distinct_tables()):
            dev.set(host, stream=stream)

    def _get(self, batch, ref, where: str) -> tuple:
        key = (batch.bsz, batch.capacity, tuple(t.shape[1] for t in batch.distinct_tables()), _layout(batch))
        shape = self._shapes.get(key)
        if shape is not None:
            self._shapes.move_to_end(key)
            self._upload(shape, batch)
            return shape, False
        shape = self._new_shape(batch, ref, where)
        self._shapes[key] = shape
        if len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)
        return shape, True

    def run(self, batch, ref, check: bool, eager: bool, where: str) -> dict:
        """Run (and time) every strategy on one padded step; compare with ``ref`` if ``check``."""
        cp, stream, timer = self.cupy, self.stream, self.timer
        times = {}
        with cp.cuda.Device(self.device_id), stream:
            shape, _new = self._get(batch, ref, where)
            if "graph" in self.modes:
                if check:
                    for name in shape.names:
                        poison(shape.graphs[name][1])
                for (e0, e1), name in zip(self._events, shape.names):
                    e0.record(stream)
                    shape.graphs[name][0].launch(stream)
                    e1.record(stream)
                self._events[len(shape.names) - 1][1].synchronize()  # the last pair recorded
                times[("graph", "gpu")] = {
                    name: timer.elapsed_us(e0, e1) for (e0, e1), name in zip(self._events, shape.names)
                }
                if check:
                    for name in shape.names:
                        check_outputs(name, f"{where}, graph replay", shape.graphs[name][1], ref)
            if eager and "eager" in self.modes:
                host, gpu = {}, {}
                clock = time.perf_counter
                for (e0, e1), name in zip(self._events, shape.names):
                    s = shape.strategies[name]
                    if check:
                        poison(shape.last_out[name])
                    step = step_fn(s, stream)
                    t0 = clock()
                    e0.record(stream)
                    out = call_checked(name, f"{where}, eager", step, *shape.inputs)
                    e1.record(stream)
                    e1.synchronize()
                    t1 = clock()
                    host[name] = (t1 - t0) * 1e6
                    gpu[name] = timer.elapsed_us(e0, e1)
                    shape.last_out[name] = out
                    if check:
                        check_outputs(name, f"{where}, eager", out, ref)
                times[("eager", "host")] = host
                times[("eager", "gpu")] = gpu
        return times


def _layout(batch) -> tuple:
    """Which distinct table each cache uses (part of a captured shape's key)."""
    ids = {}
    return tuple(ids.setdefault(id(t), len(ids)) for t in batch.block_tables)


def replay_trace(
    reader,
    replayer,
    block_sizes,
    *,
    check_every: int = 1,
    eager_every: int = 1,
    max_steps: int | None = None,
    progress=None,
) -> ReplayStats:
    """Replay every step line of ``reader`` on ``replayer``.

    Parameters
    ----------
    reader : kvaddr.traces.format.TraceReader
    replayer : CpuReplayer or CudaReplayer
    block_sizes : sequence of int
        B of each cache.
    check_every, eager_every : int
        Compare outputs with the reference on every n-th replayed step; run
        eager mode on every n-th replayed step when graph mode runs too
        (graph mode, or eager mode alone, runs every step).
    max_steps : int, optional
        Stop after this many replayed steps.
    progress : callable, optional
        ``progress(stats)`` after each line.

    Returns
    -------
    ReplayStats

    Raises
    ------
    CheckFailed
        A strategy's output differs from the reference (or a strategy raised).
    """
    stats = ReplayStats(getattr(replayer, "names", STRATEGY_NAMES))
    block_sizes = list(block_sizes)
    # Eager mode is thinned out only when graph mode runs every step; alone, it runs every step.
    thin_eager = "graph" in getattr(replayer, "modes", ())
    width = MIN_WIDTH
    for item in reader:
        stats.lines += 1
        if isinstance(item, BadLine):
            stats.bad(item.line, item.reason)
            if progress is not None:
                progress(stats)
            continue
        if item.active == 0:
            stats.idle_steps += 1
            continue
        try:
            item.tables_for(len(block_sizes))
        except ValueError as exc:
            stats.bad(item.line, str(exc))
            continue
        width = max(width, bucket(item.width, MIN_WIDTH))
        rows, capacity = bucket(item.bsz, MIN_ROWS), bucket(item.tokens, MIN_CAPACITY)
        batch = padded_inputs(item, rows, capacity, width, block_sizes)
        ref = step_addressing(
            batch.seq_lens_decoder,
            batch.seq_lens_this_time,
            batch.tables_arg,
            block_sizes,
            capacity,
            seq_lens_encoder=batch.seq_lens_encoder,
        )
        if ref.error_mask:
            stats.bad(item.line, str(AddressingError(ref.error_mask, ref.error_key)))
            if progress is not None:
                progress(stats)
            continue
        n = stats.steps
        check = n % check_every == 0
        where = f"trace line {item.line}" + (f" (step {item.step})" if item.step is not None else "")
        times = replayer.run(batch, ref.outputs, check, not thin_eager or n % eager_every == 0, where)
        for name in stats.strategies:
            reason = not_run_reason(name, rows)
            if reason is not None:  # the replayer did not run it (one-block beyond 1024 requests)
                stats.not_run_step(name, reason)
        stats.add(item.active, item.tokens, item.prefill_requests > 0, (rows, capacity, width), times, check)
        if progress is not None:
            progress(stats)
        if max_steps is not None and stats.steps >= max_steps:
            break
    return stats
