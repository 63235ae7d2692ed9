"""Destroying CUDA streams that ran work makes later graph kernel nodes slower.

Times one CUDA graph of 200 empty-kernel nodes (median of 30 replays, time per
node) on a stream kept for the whole process: fresh, after `--streams` other
streams each ran 2000 eager launches and a 100-node graph and were destroyed,
after a pause, and on a new stream.

Measured on an H200 (driver 580.159.04, CuPy 14.2.0): 0.52 us per node fresh,
0.70 us after five such streams were dropped. One dropped stream with 2000 eager
launches, or with one graph, did not move it. A whole `kvaddr profile`, which
then made and dropped one stream of its own, did (0.52 -> 0.69-0.70 us), and
the cost stayed after a 10 s pause and on a new stream. This is why kvaddr times
every run of a process on one stream (kvaddr.measure.timing.measurement_stream) and
never drops it.

    PYTHONPATH=. python scripts/gpu/stream_drop_probe.py [--streams 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import cupy

from kvaddr import kernel_loader


def node_time_us(stream, nodes=200, replays=30) -> float:
    empty = kernel_loader.get_function("kvaddr_empty")
    stream.synchronize()
    stream.begin_capture()
    for _ in range(nodes):
        empty((1,), (1,), (), 0, stream)
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(replays):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / nodes)
    return statistics.median(times)


def drop_streams(n: int) -> None:
    empty = kernel_loader.get_function("kvaddr_empty")
    for _ in range(n):
        x = cupy.cuda.Stream(non_blocking=True)
        for _ in range(2000):
            empty((1,), (1,), (), 0, x)
        x.begin_capture()
        for _ in range(100):
            empty((1,), (1,), (), 0, x)
        g = x.end_capture()
        g.launch(x)
        x.synchronize()
        del g, x
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=5, help="streams that run work and are destroyed")
    ap.add_argument("--pause", type=float, default=10.0, help="seconds idle before the last probes")
    a = ap.parse_args()
    kept = cupy.cuda.Stream(non_blocking=True)
    print(f"fresh: {node_time_us(kept):.3f} us per empty graph node")
    drop_streams(a.streams)
    print(f"after {a.streams} streams that ran work were destroyed: {node_time_us(kept):.3f} us")
    time.sleep(a.pause)
    print(f"after {a.pause:g} s idle: {node_time_us(kept):.3f} us")
    print(f"on a new stream: {node_time_us(cupy.cuda.Stream(non_blocking=True)):.3f} us")


if __name__ == "__main__":
    main()
