"""The profile run: check every strategy against the reference, then time it.

Two backends share one flow per batch shape:

1. draw the shape's input sets (:mod:`kvaddr.measure.workload`) and compute the
   reference (:func:`kvaddr.reference.step_addressing`) of each;
2. build every strategy, run it on every input set twice (the second time
   after filling its output buffers with a sentinel, so an element a call
   fails to write is caught) and compare each output element for element with
   the reference; graph mode also replays each captured graph once and
   compares again;
3. only then time each strategy and the launch floor (:mod:`kvaddr.measure.timing`).

Any difference raises :class:`~kvaddr.measure.correctness.CheckFailed` before a single
time is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from kvaddr.constants import MODES
from kvaddr.errors import EnvironmentProblem
from kvaddr.measure.correctness import CheckFailed, compare, poison
from kvaddr.measure.timing import FLOOR, Budget, Measurement, measure_cpu, measurement_stream
from kvaddr.measure.workload import Batch, Workload, make_input_sets
from kvaddr.reference import step_addressing


@dataclass
class ShapeResult:
    """Everything measured for one batch size.

    Attributes
    ----------
    batch : int
        Requests per step.
    capacity : int
        Tokens per step (C).
    batches : list of Batch
        The input sets.
    strategies : list of str
        Strategy names in report order.
    measurements : list of Measurement
    checks : dict
        What the correctness check covered (JSON-ready).
    """

    batch: int
    capacity: int
    batches: list
    strategies: list
    measurements: list = field(default_factory=list)
    checks: dict = field(default_factory=dict)


class Progress:
    """Progress callbacks; the default does nothing."""

    def start(self, label: str) -> None:  # pragma: no cover - trivial
        pass

    def advance(self) -> None:  # pragma: no cover - trivial
        pass


def references(batches: Sequence[Batch]) -> list:
    """The reference outputs of each input set; the workload must be error free."""
    refs = []
    for i, b in enumerate(batches):
        r = step_addressing(
            b.seq_lens_decoder,
            b.seq_lens_this_time,
            b.tables_arg,
            list(b.block_sizes),
            b.capacity,
            seq_lens_encoder=b.seq_lens_encoder,
        )
        if r.error_mask:
            raise CheckFailed(
                f"the generated batch (batch {b.bsz}, input set {i}) has bad addresses "
                f"(reference error bits {r.error_mask}); this is a kvaddr workload bug"
            )
        refs.append(r.outputs)
    return refs


def _call_checked(name: str, context: str, fn: Callable, *args):
    try:
        return fn(*args)
    except CheckFailed:
        raise
    except Exception as exc:
        raise CheckFailed(f"strategy {name!r} ({context}) raised {type(exc).__name__}: {exc}") from exc


def _check(name: str, context: str, got, expected) -> None:
    mismatch = compare(name, context, got, expected)
    if mismatch is not None:
        raise CheckFailed(mismatch.message())


def _empty_step(*_args) -> None:
    """The CPU path's launch floor: one empty Python call per step."""
    return None


class CpuBackend:
    """The NumPy strategies (:mod:`kvaddr.strategies.cpu`), eager only, host clock."""

    device = "cpu"
    modes = ("eager",)

    def __init__(self):
        try:
            from kvaddr.strategies import cpu as cpu_strategies
        except Exception as exc:
            raise EnvironmentProblem(f"cannot load kvaddr.strategies.cpu ({type(exc).__name__}: {exc})") from exc
        self.module = cpu_strategies

    def units(self, num_strategies: int, modes: Sequence[str]) -> int:
        return num_strategies + 1

    def prepare(self, workload: Workload, batch: int, modes: Sequence[str]) -> PreparedShape:
        """Draw the input sets, build every strategy and check it against the reference."""
        batches = make_input_sets(workload, batch)
        refs = references(batches)
        names = list(self.module.STRATEGY_NAMES)
        result = ShapeResult(batch, batches[0].capacity, batches, names)
        inputs = [(b.seq_lens_decoder, b.seq_lens_this_time, b.tables_arg, b.seq_lens_encoder) for b in batches]
        strategies = {}
        for name in names:
            s = _call_checked(
                name,
                "construction",
                lambda name=name: self.module.make_strategy(
                    name,
                    max_requests=batch,
                    capacity=result.capacity,
                    block_sizes=list(workload.block_sizes),
                    num_layers=workload.num_layers,
                ),
            )
            for i, (args, ref) in enumerate(zip(inputs, refs)):
                context = f"CPU, batch {batch}, input set {i}"
                out = _call_checked(name, context, _step_fn(s), *args)
                poison(out)
                out = _call_checked(name, context, _step_fn(s), *args)
                _check(name, context, out, ref)
            _call_checked(name, "error check", getattr(s, "check", _empty_step))
            strategies[name] = s
        result.checks = {
            "status": "passed",
            "input_sets": len(batches),
            "strategies": names,
            "modes": ["eager"],
            "sentinel_refill": True,
            "graph_replays": False,
        }
        return PreparedShape(result, strategies, inputs, refs)

    def measure(self, prepared: PreparedShape, modes: Sequence[str], budget: Budget, progress: Progress) -> ShapeResult:
        """Time every strategy and the floor (one empty Python call per step)."""
        result, inputs = prepared.result, prepared.inputs
        for name, s in prepared.strategies.items():
            progress.start(f"batch {result.batch}: {name} (CPU)")
            result.measurements.append(
                measure_cpu(name, _step_fn(s), inputs, budget, getattr(s, "launches_per_step", None))
            )
            progress.advance()
        progress.start(f"batch {result.batch}: launch floor (CPU)")
        result.measurements.append(measure_cpu(FLOOR, _empty_step, inputs, budget, 1))
        progress.advance()
        return result


