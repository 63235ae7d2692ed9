#!/usr/bin/env bash
# Issue 14, session 13: v9 across blocks with attention outputs (kvaddr_step1wm{R}_c{G}_*: the token
# blocks of kvaddr_step1w{R}_* + request and pad metadata blocks, the planner's default for 256 < bsz
# <= 4096 with attention on). About 2 minutes on one H200 (SANITIZE=1: about 4).
# From the repository root:   OUT=/some/dir bash scripts/gpu/attn_wide_check.sh
# Logs under $OUT (default /tmp/kvaddr-attn-wide):
#   1. tests/gpu/test_attention_wide_gpu.py and tests/gpu/test_attention_one_gpu.py (one pytest process:
#      the new kernel and the small-batch one against the NumPy reference, the switch at 257 requests);
#   2. SANITIZE=1: compute-sanitizer memcheck over the attention GPU tests (the wide ones at 257 and
#      1000 requests; 2049 / 4096 and the torch tests deselected), then racecheck over a subset;
#   3. benchmarks/bench_attention.py --quick: off, v8, m3 (bsz <= 256) and wm (257-4096) with their
#      variants, us and /off, the 1.5x verdict per row and the kv_indices bandwidth case.
# Exit status 0 when the tests (and sanitizers) pass; the benchmark's verdict is printed, not part of it.
set -u
OUT=${OUT:-/tmp/kvaddr-attn-wide}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
(git log --oneline -1 2>/dev/null || echo "no git metadata") | tee -a "$OUT/env.txt"

echo "== 1. GPU tests (kvaddr_step1wm* and kvaddr_step1m_*)"
start=$SECONDS
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_wide_gpu.py \
  tests/gpu/test_attention_one_gpu.py > "$OUT/pytest_wide.log" 2>&1
rc=$?
echo "pytest exit $rc in $((SECONDS - start)) s"; tail -n 3 "$OUT/pytest_wide.log"
((rc == 0)) || status=1

if [[ ${SANITIZE:-0} == 1 ]]; then
  echo "== 2. compute-sanitizer"
  tests="tests/gpu/test_attention_one_gpu.py tests/gpu/test_attention_wide_gpu.py tests/gpu/test_paged_attention_e2e_gpu.py tests/gpu/test_readme_attention_gpu.py"
  KVADDR_GPU_EXAMPLES=5 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider $tests -k "not torch and not inductor and not 2049 and not 4096" > "$OUT/memcheck.log" 2>&1
  rc=$?; echo "memcheck exit $rc"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 2
  ((rc == 0)) || status=1
  KVADDR_GPU_EXAMPLES=3 timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_attention_one_gpu.py tests/gpu/test_attention_wide_gpu.py \
    -k "not torch and not inductor and (one_gpu or unaligned or bound_step or mixed)" > "$OUT/racecheck.log" 2>&1
  rc=$?; echo "racecheck exit $rc"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -n 2
  ((rc == 0)) || status=1
fi

echo "== 3. benchmarks/bench_attention.py --quick"
timeout 120 python3 benchmarks/bench_attention.py --quick --json "$OUT/bench_attention.json" | tee "$OUT/bench_attention.log"
exit $status
