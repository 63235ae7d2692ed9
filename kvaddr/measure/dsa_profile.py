"""``kvaddr profile --dsa``: DeepSeek-V3.2 sparse attention's addressing per decode step.

Per decode step of L layers (61 for DeepSeek-V3.2), K = 2048 selected positions per token and
the indexer cache's block size B, two designs:

* **per-layer** (what engines run today): the indexer metadata built after the step by a chain
  of array operations, several launches (context lengths, the prefills' ``cu_seq_lens``,
  ``ks`` / ``ke``, the indexer-cache value and scale offsets from the slot mapping), then in
  every layer the top-k -> slots conversion of the engines' design
  (:class:`~kvaddr.strategies.dsa_topk.BaselineTopkSlots`: a program per token and 128 columns,
  no context check, no counts);
* **kvaddr**: the indexer metadata written in the step's own launch (``StepPlanner(dsa=True)``:
  the step with the outputs on, minus the step without), then in every layer kvaddr's
  conversion (:class:`~kvaddr.strategies.dsa_topk.KvaddrTopkSlots`, :func:`kvaddr.dsa.topk_to_slots`:
  checked, with valid counts).

Before any time is taken, every design's metadata and both conversions are checked equal to the
NumPy references on the step being timed (:func:`check_conversion`: the slots, and kvaddr's
counts and clean error record).

The timing is graph mode: N copies of one call captured in a CUDA graph, the replay time over N
(median of R replays, CUDA events).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "CONVERSION_ABOUT",
    "DsaProfileRow",
    "check_conversion",
    "conversions",
    "engine_metadata",
    "random_topk",
    "run_dsa_profile",
]

#: Selected positions per query token in DeepSeek-V3.2's indexer.
TOPK = 2048


#: What each design's conversion is, for the report (the strategies of kvaddr.strategies.dsa_topk).
CONVERSION_ABOUT = {
    "per-layer": "BaselineTopkSlots: the engines' design, one launch per layer, a program per token and 128 "
    "columns, no context check, no counts",
    "kvaddr": "KvaddrTopkSlots: kvaddr.dsa.topk_to_slots, the context, width and block ids checked, valid counts",
}


def conversions(max_tokens: int, K: int, B: int) -> dict:
    """The conversion each design runs in every layer, with persistent outputs for
    ``max_tokens`` tokens: ``{"per-layer": BaselineTopkSlots, "kvaddr": KvaddrTopkSlots}``
    (kvaddr.strategies.dsa_topk, on CuPy's current device)."""
    from kvaddr.strategies.dsa_topk import BaselineTopkSlots, KvaddrTopkSlots

    return {"per-layer": BaselineTopkSlots(max_tokens, K, B), "kvaddr": KvaddrTopkSlots(max_tokens, K, B)}


def check_conversion(design: str, strategy, topk, req_id, table, ctx, want, stream=None):
    """Run ``strategy`` once and assert its slots (and, where it has them, its valid counts and a
    clean error record) equal ``want`` (kvaddr.dsa_reference.topk_to_slots's); its outputs."""
    from kvaddr.dsa import topk_slot_errors

    out = strategy.compute(topk, req_id, table, ctx, stream=stream)
    assert np.array_equal(np.asarray(out.slots.get()), want.slots), f"{design} conversion: slots"
    if out.valid_counts is not None:
        assert np.array_equal(np.asarray(out.valid_counts.get()), want.valid_counts), f"{design} conversion: counts"
    if out.errors is not None:
        masks, _ = topk_slot_errors(out.errors)
        assert not np.asarray(masks).any(), f"{design} conversion: error bits {np.asarray(masks).tolist()}"
    return out


def random_topk(rng, positions: np.ndarray, K: int) -> np.ndarray:
    """int32 [T, K]: for token t at position p, min(p + 1, K) distinct positions < p + 1 (its
    context), then -1s: what the indexer returns for a request shorter than K."""
    T = positions.shape[0]
    out = np.full((T, K), -1, dtype=np.int32)
    for t in range(T):
        ctx = int(positions[t]) + 1
        n = min(ctx, K)
        out[t, :n] = rng.choice(ctx, size=n, replace=False) if ctx > K else rng.permutation(ctx)
    return out


def engine_metadata(xp, batch_ids, positions, slots, seq_lens_kv, q, num_tokens, B, *, decode_len=1):
    """The per-layer design's indexer metadata, built after the step by array operations (one
    launch each on the GPU): ``(value, scale, ctx, ks, ke, cu_seq_lens)`` for the first
    ``num_tokens`` tokens, ``xp`` NumPy or CuPy. The oracle is kvaddr.reference's
    ``dsa_step_outputs`` (the same values, kvaddr's padding aside)."""
    V, S = 128, 4
    bid = batch_ids[:num_tokens].astype(xp.int64)
    pos = positions[:num_tokens].astype(xp.int64)
    s = slots[:num_tokens]
    ctx = (pos + 1).astype(xp.int32)
    blk, off = s // B, s % B
    value = xp.where(s >= 0, blk * (B * (V + S)) + off * V, -1)
    scale = xp.where(s >= 0, blk * (B * (V + S)) + B * V + off * S, -1)
    prefill = q > decode_len
    n = q.shape[0]
    lens = xp.where(prefill, seq_lens_kv, 0).astype(xp.int64)
    inclusive = xp.cumsum(lens)
    before = xp.concatenate([xp.zeros(1, xp.int64), inclusive])
    # cu_seq_lens[i + 1] for prefill i: a scatter (no data-dependent shape, so it can be captured)
    ordinal = xp.cumsum(prefill.astype(xp.int64))
    cu = xp.zeros(n + 2, xp.int64)
    cu[xp.where(prefill, ordinal, n + 1)] = inclusive
    cu = cu[: n + 1].astype(xp.int32)
    tok_pre = prefill[bid]
    ks = xp.where(tok_pre, before[bid], 0).astype(xp.int32)
    ke = xp.where(tok_pre, ks.astype(xp.int64) + pos + 1, 0).astype(xp.int32)
    return value, scale, ctx, ks, ke, cu


@dataclass
class DsaProfileRow:
    """One decode batch's times per decode step, in microseconds."""

    batch: int
    layers: int
    K: int
    metadata_per_layer_design_us: float
    metadata_kvaddr_us: float
    conversion_per_layer_us: float
    conversion_kvaddr_us: float
    conversions: dict = field(default_factory=dict)

    @property
    def per_layer_design_us(self) -> float:
        """The per-layer design's step: its metadata and L conversions."""
        return self.metadata_per_layer_design_us + self.layers * self.conversion_per_layer_us

    @property
    def kvaddr_us(self) -> float:
        return self.metadata_kvaddr_us + self.layers * self.conversion_kvaddr_us

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(per_layer_design_us=self.per_layer_design_us, kvaddr_us=self.kvaddr_us)
        return d


def _graph_time(launch: Callable, stream, copies: int, replays: int) -> float:
    """Median GPU time per copy of ``launch`` (N copies in one CUDA graph), microseconds; eager
    (N launches between two events) when the launch cannot be captured."""
    import cupy

    try:
        return _captured_time(launch, stream, copies, replays)
    except Exception:  # a launch that allocates, or anything else capture refuses
        stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(replays):
        start.record(stream)
        for _ in range(copies):
            launch()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0 / copies)
    return statistics.median(samples)


