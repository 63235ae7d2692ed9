#!/usr/bin/env bash
# On a GPU machine, from the repository root: the GPU test suite, the benchmark, and
# compute-sanitizer over the GPU tests. Logs go to $OUT (default /tmp/kvaddr-gpu).
#   bash scripts/gpu/gpu_suite.sh [all|tests|bench|sanitize]
# tests: pytest over tests/gpu (the "gpu" hypothesis profile: 600 examples per property), with
#   tests/unit beside it in the background (pytest_unit.log); bench: benchmarks/bench_step.py;
# sanitize: compute-sanitizer memcheck, racecheck, initcheck and synccheck (SANITIZERS) over
#   tests/gpu, SANITIZE_EXAMPLES hypothesis examples per property (60). Exit 1 if any stage failed.
set -u -o pipefail
what=${1:-all}
OUT=${OUT:-/tmp/kvaddr-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1 KVADDR_HYPOTHESIS_PROFILE=${KVADDR_HYPOTHESIS_PROFILE:-gpu}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'driver', cupy.cuda.runtime.driverGetVersion())" | tee -a "$OUT/env.txt"
if [[ $what == all || $what == tests ]]; then
  # tests/unit beside tests/gpu, in the background: with torch installed the unit tests take
  # about 6 minutes of CPU.
  timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/unit > "$OUT/pytest_unit.log" 2>&1 &
  unit=$!
  timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$OUT/pytest.log" 2>&1 || status=1
  tail -n 25 "$OUT/pytest.log"
  wait "$unit" || status=1
  echo "tests/unit:"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_unit.log" | head -n 20; tail -n 1 "$OUT/pytest_unit.log"
fi
if [[ $what == all || $what == bench ]]; then
  timeout 180 python3 benchmarks/bench_step.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
if [[ $what == all || $what == sanitize ]]; then
  for tool in ${SANITIZERS:-memcheck racecheck initcheck synccheck}; do
    KVADDR_GPU_EXAMPLES=${SANITIZE_EXAMPLES:-60} timeout "${SANITIZE_TIMEOUT:-280}" compute-sanitizer --tool "$tool" \
      --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: exit $rc"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -n 3
    [[ $rc == 0 ]] || status=1
  done
fi
exit $status
