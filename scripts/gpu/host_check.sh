#!/usr/bin/env bash
# Issue 15's host time (helper "host", rounds 1-2): on a GPU machine, from the repository root.
#   OUT=/some/dir bash scripts/gpu/host_check.sh
# 1. the GPU tests this change touches: the torch ops (the packed kvaddr::step_into and the old
#    kvaddr::step: reference, old == new, opcheck, compile, graph capture, the README snippets),
#    compute()'s memo of checked inputs (tests/gpu/test_compute_memo_gpu.py), the bound launch,
#    and compute() against the reference (integration, bad inputs);
# 2. the host-time benchmark (benchmarks/bench_host.py): one run, every row side by side:
#    "torch op (eager)" is the packed op step_into (bound <= 2.0x), next to "old schema
#    kvaddr::step" (the op before), the .tables overload, the autograd fallback, and
#    kvaddr.torch.step with its views kept per bsz vs built per call;
# 3. benchmarks/host_overhead_cpu.py on the same host (kvaddr's Python alone, driver faked;
#    the old vs packed op through torch's dispatcher, interleaved).
# Logs under $OUT (default /tmp/kvaddr-host). About 2-3 minutes.
set -u
OUT=${OUT:-/tmp/kvaddr-host}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)" | tee -a "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/env.txt"

timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_torch_ops_gpu.py tests/gpu/test_compute_memo_gpu.py tests/gpu/test_bound_step_gpu.py \
  tests/gpu/test_gpu_integration.py tests/gpu/test_bad_inputs_gpu.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest_gpu.log"

timeout 180 python3 benchmarks/bench_host.py --json "$OUT/bench_host.json" 2>&1 | tee "$OUT/bench_host.log"
rc=${PIPESTATUS[0]}
echo "bench_host.py: exit $rc (1 = a bound of issue 15 missed)"
[[ $rc == 0 || $rc == 1 ]] || status=1

timeout 120 python3 benchmarks/host_overhead_cpu.py --n 2000 --repeats 15 --json "$OUT/host_overhead_cpu.json" \
  2>&1 | tee "$OUT/host_overhead_cpu.log" || status=1
exit $status
