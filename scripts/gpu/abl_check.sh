#!/usr/bin/env bash
# Issue 16, v9 at its floor: ONE H200 run that explains v9's gap over decode-out and proves
# the candidate fixes. On a GPU machine, from the repository root (PYTHONPATH=. is set here):
#   1. tests/gpu/test_ablate_v9_gpu.py: the fixes (KV_FIX_DECODE_FIRST, KV_FIX_LEAN, both) and
#      v9 recompiled in the ablation module, against the NumPy reference (compiles kernels.cu
#      twice: the library's module and the KV_ABLATION one; CuPy caches both for step 2);
#   2. benchmarks/ablate_v9.py: decode 1 / 64 / 256 x 1 and 2 caches, graph mode: decode-out,
#      v9, every ablation and fix (us and x decode-out), what each phase costs, the verdicts;
#   3. v9's own GPU tests (tests/gpu/test_step_kernels_gpu.py, the v9 rows, short hypothesis).
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

echo "== 1. candidate fixes against the reference (tests/gpu/test_ablate_v9_gpu.py)"
timeout 58 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_ablate_v9_gpu.py > "$OUT/pytest_fixes.log" 2>&1
rc1=$?
tail -n 6 "$OUT/pytest_fixes.log"
[[ $rc1 == 0 ]] || status=1
echo "(step 1: exit $rc1, $((SECONDS - t0)) s so far)"

echo "== 2. benchmarks/ablate_v9.py"
timeout 32 python3 benchmarks/ablate_v9.py --json "$OUT/ablate_v9.json" > "$OUT/ablate_v9.log" 2>&1
rc2=$?
cat "$OUT/ablate_v9.log"
[[ $rc2 == 0 ]] || status=1
echo "(step 2: exit $rc2, $((SECONDS - t0)) s so far)"

echo "== 3. v9's GPU tests (tests/gpu/test_step_kernels_gpu.py, v9 rows)"
timeout 25 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_step_kernels_gpu.py \
  -k "(v9 and not wide) or switching or every_cache_count" > "$OUT/pytest_v9.log" 2>&1
rc3=$?
tail -n 4 "$OUT/pytest_v9.log"
[[ $rc3 == 0 ]] || status=1

echo "== summary: fix tests exit $rc1 | ablate_v9 exit $rc2 | v9 tests exit $rc3 (124 = timed out) | $((SECONDS - t0)) s"
grep -E "^summary:" "$OUT/ablate_v9.log" || true
echo "abl_check: exit $status (logs in $OUT)"
exit $status