def _captured_time(launch: Callable, stream, copies: int, replays: int) -> float:
    import cupy

    launch()
    stream.synchronize()
    stream.begin_capture()
    failed = None
    try:
        for _ in range(copies):
            launch()
    except Exception as exc:  # end the capture first, then report it
        failed = exc
    try:
        graph = stream.end_capture()
    except Exception as exc:
        failed = failed or exc
    if failed is not None:
        raise failed
    graph.launch(stream)
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(replays):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0 / copies)
    return statistics.median(samples)


def _decode_batch(rng, bsz: int, B: int, max_ctx: int):
    dec = rng.integers(1, max_ctx, size=bsz).astype(np.int32)
    q = np.ones(bsz, dtype=np.int32)
    width = int(-(-(int(dec.max()) + 1) // B))
    table = rng.permutation(bsz * width).astype(np.int32).reshape(bsz, width)
    return dec, q, table


def run_dsa_profile(
    batches: Sequence[int],
    *,
    layers: int = 61,
    block_size: int = 64,
    K: int = TOPK,
    max_ctx: int = 8192,
    copies: int = 50,
    replays: int = 10,
    seed: int = 0,
    device: int | None = None,
) -> list[DsaProfileRow]:
    """Time both designs per decode step for each decode batch of ``batches`` requests (one
    token each), after checking every output against the NumPy references.

    Raises
    ------
    AssertionError
        A design's metadata or a conversion differs from its reference (nothing is timed).
    """
    import cupy

    rng = np.random.default_rng(seed)
    with cupy.cuda.Device(0 if device is None else device):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            return [
                _profile_batch(rng, bsz, layers, block_size, K, max_ctx, stream, copies, replays) for bsz in batches
            ]


def _profile_batch(rng, bsz, layers, B, K, max_ctx, stream, copies, replays) -> DsaProfileRow:
    """One decode batch of ``bsz`` requests: check, then time (see :func:`run_dsa_profile`)."""
    import cupy

    from kvaddr.dsa_reference import topk_to_slots
    from kvaddr.planner import StepPlanner
    from kvaddr.reference import step_addressing

    dec, q, table = _decode_batch(rng, bsz, B, max_ctx)
    T = bsz
    ref = step_addressing(dec, q, [table, table], [B, B], T, dsa=True)
    d_dec, d_q, d_table = cupy.asarray(dec), cupy.asarray(q), cupy.asarray(table)
    tables = [d_table, d_table]
    off = StepPlanner(bsz, T, [B, B])
    on = StepPlanner(bsz, T, [B, B], dsa=True)
    out = on.compute(d_dec, d_q, tables, stream=stream)
    stream.synchronize()
    on.check(stream)
    names = ("value_offsets", "scale_offsets", "ctx", "ks", "ke")
    for name in names:
        assert np.array_equal(getattr(out.dsa, name).get(), getattr(ref.outputs.dsa, name)), f"kvaddr metadata: {name}"
    o = off.compute(d_dec, d_q, tables, stream=stream)

    def engine():
        return engine_metadata(cupy, o.batch_id_per_token, o.position_ids, o.slot_mapping[1], o.seq_lens_kv, d_q, T, B)

    eng = engine()
    stream.synchronize()
    for name, got in zip(names, eng[:5]):
        assert np.array_equal(got.get(), getattr(ref.outputs.dsa, name)[:T]), f"per-layer metadata: {name}"
    t_off = _graph_time(lambda: off.compute(d_dec, d_q, tables, stream=stream), stream, copies, replays)
    t_on = _graph_time(lambda: on.compute(d_dec, d_q, tables, stream=stream), stream, copies, replays)
    t_engine = _graph_time(engine, stream, copies, replays)

    pos = ref.outputs.position_ids[:T]
    topk = random_topk(rng, pos, K)
    rid = ref.outputs.batch_id_per_token[:T]
    want = topk_to_slots(topk, rid, table, B, pos + 1)
    d_topk, d_rid = cupy.asarray(topk), cupy.asarray(rid)
    d_ctx = cupy.asarray((pos + 1).astype(np.int32))
    times = {}
    for design, strategy in conversions(T, K, B).items():
        check_conversion(design, strategy, d_topk, d_rid, d_table, d_ctx, want, stream)

        def convert(strategy=strategy):
            strategy.compute(d_topk, d_rid, d_table, d_ctx, stream=stream)

        times[design] = _graph_time(convert, stream, copies, replays)
    return DsaProfileRow(
        batch=bsz,
        layers=layers,
        K=K,
        metadata_per_layer_design_us=t_engine,
        metadata_kvaddr_us=max(t_on - t_off, 0.0),
        conversion_per_layer_us=times["per-layer"],
        conversion_kvaddr_us=times["kvaddr"],
        conversions={k: f"{k}: {v}" for k, v in CONVERSION_ABOUT.items()},
    )


def format_rows(rows: Sequence[DsaProfileRow]) -> str:
    """The report: per decode step, the indexer metadata and the L layers' conversions."""
    lines = [
        "DSA addressing per decode step (us): indexer metadata, then L layers' top-k -> slots conversions",
        f"{'batch':>6}{'layers':>7}{'K':>6}{'meta per-layer':>16}{'meta kvaddr':>13}"
        f"{'conv per-layer':>16}{'conv kvaddr':>13}{'step per-layer':>16}{'step kvaddr':>13}{'ratio':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r.batch:>6}{r.layers:>7}{r.K:>6}{r.metadata_per_layer_design_us:>16.2f}{r.metadata_kvaddr_us:>13.2f}"
            f"{r.layers * r.conversion_per_layer_us:>16.2f}{r.layers * r.conversion_kvaddr_us:>13.2f}"
            f"{r.per_layer_design_us:>16.2f}{r.kvaddr_us:>13.2f}{r.per_layer_design_us / max(r.kvaddr_us, 1e-9):>7.2f}"
        )
    if rows:
        lines.append("conversions: " + "; ".join(rows[0].conversions.values()))
        lines.append("meta kvaddr: the step with dsa=True minus the step without (one launch either way)")
    return "\n".join(lines)
