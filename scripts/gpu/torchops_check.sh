#!/usr/bin/env bash
# Issue 15, the torch ops for the vLLM step and for the attention outputs (helper "torchops", session 5):
# their GPU tests, never run on a GPU before. On a GPU machine, from the repository root:
#   OUT=/some/dir bash scripts/gpu/torchops_check.sh
# Four pytest runs, most important first, each given what is left of one time budget (BUDGET seconds,
# default 105, under 120 s with the 10 s kill grace; a run cut short is interrupted with SIGINT, so pytest still prints its counts):
#   1. new:       tests/gpu/test_torch_vllm_ops_gpu.py (kvaddr::vllm_step_into), tests/gpu/test_vllm_error_records_gpu.py
#                 (VllmStepPlanner(error_records=...)), tests/gpu/test_torch_attention_gpu.py (step_into's attention
#                 outputs) without its random batches, and the VllmStepPlanner records tests of tests/gpu/test_vllm_step.py;
#                 torch.compile: one inductor fullgraph test per op (compiled, then captured in torch.cuda.graph) + aot_eager
#   2. attn_random: test_torch_attention_gpu.py's random batches (7 group sets x 7 batch sizes x 3 metadata impls)
#   3. ops:       tests/gpu/test_torch_ops_gpu.py (kvaddr::step / step_into without attention; ran on the H200 before
#                 the attention change to kvaddr/torch/ops.py)
#   4. inductor_more: the remaining inductor fullgraph tests (eager == compiled, one per op)
# Logs: $OUT/pytest_<run>.log (with the 8 slowest tests), $OUT/summary.txt. Expected on the H200, exit 0:
#   new: 119 passed, 149 deselected / attn_random: 147 passed / ops: 77 passed, 1 deselected / inductor_more: 3 passed
#   total ...s; ALL PASSED
# Exit 1: a failure, an error, a skip (none expected there) or a run cut short by the budget.
set -u
OUT=${OUT:-/tmp/kvaddr-torchops}
BUDGET=${BUDGET:-105}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
start=$SECONDS
status=0
: > "$OUT/summary.txt"
python3 -c "import sys, torch, cupy; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', \
'cupy', cupy.__version__)" 2>&1 | tee "$OUT/env.txt"

PYTEST_MAIN='import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))'

run() {  # run NAME PYTEST_ARGS...: one pytest run within what is left of the budget
  local name=$1 left rc line
  shift
  left=$((BUDGET - (SECONDS - start)))
  if ((left < 15)); then
    echo "$name: NOT RUN (budget of ${BUDGET}s spent)" | tee -a "$OUT/summary.txt"
    status=1
    return
  fi
  local t0=$SECONDS
  # pytest.main with Python's SIGINT handler restored (a background job starts with SIGINT ignored),
  # so the budget's SIGINT ends the run as a KeyboardInterrupt and pytest still prints its counts
  timeout -s INT -k 10 "$left" python3 -c "$PYTEST_MAIN" -q -rs -p no:cacheprovider --durations=8 "$@" \
    > "$OUT/pytest_$name.log" 2>&1
  rc=$?
  line=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran" "$OUT/pytest_$name.log" | tail -n 1)
  case $rc in
    0) ;;
    2 | 124 | 130 | 137) line="$line  [CUT SHORT at the budget: rc $rc]"; status=1 ;;
    *) status=1 ;;
  esac
  if grep -qE "^SKIPPED" "$OUT/pytest_$name.log"; then
    line="$line  [skips: none expected on the H200]"
    status=1
  fi
  echo "$name: rc $rc, $((SECONDS - t0))s: $line" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_$name.log" | head -n 20 | tee -a "$OUT/summary.txt"
}

A=tests/gpu/test_torch_attention_gpu.py
V=tests/gpu/test_torch_vllm_ops_gpu.py
O=tests/gpu/test_torch_ops_gpu.py
S=tests/gpu/test_vllm_step.py

run new "$V" tests/gpu/test_vllm_error_records_gpu.py "$A" \
  "$S::test_worked_example" "$S::test_errors_are_sticky_until_read" \
  "$S::test_corrupted_inputs_match_the_reference_bits_and_keys" "$S::test_readme_snippet_on_torch_tensors" \
  --deselect "$A::test_random_batches_equal_the_reference_on_cuda" \
  --deselect "$V::test_compiled_fullgraph_equals_eager_on_cuda[inductor]" \
  --deselect "$A::test_compiled_fullgraph_equals_eager_with_attention[inductor]"
run attn_random "$A::test_random_batches_equal_the_reference_on_cuda"
run ops "$O" --deselect "$O::test_compiled_fullgraph_equals_eager[inductor]"
run inductor_more "$V::test_compiled_fullgraph_equals_eager_on_cuda[inductor]" \
  "$A::test_compiled_fullgraph_equals_eager_with_attention[inductor]" "$O::test_compiled_fullgraph_equals_eager[inductor]"

if [ "$status" = 0 ]; then verdict="ALL PASSED"; else verdict="NOT ALL PASSED: see above and $OUT/pytest_<run>.log"; fi
echo "total $((SECONDS - start))s; $verdict" | tee -a "$OUT/summary.txt"
exit $status
