#!/usr/bin/env bash
# The GPU acceptance run, on one GPU (an H200), from the repository root:
#   PYTHONPATH=. bash scripts/gpu/validate.sh
# Nothing is built: each stage imports kvaddr from this checkout. In order, logs under $OUT
# (default /tmp/kvaddr-gpu):
#   1. cold start: benchmarks/bench_cold.py (fresh processes, empty then warm kernel cache),
#      cold.json and cold.log;
#   2. the GPU tests: pytest -q -x tests/gpu (KVADDR_HYPOTHESIS_PROFILE as set, else the default),
#      pytest.log;
#   3. compute-sanitizer memcheck and racecheck over a representative subset of tests/gpu (every
#      kernel of the dispatch table with and without attention outputs, the bound launch and the vLLM
#      step; no torch, no hypothesis, KVADDR_GPU_EXAMPLES=5), sanitize_memcheck.log and
#      sanitize_racecheck.log;
#   4. a summary table (summary.txt): each stage's exit code, the pytest counts, the sanitizers'
#      summary lines and the cold-start rows.
# A failing stage is reported and the next one still runs; the exit status is 1 if any stage failed.
# Expected time on an H200: 2-4 min (cold start: each case twice in a fresh process, the CLI row
# included) + 3-6 min (tests) + under 4 min (sanitizers: 130 s + 110 s at most).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvaddr-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
declare -A rc

echo "== 1. cold start: benchmarks/bench_cold.py"
python3 -c "import cupy, kvaddr; print('kvaddr from', kvaddr.__file__, '| cupy', cupy.__version__)" 2>&1 | tee "$OUT/env.txt"
timeout 600 python3 benchmarks/bench_cold.py --json "$OUT/cold.json" 2>&1 | tee "$OUT/cold.log"
rc[cold]=${PIPESTATUS[0]}

echo "== 2. pytest -q -x tests/gpu"
timeout 900 python3 -m pytest -q -x -rs tests/gpu -p no:cacheprovider > "$OUT/pytest.log" 2>&1
rc[tests]=$?
tail -n 15 "$OUT/pytest.log"

echo "== 3. compute-sanitizer memcheck and racecheck over a subset of tests/gpu"
subset=()
for f in tests/gpu/test_step_kernels_gpu.py tests/gpu/test_wide_step_gpu.py tests/gpu/test_attention_one_gpu.py \
  tests/gpu/test_attention_wide_gpu.py tests/gpu/test_bound_step_gpu.py tests/gpu/test_vllm_step.py; do
  [[ -e $f ]] && subset+=("$f")
done
select="not torch and not hypothesis and not inductor and not million"
for tool in memcheck racecheck; do
  limit=$([[ $tool == memcheck ]] && echo 130 || echo 110)
  KVADDR_GPU_EXAMPLES=5 timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider "${subset[@]}" -k "$select" > "$OUT/sanitize_$tool.log" 2>&1
  rc[$tool]=$?
  echo "compute-sanitizer $tool: exit ${rc[$tool]}"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -n 3
done

{
  echo "== summary (logs in $OUT)"
  printf '%-12s %-6s %s\n' stage exit detail
  printf '%-12s %-6s %s\n' cold "${rc[cold]}" "$OUT/cold.log"
  printf '%-12s %-6s %s\n' tests "${rc[tests]}" "$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"
  for tool in memcheck racecheck; do
    line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize_$tool.log" | tail -n 1)
    counts=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/sanitize_$tool.log" | tail -n 1)
    printf '%-12s %-6s %s | %s\n' "$tool" "${rc[$tool]}" "${line:-no summary line}" "${counts:-no pytest line}"
  done
  echo "cold start (s):"
  sed -n '/^case /,$p' "$OUT/cold.log"
} | tee "$OUT/summary.txt"
failed=""
for k in cold tests memcheck racecheck; do
  [[ ${rc[$k]} == 0 ]] || failed+=" $k"
done
if [[ -n $failed ]]; then
  echo "validate: FAILED:$failed"
  exit 1
fi
echo "validate: every stage passed"
