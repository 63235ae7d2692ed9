#!/usr/bin/env bash
# Issue 16, the fused step at its floor, session 6: v9 across blocks (kvaddr_step1w{R}_c{G}_*, the
# planner's kernel for 256 < bsz <= 4096 without attention outputs; docs/perf-notes.md, "Sixth
# session"). On a GPU machine, from the repository root (PYTHONPATH=. is set here):
#   1. tests/gpu/test_wide_step_gpu.py: the wide kernel against the NumPy reference (bsz 257 ... 4096,
#      every kind of batch and bad input, R = 4 / 8 / 16, 0-4 caches, int32 / int64 positions,
#      unaligned length arrays, switching v9 / wide / v8, graph replay and bind, hypothesis); the
#      first GPU test also compiles kernels.cu (30 more kernels than before);
#   2. benchmarks/floor_step.py --replays 15 --wide-r 4,8,16: issue 16's table with the new default
#      (decode 512, 1024 and 4096 on the wide kernel) and the sweep over R (T = bsz / R threads);
#   3. in the time left: tests/gpu/test_step_kernels_gpu.py (v8, v9, v9 with 1024-thread blocks, and
#      "v9-across": the wide kernel for EVERY batch of 1..4096 requests, so the worked examples and
#      edge cases run on it) and tests/gpu/test_bound_step_gpu.py (bind across the kernel boundaries);
#   4. only with WIDE_SANITIZE=1 (not in the 4 minutes): compute-sanitizer memcheck and racecheck over
#      a subset of step 1.
# Logs in $OUT (default ./out). Under 4 minutes on the H200 (each step has its own timeout).
# Exit 0 when everything that ran passed.
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 | tee -a "$OUT/env.txt"

echo "== 1. the wide kernel against the reference (tests/gpu/test_wide_step_gpu.py)"
KVADDR_GPU_EXAMPLES=${KVADDR_WIDE_EXAMPLES:-60} timeout 130 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_wide_step_gpu.py > "$OUT/pytest_wide.log" 2>&1
rc1=$?
tail -n 12 "$OUT/pytest_wide.log"
[[ $rc1 == 0 ]] || status=1
echo "(step 1: exit $rc1, $((SECONDS - t0)) s so far)"

echo "== 2. benchmarks/floor_step.py --replays 15 --wide-r 4,8,16"
timeout 100 python3 benchmarks/floor_step.py --replays 15 --wide-r 4,8,16 --json "$OUT/floor_step.json" \
  > "$OUT/floor_step.log" 2>&1
rc2=$?
cat "$OUT/floor_step.log"
[[ $rc2 == 0 ]] || status=1
echo "(step 2: exit $rc2, $((SECONDS - t0)) s so far)"

left=$((235 - (SECONDS - t0)))
rc3=skipped
if ((left >= 15)); then
  echo "== 3. the step kernels' and the bound step's GPU tests (v9-across: the wide kernel at every bsz; ${left} s)"
  KVADDR_GPU_EXAMPLES=${KVADDR_STEP_EXAMPLES:-30} timeout "$left" python3 -m pytest -q -rs -p no:cacheprovider \
    tests/gpu/test_step_kernels_gpu.py tests/gpu/test_bound_step_gpu.py > "$OUT/pytest_step.log" 2>&1
  rc3=$?
  tail -n 8 "$OUT/pytest_step.log"
  [[ $rc3 == 0 || $rc3 == 124 ]] || status=1  # 124: the 4-minute budget ran out (see the log)
else
  echo "== 3. step/bound tests skipped: ${left} s left (run: pytest tests/gpu/test_step_kernels_gpu.py)"
fi

rc4=skipped
if [[ ${WIDE_SANITIZE:-0} == 1 ]]; then
  echo "== 4. compute-sanitizer memcheck and racecheck over a subset of the wide tests"
  rc4=0
  for tool in memcheck racecheck; do
    KVADDR_GPU_EXAMPLES=5 compute-sanitizer --tool "$tool" --error-exitcode 99 python3 -m pytest -q -x \
      -p no:cacheprovider tests/gpu/test_wide_step_gpu.py \
      -k "against_the_reference and (257- or 1025- or 4096-) or switching or every_cache_count" \
      > "$OUT/sanitize_$tool.log" 2>&1 || rc4=$?
    tail -n 4 "$OUT/sanitize_$tool.log"
  done
  [[ $rc4 == 0 ]] || status=1
fi

echo "== summary: wide tests exit $rc1 | floor_step exit $rc2 | step/bound tests exit $rc3 (124 = timed out)" \
  "| sanitizers $rc4 | $((SECONDS - t0)) s"
grep -E "decode (512|1024|4096)" "$OUT/floor_step.log" | grep -E "kvaddr_step1w|R=" || true
echo "wide_check: exit $status (logs in $OUT)"
exit $status
