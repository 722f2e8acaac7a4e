#!/bin/bash
# A short device call: the engine's GPU tests, the 16-bit paged decode against SDPA, one request
# at 32K, int2 vs bf16, then the step profile; results copied to $OUT after each step.
set -u
. lab/gpu_lib.sh
step "gpu tests"
timeout 110 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py -s 2>&1 | grep -v "^$" | tail -12
step "bf16 paged decode vs sdpa"
timeout 45 python benchmarks/bf16_paged_decode.py --quick 2>&1 | tail -9; sync_out
step "b1 32K"
timeout 70 python benchmarks/bench_engine.py --shape qwen3-8b --prompt-len 32768 --gen-len 128 --jobs 1 --max-running 1 --kv-budget-gb 8 --name bench_engine_qwen3-8b_b1_32k 2>&1 | tail -12; sync_out
step "step profile"
timeout 60 python lab/scripts/engine_step_profile.py --running 24 --steps 15 > $OUT/profile.txt 2>&1; head -3 $OUT/profile.txt
step done
