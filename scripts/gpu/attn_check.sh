#!/usr/bin/env bash
# Issue 14's speed work (helper "attn"): the request-parallel attention metadata blocks.
# On the H200, from the repository root:   OUT=/some/dir bash scripts/gpu/attn_check.sh
# Logs under $OUT (default /tmp/kvaddr-attn); about 4-6 minutes of GPU time.
#   1. the attention GPU tests, every test once per metadata implementation (meta0 = the first
#      version, meta1 = request-parallel, meta3 = request-parallel in one round, kv_meta_block3;
#      the lanes test also runs meta_impl 2, the row prefetch, and 3 at every lane count);
#   2. compute-sanitizer memcheck and racecheck over scripts/gpu/attn_sanitize_probe.py
#      (every implementation and several lane counts on batches reaching every branch);
#   3. benchmarks/bench_attention.py: old, new (impl 1), one (impl 3) and impl 3's timing ablations
#      (-np no pass over the lengths, -nc no row copy, -nb neither) for every shape, and the
#      kv_indices bandwidth case (round 2 of issue 14).
# Exit status 0 when all three pass (the benchmark's own verdicts included).
set -u
OUT=${OUT:-/tmp/kvaddr-attn}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$OUT/env.txt"
(git log --oneline -1 2>/dev/null || echo "no git metadata") | tee -a "$OUT/env.txt"

echo "== 1. attention GPU tests (implementations 0, 1, 3)"
timeout 420 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_paged_attention_e2e_gpu.py tests/gpu/test_bad_inputs_gpu.py \
  tests/gpu/test_readme_attention_gpu.py tests/gpu/test_kernel_params_gpu.py > "$OUT/pytest_attention.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest_attention.log"

echo "== 2. compute-sanitizer"
for tool in memcheck racecheck; do
  timeout ${SANITIZE_TIMEOUT:-200} compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 scripts/gpu/attn_sanitize_probe.py > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc"
  grep -E "ERROR SUMMARY|failure|FAIL" "$OUT/sanitize_$tool.log" | tail -n 4
  [[ $rc == 0 ]] || status=1
done

echo "== 3. bench_attention (old, new, one, ablations)"
timeout 360 python3 benchmarks/bench_attention.py --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
echo "attn_check: exit $status (logs in $OUT)"
exit $status
