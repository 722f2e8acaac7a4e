#!/bin/bash
# #41, the runs still to make (run from a snapshot of one commit in .snap, carried, as s45a):
# the engine GPU tests on the store/ layout, one request at 32K / 64K on the Qwen3-4B shape
# (host work per step and the device's idle gap at batch 1), 50 jobs of 16K+512 (Qwen3-8B).
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py"
step "engine GPU tests"
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py -m gpu 2>&1 | tail -3
for L in 32768 65536; do
  step "one request at $L, qwen3-4b"
  timeout 120 $B --shape qwen3-4b --steady $L --steps 32 --warmup 4 --max-running 1 --kv-budget-gb 12 \
    --graph-capture lazy --name bench_engine_qwen3-4b_b1_$L 2>&1 | grep -E "^\||int2 /" | head -14
  sync_out
done
step "50 jobs of 16K+512, qwen3-8b, bf16 fits 8"
timeout 240 $B --shape qwen3-8b --prompt-len 16384 --gen-len 512 --jobs 50 --name bench_engine_qwen3-8b_16k_512 \
  2>&1 | grep -E "^\||int2 /" | head -24
sync_out
step done
