"""``kvaddr profile --engine vllm``: the one-launch vLLM step against vLLM's three-launch design.

For each batch shape (:mod:`kvaddr.measure.vllm_workload`) the run

1. draws the input sets and computes each one's reference
   (:func:`kvaddr.engines.vllm_reference.vllm_step_reference`);
2. builds :class:`~kvaddr.engines.vllm.VllmStepPlanner` ("vllm-one-launch") and
   :class:`~kvaddr.strategies.vllm_three_launch.VllmThreeLaunch` ("vllm-three-launch")
   with the same configuration, runs each on every input set twice (the second time
   after filling the outputs it must rewrite with a sentinel) and compares every
   output element with the reference; graph mode replays each captured graph once
   and compares again; the one-launch step's device error record must be clean;
3. only then times both and the launch floor with the profiler's timers
   (:class:`~kvaddr.measure.timing.GpuTimer`: graph replays of many steps per graph
   on the GPU clock; eager launches on the host and GPU clocks).

The saving per step is the three-launch median minus the one-launch median, with
the profiler's noise rule (:func:`kvaddr.measure.report.compare_to_reference`).

GPU only: on the CPU there are no launches to save, so :func:`run_vllm_profile`
raises :class:`VllmProfileUnavailable` (the CLI's exit 3) with a one-line reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvaddr.errors import EnvironmentProblem
from kvaddr.measure.correctness import CheckFailed
from kvaddr.measure.report import MeasurementRow, compare_to_reference, format_us, group, ordered_measures, short_label
from kvaddr.measure.timing import FLOOR, Budget, GpuTimer, Measurement, measurement_stream
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES, VllmBatchSet, VllmWorkload, make_batch_set, parse_shape

#: The report's ``kind``.
VLLM_KIND = "kvaddr.profile.vllm"
ONE = "vllm-one-launch"
THREE = "vllm-three-launch"
#: Eager only: the one launch bound to the request state and the batch buffers, two ints per step
#: (``bind(..., idx_mapping=, query_start_loc=)``, then ``launch(num_reqs, num_reqs_padded)``).
BOUND = "vllm-one-launch-bound"
#: Eager only: ``compute()`` with new slices of the batch buffers every step (vLLM's call).
FRESH = "vllm-one-launch-fresh-slices"
STRATEGIES = (THREE, ONE)
#: Every row of a report, in order (the floor last).
ROW_ORDER = (THREE, ONE, BOUND, FRESH)
#: ``--num-blocks-mem``: where ``num_blocks`` lives (device memory, or pinned host memory through UVA).
NUM_BLOCKS_MEMS = ("device", "uva")
SENTINEL = 0x5A5A5A5A
INPUT_NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


class VllmProfileUnavailable(EnvironmentProblem):
    """The engine profile cannot run here (CPU device, no CuPy, kernels do not compile): exit 3."""


CPU_REASON = (
    "--engine vllm times GPU launches (one against three); it has no CPU path: "
    "run it with --device cuda on a machine with a GPU"
)


@dataclass(frozen=True)
class VllmProfileOptions:
    """The engine profile's options (the CLI's ``--engine vllm`` flags).

    Parameters
    ----------
    shapes : sequence of str
        ``decode:N``, ``mixed:N:T`` or ``N`` (``--shape``, repeatable).
    block_sizes : sequence of int
        One KV-cache group per entry (``--groups 16,64``).
    cp_size, cp_rank, cp_interleave : int
        DCP (``--dcp SIZE[:RANK[:INTERLEAVE]]``); the first group is sharded.
    dummy_fraction : float
        Dummy requests added per real one (``--dummy-fraction``).
    context : (int, int)
        ``num_computed_tokens`` range (``--context LO:HI``).
    sliding_window_reach : int
        R of the last group when there are 2+ groups (``--sliding-window``).
    input_sets, seed : int
    num_blocks_mem : str
        ``"device"`` or ``"uva"``: ``num_blocks`` in pinned host memory read through UVA, as vLLM
        keeps it (``--num-blocks-mem``), for every implementation.
    """

    shapes: tuple = DEFAULT_SHAPES
    block_sizes: tuple = (16,)
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    dummy_fraction: float = 0.0
    context: tuple = (128, 2048)
    sliding_window_reach: int = 0
    input_sets: int = 4
    seed: int = 0
    num_blocks_mem: str = "device"

    def __post_init__(self):
        if self.num_blocks_mem not in NUM_BLOCKS_MEMS:
            raise ValueError(f"num_blocks_mem must be one of {NUM_BLOCKS_MEMS}, got {self.num_blocks_mem!r}")

    def workload(self) -> VllmWorkload:
        return VllmWorkload(
            block_sizes=tuple(self.block_sizes),
            context=tuple(self.context),
            dummy_fraction=self.dummy_fraction,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            cp_interleave=self.cp_interleave,
            sliding_window_reach=self.sliding_window_reach,
            input_sets=self.input_sets,
            seed=self.seed,
        )

    def as_dict(self) -> dict:
        return {
            "engine": "vllm",
            "shapes": list(self.shapes),
            "block_sizes": list(self.block_sizes),
            "cp_size": self.cp_size,
            "cp_rank": self.cp_rank,
            "cp_interleave": self.cp_interleave,
            "dummy_fraction": self.dummy_fraction,
            "context": list(self.context),
            "sliding_window_reach": self.sliding_window_reach,
            "input_sets": self.input_sets,
            "seed": self.seed,
            "num_blocks_mem": self.num_blocks_mem,
        }


@dataclass
class VllmShapeResult:
    """One shape's checks and measurements (field names as the core report's ShapeResult)."""

    shape: str
    batch: int  # idx_mapping entries
    capacity: int  # max_num_batched_tokens
    batch_set: VllmBatchSet
    strategies: list = field(default_factory=lambda: list(STRATEGIES))
    measurements: list = field(default_factory=list)
    checks: dict = field(default_factory=dict)


def _outputs_equal(name: str, context: str, got, want) -> None:
    from kvaddr.engines.vllm_config import OUTPUT_FIELDS

    for f in OUTPUT_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        pairs = (
            [(f"{f}[{k}]", a, b) for k, (a, b) in enumerate(zip(g, w))] if f == "input_block_tables" else [(f, g, w)]
        )
        for what, a, b in pairs:
            a = a.get() if hasattr(a, "get") else np.asarray(a)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise CheckFailed(f"{name} ({context}): {what} is {a.dtype}{a.shape}, want {b.dtype}{b.shape}")
            bad = np.argwhere(a != b)
            if len(bad):
                at = tuple(int(i) for i in bad[0])
                raise CheckFailed(
                    f"{name} ({context}) differs from the reference: {what}{list(at)} = {a[at]}, expected {b[at]}"
                )


def _poison(outputs) -> None:
    # Every output a call must rewrite in full; the gathered tables are rewritten only
    # where they may hold data (their zero rows are an invariant), so they are not poisoned.
    for f in ("positions", "seq_lens", "slot_mappings", "dcp_local_seq_lens"):
        getattr(outputs, f).fill(SENTINEL)


def run_vllm_profile(
    options: VllmProfileOptions,
    *,
    device: str = "cuda",
    device_id: int = 0,
    modes: Sequence[str] = ("graph", "eager"),
    budget: Budget | None = None,
    stream=None,
    progress=None,
) -> list:
    """Check, then time, every shape; one :class:`VllmShapeResult` per shape.

    Parameters
    ----------
    options : VllmProfileOptions
    device : str
        ``"cuda"``; ``"cpu"`` raises :class:`VllmProfileUnavailable`.
    device_id : int
    modes : sequence of str
        ``"graph"`` and/or ``"eager"``.
    budget : Budget, optional
        Per measurement (the profiler's ``--seconds``).
    stream : cupy Stream, optional
        The measuring stream (default :func:`~kvaddr.measure.timing.measurement_stream`).
    progress : object with start(label) and advance(), optional

    Raises
    ------
    VllmProfileUnavailable
        On the CPU, without CuPy, or when kernels.cu does not compile.
    CheckFailed
        When either implementation differs from the reference (before any timing).
    """
    if device != "cuda":
        raise VllmProfileUnavailable(CPU_REASON)
    try:
        import cupy

        from kvaddr import kernel_loader
        from kvaddr.engines.vllm import VllmStepPlanner
        from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

        with cupy.cuda.Device(device_id):
            kernel_loader.get_module(device_id)
            empty = kernel_loader.get_function("kvaddr_empty", device_id)
    except Exception as exc:
        raise VllmProfileUnavailable(f"cannot run the vLLM engine profile ({type(exc).__name__}: {exc})") from exc
    budget = budget or Budget()
    workload = options.workload()
    shapes = [parse_shape(s) for s in options.shapes]
    stream = stream or measurement_stream(device_id)
    from kvaddr.engines.vllm_reference import vllm_step_reference

    prepared = []
    with cupy.cuda.Device(device_id), stream:
        for shape in shapes:
            bs = make_batch_set(workload, shape)
            refs = [vllm_step_reference(bs.config, **x, num_reqs_padded=bs.num_reqs_padded).outputs for x in bs.inputs]
            inputs = []
            for x in bs.inputs:
                d = {
                    k: ([cupy.asarray(a) for a in v] if isinstance(v, list) else cupy.asarray(v)) for k, v in x.items()
                }
                if options.num_blocks_mem == "uva":  # vLLM's layout: one [G, rows] array in pinned host memory
                    from kvaddr.measure.vllm_workload import pinned_num_blocks

                    d["num_blocks"] = pinned_num_blocks(np.stack(x["num_blocks"]), device_id)[1]
                inputs.append(tuple(d[k] for k in INPUT_NAMES) + (bs.num_reqs_padded,))
            stream.synchronize()
            kw = dict(
                max_num_reqs=bs.config.max_num_reqs,
                max_num_batched_tokens=bs.config.max_num_batched_tokens,
                block_sizes=list(bs.config.block_sizes),
                widths=list(bs.config.widths),
                dcp_sharded=list(bs.config.dcp_sharded),
                sliding_window_reach=list(bs.config.sliding_window_reach),
                cp_size=bs.config.cp_size,
                cp_rank=bs.config.cp_rank,
                cp_interleave=bs.config.cp_interleave,
                device=device_id,
            )
            impls = {THREE: VllmThreeLaunch(**kw), ONE: VllmStepPlanner(**kw)}
            for name, impl in impls.items():
                for i, (args, ref) in enumerate(zip(inputs, refs)):
                    context = f"eager, {shape.name}, input set {i}"
                    impl.compute(*args, stream=stream)
                    stream.synchronize()
                    _poison(impl.outputs)
                    out = impl.compute(*args, stream=stream)
                    stream.synchronize()
                    _outputs_equal(name, context, out, ref)
                mask, _ = impl.errors(stream)
                if mask:
                    raise CheckFailed(f"{name} ({shape.name}): the device error record is not clean (bits {mask})")
            host_paths = (
                _host_path_inputs(cupy, VllmStepPlanner(**kw), VllmStepPlanner(**kw), inputs, refs, stream, shape.name)
                if "eager" in modes
                else {}
            )
            result = VllmShapeResult(shape.name, bs.num_reqs, bs.config.max_num_batched_tokens, bs)
            result.checks = {
                "status": "passed",
                "input_sets": len(inputs),
                "strategies": list(STRATEGIES),
                "modes": list(modes),
                "sentinel_refill": True,
                "graph_replays": "graph" in modes,
            }
            prepared.append((result, impls, inputs, refs, host_paths))

        timer = GpuTimer(stream)

        def floor_step(*_args):
            empty((1,), (1,), (), 0, stream)

        for result, impls, inputs, refs, host_paths in prepared:
            for mode in modes:
                for name, impl in impls.items():
                    if progress is not None:
                        progress.start(f"{result.shape}: {name} ({mode})")

                    def step(*args, impl=impl):
                        return impl.compute(*args, stream=stream)

                    if mode == "eager":
                        result.measurements.extend(
                            timer.measure_eager(name, step, inputs, budget, lambda impl=impl: impl.launches_per_step)
                        )
                    else:
                        result.measurements.append(
                            _measure_graph(timer, name, impl, step, inputs, refs, result.shape, budget)
                        )
                    if progress is not None:
                        progress.advance()
                if mode == "eager":
                    for name, (step, args) in host_paths.items():
                        if progress is not None:
                            progress.start(f"{result.shape}: {name} ({mode})")
                        result.measurements.extend(timer.measure_eager(name, step, args, budget, lambda: 1))
                    result.measurements.extend(timer.measure_eager(FLOOR, floor_step, inputs, budget, lambda: 1))
                else:
                    graph, _ = timer.capture(floor_step, ())
                    copies = timer.copies_for(graph)
                    multi = timer.capture_copies(floor_step, [()], copies)
                    result.measurements.append(timer.measure_graph(FLOOR, [multi], budget, 1, copies))
                    del graph, multi
    return [p[0] for p in prepared]


def _host_path_inputs(cupy, bound_planner, fresh_planner, inputs, refs, stream, shape) -> dict:
    """The eager host paths beside compute(), each checked on every input set first:
    ``{name: (step, argument tuples)}``. :data:`BOUND`: one binding per input set over its own
    persistent batch buffers (``max_num_reqs`` entries, the set's batch first), launched with two
    ints. :data:`FRESH`: ``compute()`` with new slices ``buf[:num_reqs]`` / ``buf[:num_reqs + 1]`` of
    those buffers at every call (four slice objects per set, taken in turn, so no call repeats
    the objects of the call before)."""
    bound_args, fresh_args = [], []
    for args in inputs:
        idx, qsl, nct, tables, nbs, padded = args
        idx_h, qsl_h = idx.get(), qsl.get()
        n, M = idx_h.shape[0], bound_planner.config.max_num_reqs
        idx_buf = np.zeros(M, idx_h.dtype)
        qsl_buf = np.full(M + 1, qsl_h[-1], np.int32)
        idx_buf[:n], qsl_buf[: n + 1] = idx_h, qsl_h
        ib, qb = cupy.asarray(idx_buf), cupy.asarray(qsl_buf)
        b = bound_planner.bind(nct, tables, nbs, idx_mapping=ib, query_start_loc=qb)
        bound_args.append((b, n, padded))
        fresh_args += [(ib[:n], qb[: n + 1], nct, tables, nbs, padded) for _ in range(4)]
    stream.synchronize()

    def bound_step(b, n, padded):
        return b.launch(n, padded, stream)

    def fresh_step(*args):
        return fresh_planner.compute(*args, stream=stream)

    for name, planner, step, arg_sets, per_set in (
        (BOUND, bound_planner, bound_step, bound_args, 1),
        (FRESH, fresh_planner, fresh_step, fresh_args, 4),
    ):
        # every call after a sentinel fill, twice round (compute()'s third call on is the path of fresh
        # batch objects; each call finds the device state of another set's call before it)
        for j, a in enumerate(arg_sets * 2):
            k = (j % len(arg_sets)) // per_set
            _poison(planner.outputs)
            out = step(*a)
            stream.synchronize()
            _outputs_equal(name, f"eager, {shape}, input set {k}", out, refs[k])
        mask, _ = planner.errors(stream)
        if mask:
            raise CheckFailed(f"{name} ({shape}): the device error record is not clean (bits {mask})")
    return {BOUND: (bound_step, bound_args), FRESH: (fresh_step, fresh_args)}


def _measure_graph(timer, name, impl, step, inputs, refs, shape, budget) -> Measurement:
    for i, (args, ref) in enumerate(zip(inputs, refs)):
        graph, out = timer.capture(step, args)
        _poison(out)
        timer.replay(graph)
        _outputs_equal(name, f"graph replay, {shape}, input set {i}", out, ref)
        del graph
    copies = timer.copies_for(timer.capture(step, inputs[0])[0])
    copies = max(len(inputs), copies - copies % len(inputs))
    multi = timer.capture_copies(step, inputs, copies)
    m = timer.measure_graph(name, [multi], budget, impl.launches_per_step, copies)
    del multi
    return m


# -- report -------------------------------------------------------------------------------------


def vllm_rows(section: dict) -> list:
    """Rows of one (mode, clock) section, compared with the three-launch design."""
    base = section.get(THREE)
    floor = section.get(FLOOR)
    out = []
    for name in (*ROW_ORDER, FLOOR):
        m = section.get(name)
        if m is None:
            continue
        s = m.summary
        comp = None
        if base is not None and name != FLOOR:
            comp = compare_to_reference(base.summary, s, None, is_reference=(name == THREE))
        ratio = s.median / floor.summary.median if floor is not None and floor.summary.median > 0 else None
        out.append(MeasurementRow(m, s, comp, ratio))
    return out


def savings(result: VllmShapeResult) -> list:
    """Per (mode, clock): both medians, the saving per step and the ratio three / one."""
    out = []
    groups = group(result.measurements)
    for mode, clock in ordered_measures(groups):
        sec = groups[(mode, clock)]
        if ONE not in sec or THREE not in sec:
            continue
        one, three = sec[ONE].summary, sec[THREE].summary
        c = compare_to_reference(three, one, None)
        out.append(
            {
                "mode": mode,
                "clock": clock,
                "three_launch_us": round(three.median, 4),
                "one_launch_us": round(one.median, 4),
                "saved_us": round(c.saved_us, 4),
                "ratio": round(three.median / one.median, 4) if one.median > 0 else None,
                "verdict": c.verdict,
            }
        )
    return out


def render_vllm(console, results: Sequence[VllmShapeResult], options: VllmProfileOptions) -> None:
    """One table per shape (the profiler's layout), then one line of savings per section."""
    render_vllm_report(console, vllm_document(results, options, {"device": "cuda"}))


def render_vllm_report(console, doc: dict) -> None:
    """Print a ``kvaddr.profile.vllm`` report (:func:`vllm_document`) to ``console``: per shape, a
    table of both implementations and the floor per (mode, clock), then one line of savings each."""
    from rich.table import Table

    w = doc["workload"]
    sizes = list(w["block_sizes"])
    dcp = (
        f", DCP {w['cp_size']} ranks (rank {w['cp_rank']}, interleave {w['cp_interleave']})"
        if w.get("cp_size", 1) > 1
        else ""
    )
    for shape in doc["shapes"]:
        title = (
            f"vLLM {shape['shape']}: {shape['batch']} requests ({shape['num_reqs_padded']} padded), {len(sizes)} "
            f"group(s) (B = {', '.join(map(str, sizes))}){dcp}, {shape['capacity']} "
            f"tokens max; times in us per step"
        )
        table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
        for i, h in enumerate(["implementation", "launches", "median", "IQR", "n", "saved", "saved %", "x floor"]):
            table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
        section = None
        for row in shape["results"]:
            if (row["mode"], row["clock"]) != section:
                section = (row["mode"], row["clock"])
                table.add_row(short_label(row["mode"], row["clock"], "cuda"), style="bold")
            s, c = row["summary"], row.get("vs_three_launch")
            if c is None:
                saved, pct = "-", "-"
            elif c["verdict"] == "baseline":
                saved, pct = "baseline", ""
            elif c["verdict"] == "within noise":
                saved, pct = "within noise", ""
            else:
                saved, pct = f"{c['saved_us']:.2f}", f"{c['saved_pct']:.1f}%"
            table.add_row(
                row["strategy"],
                "-" if row["launches_per_step"] is None else str(row["launches_per_step"]),
                f"{s['median']:.2f}",
                f"{s['iqr']:.2f}",
                str(s["n"]),
                saved,
                pct,
                "-" if row.get("vs_floor") is None else f"{row['vs_floor']:.1f}x",
            )
        console.print(title, style="italic", soft_wrap=True)
        console.print(table)
        for sv in shape["savings"]:
            verdict = {
                "saving": f"saves {format_us(sv['saved_us'])} per step ({sv['ratio']:.2f}x less)",
                "slower": f"costs {format_us(-sv['saved_us'])} more per step",
            }.get(sv["verdict"], "is within noise of three launches")
            console.print(
                f"{short_label(sv['mode'], sv['clock'], 'cuda')}: one launch {verdict} at {shape['shape']}.",
                soft_wrap=True,
            )
        console.print()
    if doc.get("draft_steps"):
        from kvaddr.measure.vllm_draft_profile import render

        render(console, doc["draft_steps"])


def vllm_document(results: Sequence[VllmShapeResult], options: VllmProfileOptions, environment: dict) -> dict:
    """The JSON report (the profile envelope, kind ``kvaddr.profile.vllm``)."""
    from kvaddr.measure.report import envelope, measurement_json

    shapes = []
    for r in results:
        groups = group(r.measurements)
        rows = []
        for key in ordered_measures(groups):
            for row in vllm_rows(groups[key]):
                d = measurement_json(row)
                d["vs_three_launch"] = d.pop("vs_per_layer")
                rows.append(d)
        cfg = r.batch_set.config
        shapes.append(
            {
                "shape": r.shape,
                "batch": r.batch,
                "num_reqs_padded": r.batch_set.num_reqs_padded,
                "max_num_reqs": cfg.max_num_reqs,
                "capacity": r.capacity,
                "widths": list(cfg.widths),
                "input_sets": [r.batch_set.stats(i) for i in range(len(r.batch_set.inputs))],
                "correctness": r.checks,
                "results": rows,
                "savings": savings(r),
            }
        )
    return {
        **envelope(VLLM_KIND, options.as_dict(), environment),
        "workload": options.workload().describe(),
        "shapes": shapes,
    }
