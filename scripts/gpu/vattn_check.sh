#!/usr/bin/env bash
# The vLLM step's attention metadata (issue 14: VllmStepPlanner(attention=...), the kernel
# kvaddr_vllm_step_v2a) on the H200, from the repository root, in under 120 s:
#   1. tests/gpu/test_vllm_attention_gpu.py: the kernel against the NumPy reference;
#   2. the existing vLLM GPU tests (tests/gpu/test_vllm*.py: v2, the memo path, the
#      three-launch baseline) -- kvaddr_vllm_step_v2 is byte-identical, they must still pass;
#   3. compute-sanitizer memcheck and racecheck over a few attention tests (metadata blocks,
#      capacity overflow, bad values, corrupted inputs);
#   4. benchmarks/bench_vllm.py --attention: v2 with attention on vs off, graph mode, decode
#      64/1024/4096 and the mixed batch, 1 and 2 groups, ratio (target <= 1.5x), for the
#      metadata variants (meta_impl 0 = first version at 8x64 / 32x16 / auto, meta_impl 1 =
#      shorter chain at auto / 32x16 / 8x32);
#   5. scripts/gpu/vattn_sass.py: the SASS order of vllm_attn_block1 (LDG before BAR.SYNC?).
# Logs under $OUT (default /tmp/kvaddr-vattn); a summary at the end.
#   bash scripts/gpu/vattn_check.sh
set -u
OUT=${OUT:-/tmp/kvaddr-vattn}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
declare -A result
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
git log -1 --format='commit %H %s' >> "$OUT/env.txt" 2>/dev/null
cat "$OUT/env.txt"

summary() {  # the last pytest line of a log
  grep -E "[0-9]+ (passed|failed|error)" "$1" | tail -n 1
}

# 0. warm the kernel module once (NVRTC compile), so the timeouts below measure the tests
timeout 60 $PY -c "from kvaddr import kernel_loader as k; k.get_function('kvaddr_vllm_step_v2a', 0); print('module ok')" \
  > "$OUT/warm.log" 2>&1
echo "warm: $(tail -n 1 "$OUT/warm.log")"

timeout 40 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_attention_gpu.py > "$OUT/pytest_vattn.log" 2>&1
result[attention_tests]="rc $? $(summary "$OUT/pytest_vattn.log")"
echo "attention GPU tests: ${result[attention_tests]}"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_vattn.log" | head -n 10

timeout 45 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_step.py tests/gpu/test_vllm_memo.py \
  tests/gpu/test_vllm_three_launch.py > "$OUT/pytest_vllm.log" 2>&1
result[vllm_tests]="rc $? $(summary "$OUT/pytest_vllm.log")"
echo "existing vLLM GPU tests: ${result[vllm_tests]}"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_vllm.log" | head -n 10

SUBSET="worked_example or capacity_overflow or bad_value_rows"
for tool in memcheck racecheck; do
  if (( SECONDS > 60 )); then result[$tool]="skipped (time)"; continue; fi
  timeout 14 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider -x tests/gpu/test_vllm_attention_gpu.py -k "$SUBSET" \
    > "$OUT/sanitize_vattn_$tool.log" 2>&1
  rc=$?
  result[$tool]="rc $rc (124 = timed out: partial) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_vattn_$tool.log" | tail -n 1) $(summary "$OUT/sanitize_vattn_$tool.log")"
  echo "compute-sanitizer $tool: ${result[$tool]}"
done

timeout 40 $PY benchmarks/bench_vllm.py --attention --copies 50 --replays 10 --json "$OUT/bench_vattn.json" \
  > "$OUT/bench_vattn.log" 2>&1
result[bench]="rc $? (0: every row within 1.5x)"
cat "$OUT/bench_vattn.log" | grep -v "^$" | tail -n 12

# (nvcc of kernels.cu takes ~15 s: only when the budget allows; alone: python3 scripts/gpu/vattn_sass.py $OUT)
if (( SECONDS < 95 )); then
  timeout $(( 118 - SECONDS )) $PY scripts/gpu/vattn_sass.py "$OUT" > "$OUT/sass_vattn.log" 2>&1
  result[sass]="rc $? $(grep '^vattn_sass:' "$OUT/sass_vattn.log" | tail -n 1)"
else
  result[sass]="skipped (time)"
fi

echo "== vattn summary (${SECONDS}s) =="
for k in attention_tests vllm_tests memcheck racecheck bench sass; do echo "$k: ${result[$k]:-not run}"; done
