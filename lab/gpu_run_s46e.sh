#!/bin/bash
# #42: the GPU tests s46d left failing (a test that perturbed quantize_pack, the RoPE tolerance),
# then the BF16 full-slot profile (8 x 16K, qwen3-8b) on this commit.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
step "GPU tests: engine, RoPE"
timeout 100 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py -m gpu 2>&1 | grep -E "^E |passed|failed" | head -5
timeout 40 python -m pytest -q -p no:cacheprovider tests/test_norm_kernels.py -m gpu -k "qk_norm_rope" 2>&1 | grep -E "^E .*Greatest|passed|failed" | head -6
step "after: qwen3-8b 8 x 16K bf16"
timeout 45 python lab/s46_profile.py qwen3-8b 16384 8 bf16 2>&1 | grep -A12 "^##"
step done
