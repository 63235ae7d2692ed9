#!/usr/bin/env bash
# The vLLM step's torch op (helper "vllmop", session 4): on a GPU machine, from the repository root.
#   OUT=/some/dir bash scripts/gpu/vllmop_check.sh
# Runs tests/gpu/test_torch_vllm_ops_gpu.py (kvaddr::vllm_step_into on CUDA against the NumPy
# reference, opcheck, torch.compile fullgraph with inductor and aot_eager, torch.cuda.graph replays
# with new contents, a non-default stream) and the CPU side (tests/unit/test_torch_vllm_ops.py).
# Expected: every test passes, none skipped (on a host with torch + CUDA + CuPy). About a minute.
set -u
OUT=${OUT:-/tmp/kvaddr-vllmop}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cupy', cupy.__version__)" \
  2>&1 | tee "$OUT/env.txt"
timeout 400 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_torch_vllm_ops_gpu.py tests/unit/test_torch_vllm_ops.py > "$OUT/pytest_vllmop.log" 2>&1
status=$?
tail -n 20 "$OUT/pytest_vllmop.log"
exit $status
