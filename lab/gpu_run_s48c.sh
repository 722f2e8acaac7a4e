#!/bin/bash
# Stop 48: the engine GPU lane after the test fixes (prompt log-probabilities on CUDA, invariant
# prefill in fp32 on Triton), with penalties and the invariant layer tests.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step "GPU tests"
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_penalties.py \
  tests/engine/test_sampler.py tests/engine/test_overlap.py tests/engine/test_plan_host.py -m gpu 2>&1 \
  | grep -E "^E  |^FAILED|passed|failed" | head -30
step done
