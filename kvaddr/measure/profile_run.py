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

Any difference raises :class:`~kvaddr.errors.CheckFailed` before a single
time is reported.

The API: a :class:`ProfileConfig` (every setting of ``kvaddr profile`` that
affects the run) and :func:`run`, which returns the report document
(docs/json-schema.md). ``kvaddr profile``, ``sweep`` and ``check`` all call
:func:`run`; ``check`` builds its config with :meth:`ProfileConfig.from_recorded`
from the options a report recorded.

``ProfileConfig(engine="vllm", ...)`` profiles the vLLM engine step instead:
:func:`run` hands it to :func:`kvaddr.measure.vllm_profile.run_vllm_profile`
(the one-launch step against the three launches, checked then timed per
shape, GPU only) and returns the ``kvaddr.profile.vllm`` report, with the
same options, settings, progress and envelope conventions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from kvaddr.attention_reference import normalize_attention
from kvaddr.constants import (
    INT32_MAX,
    MAX_CACHES,
    MAX_CONTEXT,
    MAX_TABLE_ENTRIES,
    MAX_TOKENS_PER_STEP,
    MODES,
    STRATEGY_NAMES,
)
from kvaddr.engines.vllm_config import VLLM_MAX_GROUPS
from kvaddr.errors import EnvironmentProblem, ProfileConfigError
from kvaddr.measure.correctness import CheckFailed, compare_outputs, poison
from kvaddr.measure.timing import FLOOR, Budget, Measurement, measure_cpu, measurement_stream
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES as VLLM_DEFAULT_SHAPES
from kvaddr.measure.vllm_workload import VllmWorkload, parse_shape
from kvaddr.measure.workload import DEFAULT_CONTEXT, DEFAULT_MODEL, PRESETS, Batch, Workload, make_input_sets
from kvaddr.reference import step_addressing
from kvaddr.strategies.names import not_run_reason


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
        Strategy names in report order (those run).
    measurements : list of Measurement
    checks : dict
        What the correctness check covered (JSON-ready).
    skipped : dict
        ``{strategy: reason}`` of the strategies that cannot run this batch
        (one-block beyond 1024 requests: "not run: one-block runs at most 1024 requests").
    """

    batch: int
    capacity: int
    batches: list
    strategies: list
    measurements: list = field(default_factory=list)
    checks: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)


def strategies_for(names: Sequence[str], batch: int) -> tuple[list, dict]:
    """``(names to run, {name: reason not run})`` for a batch of ``batch`` requests."""
    skipped = {n: r for n in names for r in [not_run_reason(n, batch)] if r is not None}
    return [n for n in names if n not in skipped], skipped


class Progress:
    """What a profile run tells its caller as it goes; the default says nothing.

    :func:`run` calls :meth:`note` for each status line, :meth:`begin` once
    with the number of work units (strategies and floors, times modes, times
    batch sizes) before the first, :meth:`start` and :meth:`advance` around
    each unit, and :meth:`end` when it stops (also on an error).
    """

    def note(self, message: str) -> None:  # pragma: no cover - trivial
        pass

    def begin(self, total: int) -> None:  # pragma: no cover - trivial
        pass

    def start(self, label: str) -> None:  # pragma: no cover - trivial
        pass

    def advance(self) -> None:  # pragma: no cover - trivial
        pass

    def end(self) -> None:  # pragma: no cover - trivial
        pass


def kv_indices_bound(batches: Sequence[Batch]) -> int:
    """The most ``kv_indices`` entries any cache needs in any of the input sets:
    max over sets and caches g of ``sum_b ceil(L_b / B_g)`` (at least 1). The profiler's
    default ``kv_indices_capacity``: every call writes all N entries, so a larger N
    would time pad writes, not the metadata."""
    import numpy as np

    best = 1
    for b in batches:
        L = np.maximum(b.seq_lens_decoder.astype(np.int64) + b.seq_lens_this_time.astype(np.int64), 0)
        for B in set(b.block_sizes):
            best = max(best, int(((L + B - 1) // B).sum()))
    return min(best, INT32_MAX)


@dataclass(frozen=True)
class AttentionSetting:
    """The attention outputs a run asks every strategy for (``groups`` empty: none)."""

    groups: tuple = ()
    kv_indices_capacity: int | None = None

    def capacity_for(self, batches: Sequence[Batch]) -> int | None:
        """N for these input sets: the given one, else :func:`kv_indices_bound` (flashinfer only)."""
        if "flashinfer" not in self.groups:
            return None
        return self.kv_indices_capacity or kv_indices_bound(batches)

    def strategy_kwargs(self, batches: Sequence[Batch]) -> dict:
        """``attention=`` / ``kv_indices_capacity=`` for make_strategy (empty when off)."""
        if not self.groups:
            return {}
        return {"attention": self.groups, "kv_indices_capacity": self.capacity_for(batches)}


def references(batches: Sequence[Batch], attention: AttentionSetting | None = None) -> list:
    """The reference outputs of each input set; the workload must be error free."""
    refs = []
    extra = attention.strategy_kwargs(batches) if attention is not None else {}
    for i, b in enumerate(batches):
        r = step_addressing(
            b.seq_lens_decoder,
            b.seq_lens_this_time,
            b.tables_arg,
            list(b.block_sizes),
            b.capacity,
            seq_lens_encoder=b.seq_lens_encoder,
            **extra,
        )
        if r.error_mask:
            raise CheckFailed(
                f"the generated batch (batch {b.bsz}, input set {i}) has bad addresses "
                f"(reference error bits {r.error_mask}); this is a kvaddr workload bug"
            )
        refs.append(r.outputs)
    return refs


def call_checked(name: str, context: str, fn: Callable, *args):
    """``fn(*args)``; any exception but CheckFailed becomes a CheckFailed naming the strategy and context."""
    try:
        return fn(*args)
    except CheckFailed:
        raise
    except Exception as exc:
        raise CheckFailed(f"strategy {name!r} ({context}) raised {type(exc).__name__}: {exc}") from exc


def check_outputs(name: str, context: str, got, expected) -> None:
    """Raise CheckFailed, naming the first difference, unless ``got`` equals the reference ``expected``."""
    mismatch = compare_outputs(name, context, got, expected)
    if mismatch is not None:
        raise CheckFailed(mismatch.message())


def _empty_step(*_args) -> None:
    """The CPU path's launch floor: one empty Python call per step."""
    return None


