#!/bin/bash
# Stop 48: the engine GPU lane again after the fixes, and the invariant prefill's determinism on CUDA.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step "GPU tests: engine lane, penalties"
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_penalties.py \
  tests/engine/test_prefill_invariant.py -m "gpu or not gpu" -k "not tp" 2>&1 | grep -E "^E  |^FAILED|passed|failed" | head -30
step "invariant determinism on CUDA"
timeout 240 python lab/s48_invariant_gpu.py 2>&1 | grep -vE "Warning|warn" | tail -12
step done
