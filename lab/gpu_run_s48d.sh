#!/bin/bash
# Stop 48: penalties with device-resident counts on CUDA (overlap, graphs), and the engine lane.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step "GPU tests"
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_penalties.py tests/engine/test_engine_gpu.py \
  tests/engine/test_sampler.py tests/engine/test_overlap.py -m gpu 2>&1 | grep -E "^E  |^FAILED|passed|failed" | head -30
step done
