#!/bin/bash
# Device call: the bf16 engine and model.generate (DynamicCache) at batch 16 / 8K, side by side.
set -u
. lab/gpu_lib.sh
step "b16 8K engine"
timeout 60 python benchmarks/bench_engine.py --shape qwen3-8b --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | grep -i "decode-only step\|TPOT"; sync_out
step "b16 8K generate"
timeout 70 python benchmarks/e2e_decode.py --shapes 16x8192 --caches bf16 --new 32 --repeats 2 --name e2e_decode_b16_8k 2>&1 | tail -3; sync_out
step done
