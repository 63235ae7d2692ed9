"""Measuring a step: statistics, the CPU timer and the GPU timers (eager and graph).

Every measurement yields samples in microseconds per step. A sample is the mean
over a block of ``steps_per_sample`` consecutive steps that rotate through the
input sets (so repeats do not just hit L2); blocks are sized so that one lasts
about :data:`TARGET_BLOCK_S` (at least one step, at most :data:`MAX_BLOCK`).
Sampling stops once the time budget is spent and at least ``min_samples`` were
taken, or at ``max_samples``.

Clocks
------
``host`` (CPU path and GPU eager mode)
    ``time.perf_counter`` from before the block's first call to after the
    host has waited for its last step (the CUDA stream synchronised), divided by
    the block's steps: what a Python serving loop pays per step. The CPU path
    times each step on its own (``steps_per_sample = 1``).
``gpu`` (GPU eager and graph modes)
    CUDA events recorded on the measuring stream around the block, divided by
    its steps: the stream's timeline from the block's first to its last kernel,
    including the gaps in which the GPU waits for the host to launch.

Warm-up
-------
Kernels are compiled, buffers allocated and every step run (the correctness
check) before any sample; each measurement then starts with a warm-up block
that also sizes the sample blocks.

The GPU code runs on a non-default stream of its own (``cupy.cuda.Stream(
non_blocking=True)``), one per device for the whole process
(:func:`measurement_stream`), never destroyed: on an H200 (driver 580.159.04),
once a stream that has run work is destroyed, every later CUDA-graph kernel node
in the process costs about 0.17 us more (an empty node 0.52 -> 0.69 us), so a
second profile on a fresh stream would time slower than the first. Graph mode first captures one whole step per strategy and
input set (``L x G`` chains for the per-layer strategies) and checks each replay
against the reference; it then captures as many steps as make about
GRAPH_TARGET_US of work into one graph, cycling through the input sets, and
times its replays (``graph.launch(stream)``), dividing by the steps it holds, so
that graph-launch overhead does not swamp a one-microsecond step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvaddr.constants import FLOOR as FLOOR  # re-exported: the floor row's name

#: Aim for sample blocks of about this many seconds.
TARGET_BLOCK_S = 1e-3
#: At most this many steps in one sample.
MAX_BLOCK = 256
#: Fewest samples per measurement, whatever the budget.
MIN_SAMPLES = 10
#: Most samples per measurement (keeps the JSON report small).
MAX_SAMPLES = 2000
#: GPU graph mode: samples queued between two host synchronisations.
GRAPH_SAMPLES_PER_ROUND = 16
#: Graph mode captures this much work (us) per timed graph, as many steps as fit ...
GRAPH_TARGET_US = 200.0
#: ... but no more than this many steps per graph.
GRAPH_MAX_COPIES = 256


_STREAMS: dict = {}


def measurement_stream(device_id: int):
    """The process's measuring stream on CUDA device ``device_id`` (created once, never destroyed).

    Every profile, sweep and trace replay in a process times on this one
    non-blocking stream. Destroying a stream that has run work makes every
    later graph kernel node in the CUDA context slower (measured on an H200:
    an empty node 0.52 us before, 0.69 us after, on any stream, for the rest
    of the process), so a profiler that made and dropped a stream per run
    would measure its second run slower than its first.
    """
    stream = _STREAMS.get(device_id)
    if stream is None:
        import cupy

        with cupy.cuda.Device(device_id):
            stream = _STREAMS[device_id] = cupy.cuda.Stream(non_blocking=True)
    return stream


@dataclass(frozen=True)
class Summary:
    """Order statistics of a measurement's samples (microseconds per step)."""

    median: float
    q25: float
    q75: float
    iqr: float
    mean: float
    min: float
    max: float
    n: int

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def summarize(samples: Sequence[float]) -> Summary:
    """Median, quartiles (linear interpolation), IQR, mean, range and count."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        raise ValueError("samples must hold at least one value, got none")
    q25, med, q75 = np.percentile(a, [25, 50, 75])
    return Summary(
        float(med),
        float(q25),
        float(q75),
        float(q75 - q25),
        float(a.mean()),
        float(a.min()),
        float(a.max()),
        int(a.size),
    )


@dataclass
class Measurement:
    """The samples of one strategy in one mode on one clock.

    Attributes
    ----------
    strategy : str
        A strategy name, or ``"floor"`` (one empty launch per step).
    mode : str
        ``"eager"`` or ``"graph"``.
    clock : str
        ``"host"`` or ``"gpu"``.
    launches_per_step : int or None
        Kernel launches (CPU: NumPy operations) per step, as the strategy reports.
    steps_per_sample : int
    samples_us : list of float
        Microseconds per step, one per sample, in the order taken.
    """

    strategy: str
    mode: str
    clock: str
    launches_per_step: int | None
    steps_per_sample: int
    samples_us: list = field(default_factory=list)

    @property
    def summary(self) -> Summary:
        return summarize(self.samples_us)


@dataclass(frozen=True)
class Budget:
    """When to stop sampling one measurement."""

    seconds: float = 1.0
    min_samples: int = MIN_SAMPLES
    max_samples: int = MAX_SAMPLES

    def done(self, n: int, started: float) -> bool:
        if n >= self.max_samples:
            return True
        return n >= self.min_samples and time.perf_counter() - started >= self.seconds


def block_size_for(step_seconds: float, num_sets: int) -> int:
    """Steps per sample: about TARGET_BLOCK_S long, a multiple of the input sets when > 1 set fits."""
    k = int(TARGET_BLOCK_S / step_seconds) if step_seconds > 0 else MAX_BLOCK
    k = max(1, min(MAX_BLOCK, k))
    if k >= num_sets:
        k -= k % num_sets
    return k


# ----------------------------------------------------------------------------- CPU


def measure_cpu(
    name: str, step: Callable, inputs: Sequence[tuple], budget: Budget, launches_per_step: int | None
) -> Measurement:
    """Time ``step(*inputs[i])`` with ``time.perf_counter``, one step per sample.

    Parameters
    ----------
    name : str
        Strategy name for the record.
    step : callable
        Runs one step; its return value is ignored.
    inputs : sequence of tuple
        Positional arguments of each input set, rotated.
    budget : Budget
    launches_per_step : int or None
    """
    clock = time.perf_counter
    n_sets = len(inputs)
    for args in inputs:  # warm-up
        step(*args)
    m = Measurement(name, "eager", "host", launches_per_step, 1)
    samples = m.samples_us
    started = clock()
    i = 0
    while not budget.done(len(samples), started):
        args = inputs[i % n_sets]
        t0 = clock()
        step(*args)
        t1 = clock()
        samples.append((t1 - t0) * 1e6)
        i += 1
    return m


# ----------------------------------------------------------------------------- GPU


class GpuTimer:
    """Eager and graph timing of step functions on one CUDA stream.

    Parameters
    ----------
    stream : cupy.cuda.Stream
        A non-default stream; every step must launch its work on it.
    """

    def __init__(self, stream):
        import cupy

        self.cupy = cupy
        self.stream = stream

    def event(self):
        """A new CUDA event on the current device (timing enabled)."""
        return self.cupy.cuda.Event()

    def elapsed_us(self, start, end) -> float:
        """Microseconds between two recorded events."""
        return self.cupy.cuda.get_elapsed_time(start, end) * 1e3

    # -- eager ---------------------------------------------------------------

    def measure_eager(
        self,
        name: str,
        step: Callable,
        inputs: Sequence[tuple],
        budget: Budget,
        launches_per_step: Callable[[], int | None],
    ) -> tuple:
        """Host wall time and GPU time per step of eager launches.

        Parameters
        ----------
        step : callable
            ``step(*inputs[i])`` launches one whole step on ``self.stream``
            (asynchronously).
        launches_per_step : callable
            Asked after the warm-up (some strategies learn it on their first step).

        Returns
        -------
        (Measurement, Measurement)
            The ``host`` and the ``gpu`` clock.
        """
        stream, clock = self.stream, time.perf_counter
        n_sets = len(inputs)
        start, end = self.event(), self.event()

        def run_block(k: int, first: int) -> tuple:
            t0 = clock()
            start.record(stream)
            for j in range(first, first + k):
                step(*inputs[j % n_sets])
            end.record(stream)
            end.synchronize()
            t1 = clock()
            return (t1 - t0) * 1e6 / k, self.elapsed_us(start, end) / k

        run_block(n_sets, 0)  # warm-up
        host_us, _ = run_block(n_sets, 0)
        k = block_size_for(host_us * 1e-6, n_sets)
        lps = launches_per_step()
        host = Measurement(name, "eager", "host", lps, k)
        gpu = Measurement(name, "eager", "gpu", lps, k)
        started = clock()
        i = 0
        while not budget.done(len(host.samples_us), started):
            h, g = run_block(k, i)
            host.samples_us.append(h)
            gpu.samples_us.append(g)
            i += k
        return host, gpu

    # -- graph ---------------------------------------------------------------

    def capture_copies(self, step: Callable, inputs: Sequence[tuple], copies: int):
        """Capture ``copies`` calls of ``step`` into ONE graph, cycling through the input sets.

        A graph replay then runs many steps back to back, so graph-launch overhead
        and its jitter are spread over ``copies`` steps, and consecutive steps read
        different inputs (not just L2 hits on one set).
        """
        stream = self.stream
        stream.synchronize()
        stream.begin_capture()
        try:
            with stream:
                for i in range(copies):
                    step(*inputs[i % len(inputs)])
        except BaseException:
            try:
                stream.end_capture()
            except Exception:
                pass
            raise
        return stream.end_capture()

    def copies_for(self, graph) -> int:
        """Steps to capture per timed graph: about GRAPH_TARGET_US of work, at most GRAPH_MAX_COPIES."""
        start, end = self.event(), self.event()
        self.replay(graph)
        start.record(self.stream)
        graph.launch(self.stream)
        end.record(self.stream)
        end.synchronize()
        us = max(self.elapsed_us(start, end), 1e-3)
        return int(max(1, min(GRAPH_MAX_COPIES, GRAPH_TARGET_US // us)))

    def capture(self, step: Callable, args: tuple):
        """Capture one call of ``step(*args)`` on the stream into a CUDA graph.

        Returns
        -------
        (cupy.cuda.graph.Graph, object)
            The graph and what the captured call returned (for a strategy,
            the :class:`~kvaddr.outputs.StepOutputs` views the graph writes).
        """
        stream = self.stream
        stream.synchronize()
        stream.begin_capture()
        try:
            with stream:
                result = step(*args)
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # the capture was invalidated; the step's error is the one to report
                pass
            raise
        graph = stream.end_capture()
        return graph, result

    def replay(self, graph) -> None:
        """Launch a captured graph once and wait for it."""
        graph.launch(self.stream)
        self.stream.synchronize()

    def measure_graph(
        self, name: str, graphs: Sequence, budget: Budget, launches_per_step: int | None, copies: int = 1
    ) -> Measurement:
        """GPU time per step of graph replays, rotating the graphs; each graph holds
        ``copies`` steps (see :meth:`capture_copies`).

        The host queues :data:`GRAPH_SAMPLES_PER_ROUND` samples of ``k`` replays
        each, with an event between samples, then waits for the round.
        """
        stream, clock = self.stream, time.perf_counter
        n = len(graphs)
        rounds = GRAPH_SAMPLES_PER_ROUND
        events = [self.event() for _ in range(rounds + 1)]

        for g in graphs:  # warm-up (uploads the graphs)
            g.launch(stream)
        t0 = clock()
        for g in graphs:
            g.launch(stream)
        stream.synchronize()
        k = block_size_for((clock() - t0) / n, n)
        m = Measurement(name, "graph", "gpu", launches_per_step, k)
        started = clock()
        i = 0
        while not budget.done(len(m.samples_us), started):
            want = min(rounds, budget.max_samples - len(m.samples_us))
            events[0].record(stream)
            for j in range(want):
                for _ in range(k):
                    graphs[i % n].launch(stream)
                    i += 1
                events[j + 1].record(stream)
            events[want].synchronize()
            m.samples_us.extend(self.elapsed_us(events[j], events[j + 1]) / (k * copies) for j in range(want))
        return m
