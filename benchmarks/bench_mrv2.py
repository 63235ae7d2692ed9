"""Per step: vLLM Model Runner V2's three addressing calls through ``Mrv2Addressing`` (one
launch) against the three launches, host time (eager) and GPU time (CUDA graph).

Run on a GPU from the repository root:  PYTHONPATH=. python benchmarks/bench_mrv2.py [--json out.json]

Shapes (:mod:`kvaddr.measure.vllm_workload`): decode batches of 64, 1024 and 4096 requests and
256 requests carrying 16k tokens, two KV-cache groups (B = 16 and 64). MRV2's buffers are torch
CUDA tensors (positions, ``seq_lens``, slot mappings, ``input_block_tables``, the request
state), and the batch is passed as MRV2 passes it: fresh slices ``[:num_reqs]`` /
``[:num_reqs + 1]`` of persistent ``idx_mapping`` / ``query_start_loc`` buffers every step (8
sets of slices, made before the clock, taken in turn). Rows:

* ``empty RawKernel``: ``cupy.RawKernel`` of an empty kernel, no arguments (the yardstick);
* ``adapter: MRV2's three calls``: ``prepare_pos_seq_lens`` (the one launch, on torch's current
  stream), ``gather_block_tables`` and ``compute_slot_mappings`` (which return slices);
* ``bound launch alone``: ``BoundVllmStep.launch`` with the same slices (the adapter's launch
  without the calls around it);
* ``three launches``: ``VllmThreeLaunch.compute`` (kvaddr's re-implementation of vLLM's three
  launches) with the same slices and torch's current stream.

Host time: ``time.perf_counter`` around N steps, no synchronisation in between, one after;
per step = elapsed / N; rows in turn, round-robin, ``--repeats`` times; the median is printed.
GPU time: N steps captured in one ``torch.cuda.CUDAGraph``, replayed R times between CUDA
events; per step = median replay time / N. Before timing, the adapter's buffers are checked
against the three launches on the same batch (every element).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types

import cupy
import numpy as np
import torch

from kvaddr.engines.vllm_mrv2 import Mrv2Addressing
from kvaddr.measure.vllm_workload import DEFAULT_SHAPES, VllmWorkload, make_batch_set, parse_shape
from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

SLICE_SETS = 8


def _case(shape_text: str):
    """MRV2's buffers (torch, CUDA) for one shape, the adapter over them and the batch slices."""
    bs = make_batch_set(VllmWorkload(block_sizes=(16, 64)), parse_shape(shape_text))
    cfg, x = bs.config, bs.inputs[0]
    M, T, dev = cfg.max_num_reqs, cfg.max_num_batched_tokens, "cuda"

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    tables = types.SimpleNamespace(
        block_sizes=list(cfg.block_sizes),
        max_num_reqs=M,
        max_num_batched_tokens=T,
        block_tables=[types.SimpleNamespace(gpu=t(b)) for b in x["block_tables"]],
        num_blocks=types.SimpleNamespace(gpu=t(np.stack(x["num_blocks"]))),
        input_block_tables=[torch.zeros((M, w), dtype=torch.int32, device=dev) for w in cfg.widths],
        slot_mappings=torch.zeros((cfg.num_groups, T), dtype=torch.int64, device=dev),
    )
    nct = t(x["num_computed_tokens"])
    positions = torch.zeros(T, dtype=torch.int64, device=dev)
    seq_lens = torch.zeros(M, dtype=torch.int32, device=dev)
    addr = Mrv2Addressing(tables, nct, positions, seq_lens, sliding_window_reach=list(cfg.sliding_window_reach))
    n = bs.num_reqs
    idx_buf = torch.zeros(M, dtype=torch.int32, device=dev)
    qsl_buf = torch.zeros(M + 1, dtype=torch.int32, device=dev)
    idx_buf[:n] = t(x["idx_mapping"])
    qsl_buf[: n + 1] = t(x["query_start_loc"])
    num_tokens = int(x["query_start_loc"][-1])
    slices = [(idx_buf[:n], qsl_buf[: n + 1]) for _ in range(SLICE_SETS)]
    three = VllmThreeLaunch(
        max_num_reqs=M,
        max_num_batched_tokens=T,
        block_sizes=list(cfg.block_sizes),
        widths=list(cfg.widths),
        dcp_sharded=list(cfg.dcp_sharded),
        sliding_window_reach=list(cfg.sliding_window_reach),
    )
    state = (nct, [b.gpu for b in tables.block_tables], tables.num_blocks.gpu)
    return types.SimpleNamespace(
        addr=addr, tables=tables, nct=nct, positions=positions, seq_lens=seq_lens, slices=slices,
        n=n, padded=bs.num_reqs_padded, num_tokens=num_tokens, three=three, state=state,
    )  # fmt: skip


