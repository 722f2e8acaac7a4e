#!/bin/bash
# Stop 48, #44 on CUDA: the engine GPU lane with the new prompt log-probabilities and invariant
# prefill tests, penalties/sampler/overlap on CUDA, and a steady 16K regression check.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step "GPU tests: engine lane, penalties, sampler, overlap"
timeout 240 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_penalties.py \
  tests/engine/test_sampler.py tests/engine/test_overlap.py tests/engine/test_plan_host.py -m gpu 2>&1 \
  | grep -E "^E |^FAILED|passed|failed" | head -30
step "steady 16K (qwen3-8b shape)"
timeout 200 python benchmarks/bench_engine.py --shape qwen3-8b --steady 16384 --steps 32 --warmup 6 \
  --graph-capture lazy 2>&1 | grep -E "^\||int2 /|rror" | head -24
sync_out
step done