def _step_fn(strategy, stream=None) -> Callable:
    if stream is None:

        def step(dec, q, tables, enc):
            return strategy.step(dec, q, tables, seq_lens_encoder=enc)
    else:

        def step(dec, q, tables, enc):
            return strategy.step(dec, q, tables, seq_lens_encoder=enc, stream=stream)

    return step


class CudaBackend:
    """The CuPy strategies (:mod:`kvaddr.strategies.gpu`) on one GPU, eager and graph mode.

    Parameters
    ----------
    device_id : int
        CUDA device ordinal.
    """

    device = "cuda"
    modes = MODES

    def __init__(self, device_id: int = 0):
        try:
            import cupy

            from kvaddr import kernel_loader
            from kvaddr.errors import KernelCompileError
            from kvaddr.strategies import gpu as gpu_strategies
        except Exception as exc:
            raise EnvironmentProblem(f"cannot load kvaddr's GPU strategies ({type(exc).__name__}: {exc})") from exc
        self.cupy, self.kernels, self.module = cupy, kernel_loader, gpu_strategies
        self.device_id = device_id
        try:
            with cupy.cuda.Device(device_id):
                kernel_loader.get_module(device_id)
                self.empty = kernel_loader.get_function("kvaddr_empty", device_id)
                self.stream = measurement_stream(device_id)
        except KernelCompileError as exc:
            raise EnvironmentProblem(str(exc)) from exc
        except Exception as exc:
            raise EnvironmentProblem(f"cannot set up CUDA device {device_id} ({type(exc).__name__}: {exc})") from exc

    def units(self, num_strategies: int, modes: Sequence[str]) -> int:
        return (num_strategies + 1) * len(modes)

    def _to_device(self, batches: Sequence[Batch]) -> list:
        cp = self.cupy
        out = []
        for b in batches:
            dev_tables = {id(t): cp.asarray(t) for t in b.distinct_tables()}
            tables = [dev_tables[id(t)] for t in b.block_tables]
            tables_arg = tables[0] if len(dev_tables) == 1 else tables
            out.append(
                (
                    cp.asarray(b.seq_lens_decoder),
                    cp.asarray(b.seq_lens_this_time),
                    tables_arg,
                    cp.asarray(b.seq_lens_encoder),
                )
            )
        return out

    def prepare(self, workload: Workload, batch: int, modes: Sequence[str]) -> PreparedShape:
        """Draw the input sets, copy them to the GPU, build every strategy and check it eagerly."""
        cp, stream = self.cupy, self.stream
        with cp.cuda.Device(self.device_id), stream:
            batches = make_input_sets(workload, batch)
            refs = references(batches)
            names = list(self.module.STRATEGY_NAMES)
            result = ShapeResult(batch, batches[0].capacity, batches, names)
            inputs = self._to_device(batches)
            stream.synchronize()
            strategies = {}
            for name in names:
                s = _call_checked(
                    name,
                    "construction",
                    lambda name=name: self.module.make_strategy(
                        name,
                        max_requests=batch,
                        capacity=result.capacity,
                        block_sizes=list(workload.block_sizes),
                        num_layers=workload.num_layers,
                        device=self.device_id,
                    ),
                )
                step = _step_fn(s, stream)
                for i, (args, ref) in enumerate(zip(inputs, refs)):
                    context = f"eager, batch {batch}, input set {i}"
                    out = _call_checked(name, context, step, *args)
                    stream.synchronize()
                    poison(out)
                    out = _call_checked(name, context, step, *args)
                    stream.synchronize()
                    _check(name, context, out, ref)
                if hasattr(s, "check"):
                    _call_checked(name, "device error record", s.check, stream)
                strategies[name] = s
        result.checks = {
            "status": "passed",
            "input_sets": len(batches),
            "strategies": names,
            "modes": list(modes),
            "sentinel_refill": True,
            "graph_replays": "graph" in modes,
        }
        return PreparedShape(result, strategies, inputs, refs)

    def measure(self, prepared: PreparedShape, modes: Sequence[str], budget: Budget, progress: Progress) -> ShapeResult:
        """Time every strategy and the floor (one empty kernel per step) in each mode."""
        from kvaddr.measure.timing import GpuTimer

        cp, stream = self.cupy, self.stream
        result, inputs, refs = prepared.result, prepared.inputs, prepared.refs
        batch = result.batch

        def floor_step(*_args):
            self.empty((1,), (1,), (), 0, stream)

        with cp.cuda.Device(self.device_id), stream:
            timer = GpuTimer(stream)
            for mode in modes:
                for name, s in prepared.strategies.items():
                    progress.start(f"batch {batch}: {name} ({mode})")
                    if mode == "eager":
                        result.measurements.extend(
                            timer.measure_eager(
                                name, _step_fn(s, stream), inputs, budget, lambda s=s: s.launches_per_step
                            )
                        )
                    else:
                        result.measurements.append(self._measure_graph(timer, name, s, inputs, refs, batch, budget))
                    progress.advance()
                progress.start(f"batch {batch}: launch floor ({mode})")
                if mode == "eager":
                    result.measurements.extend(timer.measure_eager(FLOOR, floor_step, inputs, budget, lambda: 1))
                else:
                    graph, _ = timer.capture(floor_step, ())
                    copies = timer.copies_for(graph)
                    multi = timer.capture_copies(floor_step, [()], copies)
                    result.measurements.append(timer.measure_graph(FLOOR, [multi], budget, 1, copies))
                    del graph, multi
                progress.advance()
        return result

    def _measure_graph(self, timer, name, strategy, inputs, refs, batch, budget) -> Measurement:
        step = _step_fn(strategy, self.stream)
        graphs, outs = [], []
        for i, args in enumerate(inputs):
            try:
                graph, out = timer.capture(step, args)
            except Exception as exc:
                raise CheckFailed(
                    f"strategy {name!r} (graph capture, batch {batch}, input set {i}) raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            graphs.append(graph)
            outs.append(out)
        for i, (graph, out, ref) in enumerate(zip(graphs, outs, refs)):
            poison(out)
            context = f"graph replay, batch {batch}, input set {i}"
            _call_checked(name, context, timer.replay, graph)
            _check(name, context, out, ref)
        # Time graphs that hold many steps each, cycling through the input sets.
        copies = timer.copies_for(graphs[0])
        copies = max(len(inputs), copies - copies % len(inputs))
        try:
            multi = timer.capture_copies(step, inputs, copies)
        except Exception as exc:
            raise CheckFailed(
                f"strategy {name!r} (graph capture of {copies} steps, batch {batch}) raised {type(exc).__name__}: {exc}"
            ) from exc
        del graphs, outs
        m = timer.measure_graph(name, [multi], budget, strategy.launches_per_step, copies)
        del multi
        return m


@dataclass
class PreparedShape:
    """A batch size whose strategies are built and checked, ready to be timed."""

    result: ShapeResult
    strategies: dict
    inputs: list
    refs: list


def run_profile(
    backend,
    workload: Workload,
    batches: Sequence[int],
    modes: Sequence[str],
    budget: Budget,
    progress: Progress | None = None,
    on_checked: Callable[[], None] | None = None,
) -> list:
    """Check every batch size, then time them; one :class:`ShapeResult` per size.

    Every strategy of every shape passes the eager check before any timing
    starts (graph replays are checked right after their capture, before they
    are timed). ``on_checked`` is called between the two phases.
    """
    progress = progress or Progress()
    prepared = [backend.prepare(workload, b, modes) for b in batches]
    if on_checked is not None:
        on_checked()
    return [backend.measure(p, modes, budget, progress) for p in prepared]