def open_shape(module, attention: AttentionSetting, workload: Workload, batch: int) -> tuple:
    """A batch shape's input sets, their references, the strategies to run and the empty result.

    Returns ``(batches, refs, names, result)``; the strategies ``module`` cannot run at this
    batch are recorded in ``result.skipped``.
    """
    batches = make_input_sets(workload, batch)
    refs = references(batches, attention)
    names, skipped = strategies_for(module.STRATEGY_NAMES, batch)
    return batches, refs, names, ShapeResult(batch, batches[0].capacity, batches, names, skipped=skipped)


def build_strategy(module, name: str, workload: Workload, result: ShapeResult, extra: dict):
    """``module.make_strategy`` for one shape, a failure reported as the strategy's construction error."""
    return call_checked(
        name,
        "construction",
        lambda: module.make_strategy(
            name,
            max_requests=result.batch,
            capacity=result.capacity,
            block_sizes=list(workload.block_sizes),
            num_layers=workload.num_layers,
            **extra,
        ),
    )


class CpuBackend:
    """The NumPy strategies (:mod:`kvaddr.strategies.cpu`), eager only, host clock."""

    device = "cpu"
    modes = ("eager",)

    def __init__(self, attention: AttentionSetting | None = None):
        self.attention = attention or AttentionSetting()
        try:
            from kvaddr.strategies import cpu as cpu_strategies
        except Exception as exc:
            raise EnvironmentProblem(f"cannot load kvaddr.strategies.cpu ({type(exc).__name__}: {exc})") from exc
        self.module = cpu_strategies

    def units(self, num_strategies: int, modes: Sequence[str]) -> int:
        return num_strategies + 1

    def prepare(self, workload: Workload, batch: int, modes: Sequence[str]) -> PreparedShape:
        """Draw the input sets, build every strategy and check it against the reference."""
        batches, refs, names, result = open_shape(self.module, self.attention, workload, batch)
        inputs = [(b.seq_lens_decoder, b.seq_lens_this_time, b.tables_arg, b.seq_lens_encoder) for b in batches]
        extra = self.attention.strategy_kwargs(batches)
        strategies = {}
        for name in names:
            s = build_strategy(self.module, name, workload, result, extra)
            for i, (args, ref) in enumerate(zip(inputs, refs)):
                context = f"CPU, batch {batch}, input set {i}"
                out = call_checked(name, context, step_fn(s), *args)
                poison(out)
                out = call_checked(name, context, step_fn(s), *args)
                check_outputs(name, context, out, ref)
            call_checked(name, "error check", getattr(s, "check", _empty_step))
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
                measure_cpu(name, step_fn(s), inputs, budget, getattr(s, "launches_per_step", None))
            )
            progress.advance()
        progress.start(f"batch {result.batch}: launch floor (CPU)")
        result.measurements.append(measure_cpu(FLOOR, _empty_step, inputs, budget, 1))
        progress.advance()
        return result


#: The eager row of the fused step's bound launch (GPU runs): ``StepPlanner.bind`` once per
#: input set, then ``BoundStep.launch()`` per step (no per-call checks). Not a strategy: no graph row.
BOUND_ROW = "fused (bound)"


def _bound_launch(bound) -> None:
    bound.launch()


