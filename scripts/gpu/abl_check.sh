#!/usr/bin/env bash
# Issue 16, v9 at its floor, round 2: ONE H200 run that proves the new v9 default
# (kvaddr_step1_c* = kernels.cu's KV_V9_DEFAULT, mask 416) and times it beside v9-old.
# On a GPU machine, from the repository root (PYTHONPATH=. is set here):
#   1. tests/gpu/test_ablate_v9_gpu.py: every fix bit (round 2's record bits were removed with
#      the sticky records of session 6) and mask 0 (v9-old) against the NumPy reference (compiles
#      kernels.cu twice: the library's module and the KV_ABLATION one; CuPy caches both);
#   2. v9's own GPU tests (tests/gpu/test_step_kernels_gpu.py, every v9 row: worked examples,
#      edge cases, random and hypothesis steps, bad-input matrix, graph replay, switching
#      v8 / v9 / v9-old): these run the library's default, i.e. the new kernels;
#   3. benchmarks/ablate_v9.py: decode 1 / 64 / 256 x 1 and 2 caches, graph mode: decode-out,
#      v9 (default), v9-old, every ablation and fix (us and x decode-out), the verdicts;
#   4. benchmarks/floor_step.py --replays 15 (issue 16's table with the new default), in the
#      time left.
# Logs in $OUT. Under 120 s on the H200 (each step has its own timeout). Exit 0 when all passed.
set -u
OUT=${OUT:-/tmp/kvaddr-abl}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
export KVADDR_GPU_EXAMPLES=${KVADDR_GPU_EXAMPLES:-20}
status=0
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 | tee -a "$OUT/env.txt"

echo "== 1. fixes against the reference (tests/gpu/test_ablate_v9_gpu.py)"
timeout 62 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_ablate_v9_gpu.py > "$OUT/pytest_fixes.log" 2>&1
rc1=$?
tail -n 6 "$OUT/pytest_fixes.log"
[[ $rc1 == 0 ]] || status=1
echo "(step 1: exit $rc1, $((SECONDS - t0)) s so far)"

echo "== 2. v9's GPU tests, now the default kernels (tests/gpu/test_step_kernels_gpu.py, v9 rows)"
timeout 20 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_step_kernels_gpu.py \
  -k "v9 or switching or every_cache_count" > "$OUT/pytest_v9.log" 2>&1
rc2=$?
tail -n 4 "$OUT/pytest_v9.log"
[[ $rc2 == 0 ]] || status=1
echo "(step 2: exit $rc2, $((SECONDS - t0)) s so far)"

echo "== 3. benchmarks/ablate_v9.py"
timeout 20 python3 benchmarks/ablate_v9.py --json "$OUT/ablate_v9.json" > "$OUT/ablate_v9.log" 2>&1
rc3=$?
cat "$OUT/ablate_v9.log"
[[ $rc3 == 0 ]] || status=1
echo "(step 3: exit $rc3, $((SECONDS - t0)) s so far)"

left=$((115 - (SECONDS - t0)))
rc4=skipped
if ((left >= 8)); then
  echo "== 4. benchmarks/floor_step.py --replays 15 (timeout ${left} s)"
  timeout "$left" python3 benchmarks/floor_step.py --replays 15 --json "$OUT/floor_step.json" > "$OUT/floor_step.log" 2>&1
  rc4=$?
  cat "$OUT/floor_step.log"
  [[ $rc4 == 0 || $rc4 == 124 ]] || status=1  # a timeout here only means the budget ran out
else
  echo "== 4. floor_step.py skipped: ${left} s left"
fi

echo "== summary: fix tests exit $rc1 | v9 tests exit $rc2 | ablate_v9 exit $rc3 | floor_step exit $rc4 (124 = timed out) | $((SECONDS - t0)) s"
grep -E "^summary:" "$OUT/ablate_v9.log" || true
echo "abl_check: exit $status (logs in $OUT)"
exit $status
