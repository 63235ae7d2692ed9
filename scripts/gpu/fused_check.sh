#!/usr/bin/env bash
# Issue 16 (fused step v9, the single-block kernel): on a GPU machine, from the repository
# root, with PYTHONPATH=. -- the fused-step GPU tests on both kernels (v8, v9), compute-
# sanitizer memcheck and racecheck on a focused subset, a short fuzz run of every design,
# and benchmarks/floor_step.py (v8 vs v9 against the floors and the targets). Logs in $OUT.
#   bash scripts/gpu/fused_check.sh        (about 5 minutes; exit 0 when every part passed)
set -u
OUT=${OUT:-/tmp/kvaddr-fused}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 | tee -a "$OUT/env.txt"

echo "== 1. GPU tests: both kernels against the reference, and the suites that run the fused step"
KVADDR_GPU_EXAMPLES=${KVADDR_GPU_EXAMPLES:-120} timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_step_kernels_gpu.py \
  tests/gpu/test_bad_inputs_gpu.py tests/gpu/test_kernel_params_gpu.py tests/gpu/test_gpu_integration.py \
  tests/gpu/test_gpu_strategies.py tests/gpu/test_bound_step_gpu.py > "$OUT/pytest.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest.log"

echo "== 2. compute-sanitizer memcheck and racecheck (v9: worked examples, edge cases, cache counts; switching)"
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_step_kernels_gpu.py -k "(v9 and (worked_examples or edge_cases)) or switching or every_cache_count" \
    > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -n 3
  [[ $rc == 0 ]] || status=1
done

echo "== 3. fuzz: every strategy, the fused step as v8, v9 and v9 with no capacity limit"
timeout 70 python3 scripts/gpu/fuzz.py --steps 150 --seed 16016 > "$OUT/fuzz.log" 2>&1 || status=1
tail -n 5 "$OUT/fuzz.log"

echo "== 4. floor_step: v8 vs v9 against the floors and issue 16's targets"
timeout 150 python3 benchmarks/floor_step.py --json "$OUT/floor_step.json" 2>&1 | tee "$OUT/floor_step.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
echo "fused_check: exit $status (logs in $OUT)"
exit $status