def _adapter_step(c, idx, qsl):
    a = c.addr
    a.prepare_pos_seq_lens(idx, qsl, c.nct, c.positions, c.seq_lens)
    a.gather_block_tables(idx, c.padded)
    a.compute_slot_mappings(idx, qsl, c.positions[: c.num_tokens], c.num_tokens)


def _check(c) -> None:
    idx, qsl = c.slices[0]
    _adapter_step(c, idx, qsl)
    want = c.three.compute(idx, qsl, *c.state, num_reqs_padded=c.padded, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    pairs = [
        (c.positions, want.positions),
        (c.seq_lens, want.seq_lens),
        (c.tables.slot_mappings, want.slot_mappings),
        *zip(c.tables.input_block_tables, want.input_block_tables),
    ]
    for got, w in pairs:
        if not np.array_equal(got.cpu().numpy(), cupy.asnumpy(w)):
            raise SystemExit("the adapter's buffers differ from the three launches")


def _rows(c) -> dict:
    empty = cupy.RawKernel(r'extern "C" __global__ void empty() {}', "empty")
    bound = c.addr.step
    cur = torch.cuda.current_stream

    def adapter(i):
        idx, qsl = c.slices[i % SLICE_SETS]
        _adapter_step(c, idx, qsl)

    def bound_alone(i):
        idx, qsl = c.slices[i % SLICE_SETS]
        bound.launch(idx, qsl, None, stream=cur().cuda_stream)

    def three(i):
        idx, qsl = c.slices[i % SLICE_SETS]
        c.three.compute(idx, qsl, *c.state, num_reqs_padded=c.padded, stream=cur())

    return {
        "empty RawKernel": lambda i: empty((1,), (1,), ()),
        "adapter: MRV2's three calls": adapter,
        "bound launch alone": bound_alone,
        "three launches": three,
    }


def host_times(rows: dict, calls: int, repeats: int) -> dict:
    samples: dict = {k: [] for k in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            dt = time.perf_counter() - t0
            torch.cuda.synchronize()
            samples[name].append(dt / calls * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def gpu_time(fn, copies: int, replays: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--calls", type=int, default=2000, help="steps per host-time sample")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--copies", type=int, default=50, help="steps per captured graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cupy {cupy.__version__}  {time.strftime('%Y-%m-%d')}"
    )
    for shape in args.shapes.split(","):
        c = _case(shape)
        _check(c)
        rows = _rows(c)
        host = host_times(rows, args.calls, args.repeats)
        gpu = {
            k: gpu_time(rows[k], args.copies, args.replays) for k in ("adapter: MRV2's three calls", "three launches")
        }
        base = host["empty RawKernel"]
        print(f"\n{shape} (G=2, {c.n} requests, {c.num_tokens} tokens)")
        print(f"  {'row':32s} {'host us/step':>13s} {'x empty':>8s} {'GPU us/step':>12s}")
        for name, us in host.items():
            g = f"{gpu[name]:12.2f}" if name in gpu else f"{'':12s}"
            print(f"  {name:32s} {us:13.2f} {us / base:8.2f} {g}")
        results.append(dict(shape=shape, host_us=host, gpu_us=gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=platform.node(), device=torch.cuda.get_device_name(), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