def step_fn(strategy, stream=None) -> Callable:
    """``strategy.step`` as ``step(dec, q, tables, enc)`` (on ``stream`` when given)."""
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

    def __init__(self, device_id: int = 0, attention: AttentionSetting | None = None):
        self.attention = attention or AttentionSetting()
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
            batches, refs, names, result = open_shape(self.module, self.attention, workload, batch)
            inputs = self._to_device(batches)
            stream.synchronize()
            extra = dict(self.attention.strategy_kwargs(batches), device=self.device_id)
            strategies = {}
            for name in names:
                s = build_strategy(self.module, name, workload, result, extra)
                step = step_fn(s, stream)
                for i, (args, ref) in enumerate(zip(inputs, refs)):
                    context = f"eager, batch {batch}, input set {i}"
                    out = call_checked(name, context, step, *args)
                    stream.synchronize()
                    poison(out)
                    out = call_checked(name, context, step, *args)
                    stream.synchronize()
                    check_outputs(name, context, out, ref)
                if hasattr(s, "check"):
                    call_checked(name, "device error record", s.check, stream)
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
                                name, step_fn(s, stream), inputs, budget, lambda s=s: s.launches_per_step
                            )
                        )
                    else:
                        result.measurements.append(self._measure_graph(timer, name, s, inputs, refs, batch, budget))
                    progress.advance()
                if mode == "eager":
                    bound = self._bound_fused(prepared)
                    if bound is not None:
                        progress.start(f"batch {batch}: {BOUND_ROW} ({mode})")
                        result.measurements.extend(
                            timer.measure_eager(BOUND_ROW, _bound_launch, bound, budget, lambda: 1)
                        )
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

    def _bound_fused(self, prepared: PreparedShape) -> list | None:
        """The fused strategy's planner bound to each input set (``[(BoundStep,), ...]``),
        each bound launch checked against the reference; None without a bindable planner."""
        planner = getattr(prepared.strategies.get("fused"), "planner", None)
        if planner is None or not hasattr(planner, "bind"):
            return None
        stream, batch = self.stream, prepared.result.batch
        out = []
        for i, ((dec, q, tables, enc), ref) in enumerate(zip(prepared.inputs, prepared.refs)):
            context = f"eager bound launch, batch {batch}, input set {i}"
            bind = functools.partial(planner.bind, dec, q, tables, seq_lens_encoder=enc, stream=stream)
            bound = call_checked(BOUND_ROW, context, bind)
            poison(call_checked(BOUND_ROW, context, bound.launch))
            stream.synchronize()
            check_outputs(BOUND_ROW, context, call_checked(BOUND_ROW, context, bound.launch), ref)
            stream.synchronize()
            out.append((bound,))
        call_checked(BOUND_ROW, "device error record", planner.check, stream)
        return out

    def _measure_graph(self, timer, name, strategy, inputs, refs, batch, budget) -> Measurement:
        step = step_fn(strategy, self.stream)
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
            call_checked(name, context, timer.replay, graph)
            check_outputs(name, context, out, ref)
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


# ----------------------------------------------------------------------------- the profile-run API

#: Launch-mode settings: ``both`` (or None: the default) runs every mode the device has.
MODE_CHOICES = ("eager", "graph", "both")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
#: What a run profiles: ``core``, kvaddr's step strategies (the ``kvaddr.profile`` report); ``vllm``, the
#: one-launch vLLM step against vLLM's three-launch design (the ``kvaddr.profile.vllm`` report,
#: :mod:`kvaddr.measure.vllm_profile`; GPU only).
ENGINES = ("core", "vllm")
#: Context (``num_computed_tokens``) range of the vLLM engine's requests unless ``context`` is given.
VLLM_DEFAULT_CONTEXT = tuple(VllmWorkload().context)
#: Settings of one engine only; with the other engine they must keep their defaults (any other setting
#: applies to both). ``batches`` is the core engine's: ``kvaddr profile --engine vllm --batch N`` profiles
#: the shape ``decode:N`` (the command turns it into ``shapes``).
ENGINE_ONLY = {
    "core": (
        "batches",
        "prefill",
        "block_sizes",
        "layers",
        "caches",
        "model",
        "step_ms",
        "save_path",
        "workload_profile",
        "attention",
        "kv_indices_capacity",
    ),
    "vllm": ("shapes", "groups", "dcp", "dummy_fraction", "sliding_window", "num_blocks_mem"),
}

#: ``kind, lo, hi`` of each setting, checked by :meth:`ProfileConfig.validate` (and when read back from a
#: report by :meth:`ProfileConfig.from_recorded`). Kinds: ``ints`` (a non-empty list of int), ``range`` (``[lo,
#: hi]`` with lo <= hi), ``prefill`` (``[N, LEN]``), ``int``, ``float``, ``choice`` (lo is the choices),
#: ``shapes`` (a list of vLLM batch shapes, :func:`~kvaddr.measure.vllm_workload.parse_shape`), ``dcp``
#: (``[SIZE, RANK, INTERLEAVE]``).
SETTING_RULES = {
    "engine": ("choice", ENGINES, None),
    "batches": ("ints", 1, 1 << 20),
    "shapes": ("shapes", None, None),
    "context": ("range", 0, MAX_CONTEXT),
    "spec_tokens": ("int", 0, 64),
    "prefill": ("prefill", None, None),
    "block_sizes": ("ints", 1, 1 << 20),
    "groups": ("ints", 1, 1 << 20),
    "layers": ("int", 1, 4096),
    "caches": ("int", 1, MAX_CACHES),
    "model": ("choice", tuple(sorted(PRESETS)), None),
    "dcp": ("dcp", None, None),
    "dummy_fraction": ("float", 0.0, 8.0),
    "sliding_window": ("int", 0, MAX_CONTEXT),
    "num_blocks_mem": ("choice", ("device", "uva"), None),
    "mode": ("choice", MODE_CHOICES, None),
    "step_ms": ("float", 0.0, math.inf),
    "device": ("choice", DEVICE_CHOICES, None),
    "seed": ("int", 0, 2**63 - 1),
    "budget": ("float", 0.0, 600.0),
    "input_sets": ("int", 1, 64),
    "attention": ("attention_groups", None, None),
    "kv_indices_capacity": ("int", 1, INT32_MAX),
}

