"""Run ``kvaddr check --baseline FILE`` with the fused strategy deliberately slowed.

The regression gate's alarm test: on the GPU the check must exit 1 and name the
shape and the strategy (fused). The library has no hook for this: for this process
only, the script wraps

* ``kvaddr.strategies.gpu.Fused.step`` (GPU) to also launch kernels.cu's empty
  kernel ``--extra-launches`` times on the step's own stream after the fused
  launch (and, with ``--spin-us``, a small busy-loop kernel compiled here), so
  eager steps and captured CUDA graphs both carry the extra work;
* ``kvaddr.strategies.cpu.Fused.step`` (CPU path) to run the NumPy step
  ``--cpu-repeats`` more times;

then runs ``kvaddr check`` in-process, which replays the baseline's profile
with the slowed strategy. Everything after ``--`` (or any option this script
does not know) goes to ``kvaddr check``.

Usage::

    python scripts/gpu/slow_fused_check.py --baseline profiles/baselines/h200.json
    python scripts/gpu/slow_fused_check.py --baseline base.json --extra-launches 4 -- --json -

Exit status: that of ``kvaddr check`` (1 means the slowdown was caught).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

try:
    import kvaddr  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SPIN_SOURCE = r"""
extern "C" __global__ void kvaddr_bench_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _gpu_extra_work(extra_launches: int, spin_us: float):
    """A function ``extra(stream)`` that launches the extra kernels on ``stream`` (anything kvaddr accepts)."""
    import cupy

    from kvaddr import kernel_loader
    from kvaddr.validation import cupy_stream, stream_handle

    streams: dict = {}
    spin: dict = {}

    def extra(stream) -> None:
        handle = stream_handle(stream)
        s = streams.get(handle)
        if s is None:
            s = streams[handle] = cupy_stream(handle)
        empty = kernel_loader.get_function("kvaddr_empty")
        for _ in range(extra_launches):
            empty((1,), (1,), (), 0, s)
        if spin_us > 0:
            dev = cupy.cuda.runtime.getDevice()
            if dev not in spin:
                kernel = cupy.RawKernel(SPIN_SOURCE, "kvaddr_bench_spin")
                khz = cupy.cuda.runtime.getDeviceProperties(dev)["clockRate"]
                spin[dev] = (kernel, int(spin_us * khz / 1e3))
            kernel, cycles = spin[dev]
            kernel((1,), (1,), (cupy.int64(cycles),), stream=s)

    return extra


@contextlib.contextmanager
def slowed_fused(extra_launches: int = 8, spin_us: float = 0.0, cpu_repeats: int = 4):
    """Within the block, the fused strategy's step does extra work on the GPU and the CPU.

    Parameters
    ----------
    extra_launches : int
        GPU: empty-kernel launches added to every fused step (about 0.5 us
        each in a CUDA graph on an H200, against 3.3 us for the step).
    spin_us : float
        GPU: also one busy-loop kernel of about this many microseconds.
    cpu_repeats : int
        CPU path: extra NumPy steps added to every fused step.
    """
    from kvaddr.strategies import cpu as cpu_strategies

    patched = []

    cpu_step = cpu_strategies.Fused.step

    def slow_cpu_step(self, *args, **kwargs):
        for _ in range(cpu_repeats):
            cpu_step(self, *args, **kwargs)
        return cpu_step(self, *args, **kwargs)

    patched.append((cpu_strategies.Fused, cpu_step))
    cpu_strategies.Fused.step = slow_cpu_step
    try:
        try:
            from kvaddr.strategies import gpu as gpu_strategies
        except Exception:  # no CuPy: the CPU path only
            gpu_strategies = None
        if gpu_strategies is not None:
            gpu_step = gpu_strategies.Fused.step
            state: dict = {}

            def slow_gpu_step(self, *args, stream=None, **kwargs):
                out = gpu_step(self, *args, stream=stream, **kwargs)
                if "extra" not in state:
                    state["extra"] = _gpu_extra_work(extra_launches, spin_us)
                state["extra"](stream)
                return out

            patched.append((gpu_strategies.Fused, gpu_step))
            gpu_strategies.Fused.step = slow_gpu_step
        yield
    finally:
        for cls, step in patched:
            cls.step = step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the baseline file kvaddr check compares with")
    parser.add_argument("--extra-launches", type=int, default=8, help="GPU: empty kernels added per fused step")
    parser.add_argument("--spin-us", type=float, default=0.0, help="GPU: a busy-loop kernel of this length too")
    parser.add_argument("--cpu-repeats", type=int, default=4, help="CPU path: extra NumPy steps per fused step")
    args, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    from kvaddr.cli import cli

    print(
        f"slow_fused_check: fused slowed by {args.extra_launches} extra empty launches per step"
        + (f" and a {args.spin_us:g} us busy loop" if args.spin_us > 0 else "")
        + f" on the GPU, {args.cpu_repeats} extra NumPy steps on the CPU",
        file=sys.stderr,
    )
    with slowed_fused(args.extra_launches, args.spin_us, args.cpu_repeats):
        try:
            cli.main(args=["check", "--baseline", args.baseline, *rest], prog_name="kvaddr")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    verdict = "caught: kvaddr check exited 1" if code == 1 else f"NOT caught: kvaddr check exited {code}"
    print(f"slow_fused_check: the slowed fused step was {verdict}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
