#!/bin/bash
# One device call: the engine's GPU tests, then the speed runs in priority order; results copied
# to $OUT after each step so a timeout keeps what finished.
set -u
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step "gpu tests"
timeout 130 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py -s 2>&1 | grep -v "^$" | tail -15
step "bf16 paged decode vs sdpa"
timeout 70 python benchmarks/bf16_paged_decode.py 2>&1 | tail -12; sync_out
step "b1 32K"
timeout 70 $B --prompt-len 32768 --gen-len 256 --jobs 1 --max-running 1 --kv-budget-gb 8 --name bench_engine_qwen3-8b_b1_32k 2>&1 | tail -14; sync_out
step "decode-heavy"
timeout 150 $B --workload decode --gen-len 1024 --jobs 24 --name bench_engine_qwen3-8b_decode 2>&1 | tail -16; sync_out
step "step profile"
timeout 60 python lab/scripts/engine_step_profile.py --running 24 2>&1 | tee $OUT/profile.txt | head -40
step "b16 8K"
timeout 50 $B --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | tail -12; sync_out
timeout 60 python benchmarks/e2e_decode.py --shapes 16x8192 --caches bf16 --new 32 --repeats 2 --name e2e_decode_b16_8k 2>&1 | tail -6; sync_out
step done
