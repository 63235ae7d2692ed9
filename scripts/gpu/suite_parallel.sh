#!/usr/bin/env bash
# The GPU suite and compute-sanitizer (memcheck, racecheck) over the kernel tests, run side by
# side on one GPU (correctness only: nothing here is timed), then the cold start of
# `kvaddr profile --batch 64` alone. Logs and a summary under ${OUT:-/tmp/kvaddr-gpu}.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvaddr-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
subset=(tests/gpu/test_step_kernels_gpu.py tests/gpu/test_wide_step_gpu.py tests/gpu/test_attention_one_gpu.py
  tests/gpu/test_attention_wide_gpu.py tests/gpu/test_bound_step_gpu.py tests/gpu/test_vllm_step.py
  tests/gpu/test_vllm_attention_gpu.py tests/gpu/test_bad_inputs_gpu.py tests/gpu/test_vllm_bind_batch_gpu.py
  tests/gpu/test_mtp_gpu.py tests/gpu/test_vllm_draft_gpu.py tests/gpu/test_dsa_topk_gpu.py tests/gpu/test_dsa_step_gpu.py)
select="not hypothesis and not inductor and not million and not compile and not 16384 and not 8192"
# racecheck checks shared memory: the kernels that stage in it (small, wide, attention blocks).
race=(tests/gpu/test_step_kernels_gpu.py tests/gpu/test_attention_one_gpu.py tests/gpu/test_attention_wide_gpu.py
  tests/gpu/test_vllm_attention_gpu.py tests/gpu/test_mtp_gpu.py tests/gpu/test_vllm_draft_gpu.py
  tests/gpu/test_dsa_topk_gpu.py tests/gpu/test_dsa_step_gpu.py)
for tool in memcheck racecheck; do
  if [[ $tool == memcheck ]]; then files=("${subset[@]}"); else files=("${race[@]}"); fi
  # the time limit ends pytest, not the sanitizer, so the sanitizer still prints its summary
  (KVADDR_GPU_EXAMPLES=5 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    timeout "${SANITIZE_S:-400}" python3 -m pytest -q -p no:cacheprovider "${files[@]}" -k "$select" \
    > "$OUT/sanitize_$tool.log" 2>&1
   echo "exit $?" >> "$OUT/sanitize_$tool.log") &
done
# the suite in two halves side by side (the GPU is far from busy with one)
mapfile -t files < <(ls tests/gpu/test_*.py)
half=(); other=()
for i in "${!files[@]}"; do if (( i % 2 )); then other+=("${files[$i]}"); else half+=("${files[$i]}"); fi; done
(timeout "${SUITE_S:-430}" python3 -m pytest -q -p no:cacheprovider --maxfail=60 "${other[@]}" > "$OUT/suite2.log" 2>&1
 echo "suite exit $?" >> "$OUT/suite2.log") &
timeout "${SUITE_S:-430}" python3 -m pytest -q -p no:cacheprovider --maxfail=60 "${half[@]}" > "$OUT/suite.log" 2>&1
echo "suite exit $?" >> "$OUT/suite.log"
wait
cold=$(mktemp -d)
start=$(date +%s%N)
CUPY_CACHE_DIR=$cold timeout 120 python3 -m kvaddr.cli profile --batch 64 > "$OUT/profile_cold.log" 2>&1
echo "exit $? wall $(( ($(date +%s%N) - start) / 1000000 )) ms" >> "$OUT/profile_cold.log"
start=$(date +%s%N)
CUPY_CACHE_DIR=$cold timeout 120 python3 -m kvaddr.cli profile --batch 64 > "$OUT/profile_warm.log" 2>&1
echo "exit $? wall $(( ($(date +%s%N) - start) / 1000000 )) ms" >> "$OUT/profile_warm.log"
{
  for f in suite suite2; do
    echo "== $f"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -40; tail -n 2 "$OUT/$f.log"
  done
  for tool in memcheck racecheck; do
    echo "== $tool"; grep -E "^(FAILED|ERROR)|ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|^exit" "$OUT/sanitize_$tool.log" | tail -n 6
  done
  echo "== profile cold"; tail -n 1 "$OUT/profile_cold.log"; grep -iE "saves|fused" "$OUT/profile_cold.log" | head -3
  echo "== profile warm"; tail -n 1 "$OUT/profile_warm.log"
} | tee "$OUT/summary.txt"