#: Settings recorded in the report's ``options`` that do not change the run: where the report was written
#: and the workload profile the settings came from (its values are recorded as the settings they set).
RECORDED_ONLY = ("json_path", "save_path", "workload_profile")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checked_setting(name: str, value):
    """``value`` of setting ``name`` in its canonical form (tuples for lists); ProfileConfigError if invalid."""
    kind, lo, hi = SETTING_RULES[name]

    def bad(what: str):
        return ProfileConfigError(f"{name} {what}, got {value!r}", fields=(name,))

    if kind == "ints":
        if not isinstance(value, (list, tuple)) or not value or not all(_is_int(v) for v in value):
            raise bad("must be a non-empty list of integers")
        if not all(lo <= v <= hi for v in value):
            raise bad(f"must hold integers in [{lo}, {hi}]")
        return tuple(int(v) for v in value)
    if kind in ("range", "prefill"):
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) for v in value):
            raise bad("must be a pair of integers")
        a, b = int(value[0]), int(value[1])
        if kind == "range" and not (0 <= a <= b <= hi):
            raise bad(f"must be [LO, HI] with 0 <= LO <= HI <= {hi}")
        if kind == "prefill" and not (0 <= a <= 1 << 20 and 1 <= b <= MAX_TOKENS_PER_STEP):
            raise bad(f"must be [N, LEN] with 0 <= N <= {1 << 20} and 1 <= LEN <= {MAX_TOKENS_PER_STEP}")
        return a, b
    if kind == "attention_groups":
        try:
            return normalize_attention(value)
        except (TypeError, ValueError):
            raise bad("must name attention outputs among flashinfer, varlen, page_table") from None
    if kind == "shapes":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad("must be a list of shapes (decode:N, mixed:N:T)")
        try:
            return tuple(parse_shape(v).name for v in value)
        except ValueError as exc:
            raise ProfileConfigError(str(exc), fields=(name,)) from None
    if kind == "dcp":
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(_is_int(v) for v in value):
            raise bad("must be [SIZE, RANK, INTERLEAVE], three integers")
        size, rank, interleave = (int(v) for v in value)
        if not 1 <= size <= 1024:
            raise bad("must have SIZE (ranks) in [1, 1024]")
        if not 0 <= rank < size:
            raise bad(f"must have RANK in [0, SIZE - 1] = [0, {size - 1}]")
        if not 1 <= interleave <= 1 << 20:
            raise bad(f"must have INTERLEAVE in [1, {1 << 20}]")
        return size, rank, interleave
    if kind == "int":
        if not _is_int(value) or not lo <= value <= hi:
            raise bad(f"must be an integer in [{lo}, {hi}]")
        return int(value)
    if kind == "float":
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise bad("must be a finite number")
        if not (lo < value <= hi if name == "step_ms" else lo <= value <= hi):
            raise bad(f"must be in {'(' if name == 'step_ms' else '['}{lo:g}, {hi:g}]")
        return float(value)
    if value not in lo:
        raise bad(f"must be one of {', '.join(lo)}")
    return value


