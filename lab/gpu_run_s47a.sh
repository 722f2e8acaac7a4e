#!/bin/bash
# #41's last run (50 jobs of 16K + 512, Qwen3-8B shape, BF16 holds 8) and #42's checks on this
# commit: the strided quantize_pack_into on a GPU, the engine GPU lane, steady 16K full slots.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step "GPU tests: quantize_pack_into, engine"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k quantize_pack_into 2>&1 | grep -E "^E |passed|failed" | head -5
timeout 150 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py -m gpu 2>&1 | grep -E "^E |passed|failed" | head -5
step "long-16k: 50 jobs of 16K+512"
timeout 330 $B --workload long-16k --jobs 50 --name bench_engine_qwen3-8b_long-16k 2>&1 | grep -E "^\||int2 /|rror" | head -30
sync_out
step "steady 16K"
timeout 150 $B --steady 16384 --steps 48 --warmup 6 --graph-capture lazy 2>&1 | grep -E "^\||int2 /|rror" | head -24
sync_out
step done
