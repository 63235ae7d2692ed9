#!/usr/bin/env bash
# Session 6, helper "host": the memo guard built only for repeated objects, and VllmStepPlanner.bind().
# On a GPU machine, from the repository root (PYTHONPATH=.). Under 4 minutes (hard limits 100 + 90 + 60 s).
#   1. the GPU tests this change wrote or touched: tests/gpu/test_vllm_bind_gpu.py (bind() against the
#      reference and compute(): random batches, vLLM's slices of persistent buffers, torch tensors on a
#      torch stream, torch.cuda.graph with contents changed between replays, a bound table resized in
#      place, every bad batch on CuPy and torch, the attention metadata), the memo tests whose counts
#      changed (tests/gpu/test_vllm_memo.py, test_compute_memo_gpu.py, test_vector_signature_gpu.py,
#      the memo test of test_torch_vllm_ops_gpu.py);
#   2. benchmarks/bench_host.py: look at "compute() (CuPy), new dec/q objects" against
#      "compute() (CuPy), no memo" (they should now cost the same: no guard is built for new objects)
#      and against "compute() (CuPy)" (the memo hit);
#   3. benchmarks/bench_vllm.py --host-only: per row, the memo rows as before, then "new batch objects
#      every call": v2 compute() vs core compute() (both checked every call), and v2 bind(): launch
#      against the core compute()'s memo hit (issue 13's 1.2x) and against core with new objects.
# Logs under $OUT (default ./out/host6).   PYTHONPATH=. bash scripts/gpu/host6_check.sh
set -u
OUT=${OUT:-./out/host6}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)" | tee -a "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/env.txt"
git log -1 --format='commit %H %s' 2>/dev/null | tee -a "$OUT/env.txt"

timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_bind_gpu.py \
  tests/gpu/test_vllm_memo.py tests/gpu/test_compute_memo_gpu.py tests/gpu/test_vector_signature_gpu.py \
  "tests/gpu/test_torch_vllm_ops_gpu.py::test_same_tensors_many_steps_take_the_planners_memo" \
  > "$OUT/pytest_host6.log" 2>&1
rc=$?
tail -n 12 "$OUT/pytest_host6.log"
echo "GPU tests: exit $rc (0: all passed)"
[[ $rc == 0 ]] || status=1

timeout 90 python3 benchmarks/bench_host.py --json "$OUT/bench_host.json" 2>&1 | tee "$OUT/bench_host.log"
rc=${PIPESTATUS[0]}
echo "bench_host.py: exit $rc (0: issue 15's bounds met; 1: one missed; other: a failure)"
[[ $rc == 0 || $rc == 1 ]] || status=1

timeout 60 python3 benchmarks/bench_vllm.py --host-only --json "$OUT/bench_vllm_host.json" 2>&1 \
  | tee "$OUT/bench_vllm_host.log"
rc=${PIPESTATUS[0]}
echo "bench_vllm.py --host-only: exit $rc (0: the host target met in every row; 1: missed in some row; other: a failure)"
[[ $rc == 0 || $rc == 1 ]] || status=1
exit $status