@dataclass(frozen=True)
class ProfileConfig:
    """Every setting of a profile run (the options of ``kvaddr profile`` that affect it).

    The defaults are the command's. ``None`` means "the model's" for
    ``block_sizes``, ``layers`` and ``caches``, "every mode the device has"
    for ``mode``, and "the engine's" for ``context``.

    Attributes
    ----------
    engine : {"core", "vllm"}
        ``core``: kvaddr's step strategies, per batch size (``kvaddr.profile``
        report). ``vllm``: the one-launch vLLM step against vLLM's three-launch
        design, per shape (``kvaddr.profile.vllm`` report; GPU only). Settings
        of one engine only (:data:`ENGINE_ONLY`) must keep their defaults with
        the other.
    batches : tuple of int
        [core] Batch sizes (requests per step), each profiled in turn.
    shapes : tuple of str
        [vllm] Batch shapes, ``decode:N`` or ``mixed:N:T`` (canonical names);
        empty: :data:`~kvaddr.measure.vllm_workload.DEFAULT_SHAPES` (filled in
        at construction).
    context : (int, int) or None
        Context of decode requests (vllm: ``num_computed_tokens`` of every
        request), drawn log-uniformly from ``[lo, hi]``; None: the engine's
        (core :data:`~kvaddr.measure.workload.DEFAULT_CONTEXT`, vllm
        :data:`VLLM_DEFAULT_CONTEXT`; filled in at construction).
    spec_tokens : int
        [core] Speculative tokens per decode request (each runs ``1 + K``).
    prefill : (int, int) or None
        [core] ``(N, LEN)``: N of each batch's requests are chunked-prefill requests of LEN tokens.
    block_sizes : tuple of int or None
        [core] One B for every cache, or one per cache.
    groups : tuple of int
        [vllm] Block size of each KV-cache group (1 to 4 groups).
    layers, caches : int or None
        [core] Transformer layers; paged caches per layer.
    model : str
        [core] Model preset (:data:`kvaddr.measure.workload.PRESETS`).
    dcp : (int, int, int)
        [vllm] Decode context parallelism ``(size, rank, interleave)``; the first
        group is sharded. ``(1, 0, 1)``: off.
    dummy_fraction : float
        [vllm] Dummy (CUDA-graph padding) requests added per real request.
    sliding_window : int
        [vllm] Sliding-window reach of the last group (needs 2+ groups; 0: none).
    num_blocks_mem : {"device", "uva"}
        [vllm] Where ``num_blocks`` lives: device memory, or pinned host memory read through UVA
        (vLLM's layout).
    mode : {"eager", "graph", "both"} or None
        GPU launch mode(s); the CPU path has eager only.
    step_ms : float or None
        [core] Also express each saving as a share of a step of this many ms.
    device : {"auto", "cuda", "cpu"}
    seed : int
    budget : float
        Seconds of sampling per strategy and mode.
    input_sets : int
        Distinct batches per batch size (shape), rotated while timing.
    attention : tuple of str
        Attention outputs every strategy also produces (docs/attention.md): any of
        ``flashinfer``, ``varlen``, ``page_table``; the fused step writes them in its
        one launch, the baselines build them the way engines do. Empty: none.
    kv_indices_capacity : int or None
        N for ``flashinfer``; None: the workload's bound (:func:`kv_indices_bound`).
    json_path, save_path, workload_profile : str or None
        Recorded in the report's ``options`` only (:data:`RECORDED_ONLY`); :func:`run` writes nothing.
        ``save_path`` and ``workload_profile`` are core settings.
    option_order : tuple of str
        Settings to list first, in this order, in the report's ``options``
        (the order they were given on the command line); not a setting.

    Adding a setting: add a field here (with the command's default), a rule
    to :data:`SETTING_RULES` (and to :data:`ENGINE_ONLY` when it applies to
    one engine only), use it in :func:`run` (or :meth:`workload`), and
    add the click option (same name) to ``kvaddr profile``; it is then
    recorded in every report and replayed by ``kvaddr check``.
    """

    engine: str = "core"
    batches: tuple = (64,)
    shapes: tuple = ()
    context: tuple | None = None
    spec_tokens: int = 0
    prefill: tuple | None = None
    block_sizes: tuple | None = None
    groups: tuple = (16,)
    layers: int | None = None
    caches: int | None = None
    model: str = DEFAULT_MODEL
    dcp: tuple = (1, 0, 1)
    dummy_fraction: float = 0.0
    sliding_window: int = 0
    num_blocks_mem: str = "device"
    mode: str | None = None
    step_ms: float | None = None
    json_path: str | None = None
    save_path: str | None = None
    device: str = "auto"
    seed: int = 0
    budget: float = 1.0
    input_sets: int = 4
    attention: tuple = ()
    kv_indices_capacity: int | None = None
    workload_profile: str | None = None
    option_order: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        # the engine's defaults for the settings whose default depends on it
        if self.context is None:
            object.__setattr__(self, "context", VLLM_DEFAULT_CONTEXT if self.engine == "vllm" else DEFAULT_CONTEXT)
        if self.engine == "vllm" and not self.shapes:
            object.__setattr__(self, "shapes", VLLM_DEFAULT_SHAPES)

    @classmethod
    def field_names(cls) -> tuple:
        """Every setting, in the order reports record them (unless :attr:`option_order` says otherwise)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "option_order")

    @classmethod
    def from_recorded(cls, options: dict, **overrides) -> ProfileConfig:
        """The config that repeats a run from the ``options`` its report recorded.

        Null values and names this kvaddr does not know (see
        :meth:`unknown_options`) are left out, so they take the defaults;
        ``overrides`` (e.g. ``device=``, ``budget=``) replace recorded values.
        Every value is checked (:meth:`validate`). The new run records its
        options in the order of ``options`` (then the overrides').

        Raises
        ------
        ProfileConfigError
            A recorded value this kvaddr cannot run, naming the setting.
        """
        names = set(cls.field_names())
        values = {k: v for k, v in (options or {}).items() if k in names and v is not None}
        given = [k for k in values if k not in overrides] + list(overrides)
        values.update(overrides)
        for name in list(values):
            if name in SETTING_RULES and values[name] is not None:
                values[name] = _checked_setting(name, values[name])
        config = cls(**values, option_order=("workload_profile", *given))
        config.validate()
        return config

    @classmethod
    def settings_of(cls, engine: str) -> tuple:
        """The settings that apply to ``engine`` (the others' only ones left out), in report order."""
        other = [n for e, names in ENGINE_ONLY.items() if e != engine for n in names]
        return tuple(n for n in cls.field_names() if n not in other)

    @classmethod
    def unknown_options(cls, options: dict) -> list:
        """Names in recorded ``options`` that are no setting of this kvaddr."""
        names = set(cls.field_names())
        return [k for k in (options or {}) if k not in names]

    def recorded_options(self) -> dict:
        """The report's ``options`` object: every setting of this run's engine (:meth:`settings_of`), lists
        for tuples (:attr:`option_order` first)."""
        names = self.settings_of(self.engine)
        order = [n for n in dict.fromkeys(self.option_order) if n in names]
        order += [n for n in names if n not in order]
        return {k: (list(v) if isinstance(v, tuple) else v) for k in order for v in [getattr(self, k)]}

    def num_caches(self) -> int:
        preset = PRESETS[self.model]
        if self.caches is not None:
            return self.caches
        return len(self.block_sizes) if self.block_sizes and len(self.block_sizes) > 1 else preset.num_caches

    def workload(self) -> Workload:
        """The workload the settings describe (model defaults filled in)."""
        preset = PRESETS[self.model]
        num_caches = self.num_caches()
        sizes = self.block_sizes if self.block_sizes else (preset.block_size,)
        return Workload(
            model=self.model,
            num_layers=self.layers if self.layers is not None else preset.num_layers,
            num_caches=num_caches,
            block_sizes=tuple(sizes) if len(sizes) > 1 else tuple(sizes) * num_caches,
            context=tuple(self.context),
            spec_tokens=self.spec_tokens,
            prefill=None if self.prefill is None else tuple(self.prefill),
            seed=self.seed,
            input_sets=self.input_sets,
        )

    def validate(self) -> None:
        """Check every setting and the ones that depend on each other.

        Raises
        ------
        ProfileConfigError
            Naming the setting(s) at fault (``fields``).
        """
        for name in SETTING_RULES:
            value = getattr(self, name)
            if value is not None or name in ("engine", "batches", "context", "model", "device"):
                _checked_setting(name, value)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for engine, names in ENGINE_ONLY.items():
            if engine == self.engine:
                continue
            off = [n for n in names if _canonical(n, getattr(self, n)) != _canonical(n, defaults[n])]
            if off:
                raise ProfileConfigError(
                    f"{', '.join(off)} {'applies' if len(off) == 1 else 'apply'} to the {engine} engine only "
                    f"(this run's engine is {self.engine})",
                    fields=tuple(off),
                )
        if self.engine == "vllm":
            self._validate_vllm()
            return
        batches, num_caches = self.batches, self.num_caches()
        sizes = self.block_sizes if self.block_sizes else (PRESETS[self.model].block_size,)
        if self.prefill is not None:
            n, _ = self.prefill
            too_small = [b for b in batches if n > b]
            if too_small:
                raise ProfileConfigError(
                    f"N = {n} prefill requests do not fit in batch {too_small[0]} (N must be <= every --batch size)",
                    fields=("prefill",),
                )
        if self.kv_indices_capacity is not None and "flashinfer" not in _checked_setting("attention", self.attention):
            raise ProfileConfigError(
                "kv_indices_capacity sets the capacity of flashinfer's kv_indices; it needs attention flashinfer",
                fields=("kv_indices_capacity", "attention"),
            )
        if len(sizes) > 1 and len(sizes) != num_caches:
            raise ProfileConfigError(
                f"got {len(sizes)} block sizes for {num_caches} caches (give one size, or one per cache)",
                fields=("block_sizes",),
            )
        probe = dataclasses.replace(self.workload(), model="", num_layers=1)
        for b in batches:
            if probe.capacity(b) > MAX_TOKENS_PER_STEP:
                raise ProfileConfigError(
                    f"batch {b} carries {probe.capacity(b)} tokens per step, more than the "
                    f"{MAX_TOKENS_PER_STEP} kvaddr profile allows",
                    fields=("prefill",) if self.prefill else ("batches", "spec_tokens"),
                )
            for B in set(probe.block_sizes):
                entries = b * probe.max_blocks(B)
                if entries > MAX_TABLE_ENTRIES:
                    raise ProfileConfigError(
                        f"a block table of batch {b} x {probe.max_blocks(B)} blocks (B = {B}, longest sequence "
                        f"{probe.longest_sequence()} tokens) exceeds {MAX_TABLE_ENTRIES} entries; lower the context "
                        f"or raise the block size",
                        fields=("context", "block_sizes"),
                    )

    def vllm_options(self):
        """The vLLM engine profile's options (:class:`~kvaddr.measure.vllm_profile.VllmProfileOptions`)."""
        from kvaddr.measure.vllm_profile import VllmProfileOptions

        size, rank, interleave = self.dcp
        return VllmProfileOptions(
            shapes=tuple(self.shapes),
            block_sizes=tuple(self.groups),
            cp_size=size,
            cp_rank=rank,
            cp_interleave=interleave,
            dummy_fraction=float(self.dummy_fraction),
            context=tuple(self.context),
            sliding_window_reach=self.sliding_window,
            input_sets=self.input_sets,
            seed=self.seed,
            num_blocks_mem=self.num_blocks_mem,
        )

    def _validate_vllm(self) -> None:
        groups = self.groups
        if not 1 <= len(groups) <= VLLM_MAX_GROUPS:
            raise ProfileConfigError(
                f"groups must name 1 to {VLLM_MAX_GROUPS} KV-cache groups (one block size each), got {len(groups)}",
                fields=("groups",),
            )
        size, _, interleave = self.dcp
        if size > 1 and groups[0] % interleave:
            raise ProfileConfigError(
                f"dcp INTERLEAVE must divide the block size of the first group (the DCP-sharded one), "
                f"got INTERLEAVE {interleave} and B {groups[0]}",
                fields=("dcp",),
            )
        if self.sliding_window and len(groups) < 2:
            raise ProfileConfigError(
                "sliding_window applies to the last of two or more groups; give two or more groups",
                fields=("sliding_window",),
            )
        hi = self.context[1]
        for text in self.shapes:
            shape = parse_shape(text)
            if shape.num_tokens > MAX_TOKENS_PER_STEP:
                raise ProfileConfigError(
                    f"shape {shape.name} carries {shape.num_tokens} tokens per step, more than the "
                    f"{MAX_TOKENS_PER_STEP} kvaddr profile allows",
                    fields=("shapes",),
                )
            rows = 2 * max(8, -(-(shape.num_reqs + int(self.dummy_fraction * shape.num_reqs)) // 8) * 8)
            longest = hi + (1 if shape.kind == "decode" else shape.num_tokens)
            for g, B in enumerate(groups):
                span = B * (size if g == 0 and size > 1 else 1)
                entries = rows * -(-longest // span)
                if entries > MAX_TABLE_ENTRIES:
                    raise ProfileConfigError(
                        f"the block table of shape {shape.name} ({rows} rows x {-(-longest // span)} blocks, "
                        f"B = {B}, longest sequence up to {longest} tokens) exceeds {MAX_TABLE_ENTRIES} entries; "
                        f"lower the context or raise the block size",
                        fields=("shapes", "context", "groups"),
                    )


def _canonical(name: str, value):
    """A setting's value in the form :func:`_checked_setting` gives it (tuples for lists), to compare."""
    if value is None or name not in SETTING_RULES:
        return value
    try:
        return _checked_setting(name, value)
    except ProfileConfigError:
        return value


def run(config: ProfileConfig, progress: Progress | None = None) -> dict:
    """Check every strategy against the reference, time it, and return the report.

    Parameters
    ----------
    config : ProfileConfig
    progress : Progress, optional
        Told the status lines and each unit of work (:class:`Progress`).

    Returns
    -------
    dict
        The ``kvaddr.profile`` report document (docs/json-schema.md), with
        ``wall_s``; its shapes carry every raw sample. With ``engine="vllm"``
        the ``kvaddr.profile.vllm`` report (same document) instead.

    Raises
    ------
    ProfileConfigError
        An invalid setting.
    EnvironmentProblem
        ``device="cuda"`` without a GPU, no CuPy, kernels.cu does not compile;
        with ``engine="vllm"`` also the CPU (``device="cpu"``, or ``"auto"``
        without a GPU): :class:`~kvaddr.measure.vllm_profile.VllmProfileUnavailable`.
    CheckFailed
        A strategy's output differs from the reference (before any time is reported).
    """
    from kvaddr.measure.environment import environment_record, use_gpu
    from kvaddr.measure.report import profile_document
    from kvaddr.measure.timing import MAX_SAMPLES, MIN_SAMPLES, TARGET_BLOCK_S, Budget

    started = time.perf_counter()
    progress = progress or Progress()
    config.validate()
    if config.engine == "vllm":
        return _run_vllm(config, progress, started)
    workload = config.workload()
    use_cuda, no_gpu_reason = use_gpu(config.device)
    if no_gpu_reason is not None:
        progress.note(f"no CUDA device found: {no_gpu_reason}; profiling the NumPy strategies on the CPU")
    if use_cuda:
        modes = {"eager": ("eager",), "graph": ("graph",)}.get(config.mode, MODES)
    else:
        modes = ("eager",)
        if config.mode in ("graph", "both"):
            progress.note("graph mode needs a CUDA device; the CPU path measures eager mode only")
    attention = AttentionSetting(_checked_setting("attention", config.attention), config.kv_indices_capacity)
    backend = CudaBackend(0, attention) if use_cuda else CpuBackend(attention)
    batches = list(config.batches)
    progress.note(
        f"checking {len(batches)} batch size(s) x {config.input_sets} input sets against the "
        f"reference on the {'GPU' if use_cuda else 'CPU'} ..."
    )

    def checked():
        progress.note(
            f"all strategies match the reference ({time.perf_counter() - started:.1f} s); "
            f"timing, {config.budget:g} s per strategy and mode ..."
        )

    progress.begin(sum(backend.units(len(strategies_for(STRATEGY_NAMES, b)[0]), modes) for b in batches))
    try:
        shapes = run_profile(backend, workload, batches, modes, Budget(seconds=config.budget), progress, checked)
    finally:
        progress.end()
    environment = environment_record("cuda" if use_cuda else "cpu", 0 if use_cuda else None)
    settings = {
        "device": environment["device"],
        "modes": list(modes),
        "budget_s": config.budget,
        "min_samples": MIN_SAMPLES,
        "max_samples": MAX_SAMPLES,
        "target_block_s": TARGET_BLOCK_S,
        "input_sets": config.input_sets,
        "step_ms": config.step_ms,
        "batches": batches,
    }
    doc = profile_document(shapes, workload, environment, settings, config.recorded_options())
    if use_cuda and workload.spec_tokens > 0:
        # After each verify step, the MTP draft model's k substeps: FastDeploy's per-substep design
        # against kvaddr's one launch, checked equal, timed per cycle (kvaddr.measure.mtp_profile).
        from kvaddr.measure import mtp_profile

        progress.note(f"MTP draft addressing: {workload.spec_tokens} substeps per cycle, checked, then timed ...")
        doc["draft_steps"] = mtp_profile.measure(workload, batches, config.budget)
    doc["wall_s"] = round(time.perf_counter() - started, 3)
    return doc


class _CheckedNote(Progress):
    """Passes the vLLM profile's units on to ``progress`` and says, before the first (timing starts only
    once every shape is checked), that every implementation matched the reference."""

    def __init__(self, progress: Progress, message: Callable[[], str]):
        self.progress, self.message, self.told = progress, message, False

    def start(self, label: str) -> None:
        if not self.told:
            self.told = True
            self.progress.note(self.message())
        self.progress.start(label)

    def advance(self) -> None:
        self.progress.advance()


def _run_vllm(config: ProfileConfig, progress: Progress, started: float) -> dict:
    """:func:`run` for ``engine="vllm"``: :func:`~kvaddr.measure.vllm_profile.run_vllm_profile` (check, then
    time, the one-launch step and the three launches per shape) and its report, the run's settings recorded."""
    from kvaddr.measure.environment import environment_record, use_gpu
    from kvaddr.measure.report import NOISE_RULE
    from kvaddr.measure.timing import MAX_SAMPLES, MIN_SAMPLES, TARGET_BLOCK_S, Budget
    from kvaddr.measure.vllm_profile import (
        CPU_REASON,
        STRATEGIES,
        THREE,
        VllmProfileUnavailable,
        run_vllm_profile,
        vllm_document,
    )

    if config.device == "cpu":
        raise VllmProfileUnavailable(CPU_REASON)
    use_cuda, no_gpu_reason = use_gpu(config.device)  # --device cuda without a GPU: EnvironmentProblem
    if not use_cuda:
        raise VllmProfileUnavailable(f"{CPU_REASON} (no CUDA device found: {no_gpu_reason})")
    modes = {"eager": ("eager",), "graph": ("graph",)}.get(config.mode, MODES)
    options = config.vllm_options()
    shapes = list(config.shapes)
    progress.note(
        f"vLLM engine: checking {len(shapes)} shape(s) x {config.input_sets} input sets of "
        f"{', '.join(STRATEGIES)} against the reference on the GPU ..."
    )
    units = _CheckedNote(
        progress,
        lambda: (
            f"both match the reference ({time.perf_counter() - started:.1f} s); "
            f"timing, {config.budget:g} s per implementation and mode ..."
        ),
    )
    progress.begin(len(shapes) * len(modes) * len(STRATEGIES))
    try:
        results = run_vllm_profile(
            options, device="cuda", device_id=0, modes=modes, budget=Budget(seconds=config.budget), progress=units
        )
    finally:
        progress.end()
    environment = environment_record("cuda", 0)
    doc = vllm_document(results, options, environment)
    settings = {
        "device": environment["device"],
        "modes": list(modes),
        "budget_s": config.budget,
        "min_samples": MIN_SAMPLES,
        "max_samples": MAX_SAMPLES,
        "target_block_s": TARGET_BLOCK_S,
        "input_sets": config.input_sets,
        "shapes": shapes,
        "baseline": THREE,
        "noise_rule": NOISE_RULE,
    }
    head = {k: doc[k] for k in ("schema_version", "kind", "created_utc")}
    rest = {k: v for k, v in doc.items() if k not in head and k != "options" and k != "environment"}
    doc = {**head, "options": config.recorded_options(), "environment": environment, "settings": settings, **rest}
    if config.spec_tokens > 0:
        # After each verify step, the draft model's forwards: vLLM's per-draft-step design against
        # kvaddr's one launch, checked equal, timed per cycle (kvaddr.measure.vllm_draft_profile).
        from kvaddr.measure import vllm_draft_profile

        progress.note(f"vLLM draft addressing: {config.spec_tokens} draft tokens per cycle, checked, then timed ...")
        doc["draft_steps"] = vllm_draft_profile.measure(options, config.spec_tokens, config.budget)
    doc["wall_s"] = round(time.perf_counter() - started, 3)
    return doc
