#!/bin/bash
# Device call: the Triton-vs-torch logit gap against its noise floor, then the bf16 engine at
# batch 16 / 8K against model.generate (DynamicCache); results copied to $OUT after each step.
set -u
. lab/gpu_lib.sh
step "logit noise floor"
timeout 150 python lab/scripts/logit_noise_floor.py 2>&1 | grep -v Warning | tail -8
step "b16 8K engine"
timeout 80 python benchmarks/bench_engine.py --shape qwen3-8b --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | tail -12; sync_out
step "b16 8K generate"
timeout 120 python benchmarks/e2e_decode.py --shapes 16x8192 --caches bf16 --new 32 --repeats 2 --name e2e_decode_b16_8k 2>&1 | tail -6; sync_out
step done
