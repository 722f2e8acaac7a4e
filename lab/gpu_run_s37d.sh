#!/bin/bash
# Device call: side by side in one run, the bf16 engine at batch 16 / 8K and model.generate
# (DynamicCache) at the same shape; then the decode-heavy 1K+1K int2 vs bf16 run with the fused norms.
set -u
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step "b16 8K engine"
timeout 60 $B --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | grep -i "decode-only step\|TPOT"; sync_out
step "b16 8K generate"
timeout 70 python benchmarks/e2e_decode.py --shapes 16x8192 --caches bf16 --new 32 --repeats 2 --name e2e_decode_b16_8k 2>&1 | tail -3; sync_out
step "decode-heavy 1K+1K"
timeout 150 $B --workload decode --gen-len 1024 --jobs 24 --name bench_engine_qwen3-8b_decode 2>&1 | tail -24; sync_out
step done
