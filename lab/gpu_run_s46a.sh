#!/bin/bash
# #41's remaining device runs (engine GPU tests on the store/ layout, one request at 32K/64K on the
# Qwen3-4B shape: host on the critical path at batch 1) and #42's first profile: per-kernel
# exclusive GPU time of a decode step inside the engine, PDL on and off, power-of-two contexts
# (their list-length bucket is twice the live length) against 60000 (bucket 64K).
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py"
P="timeout 100 python lab/s46_profile.py"
step "engine GPU tests"
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py -m gpu 2>&1 | tail -3
for L in 32768 65536; do
  step "one request at $L, qwen3-4b"
  timeout 100 $B --shape qwen3-4b --steady $L --steps 32 --warmup 4 --max-running 1 --kv-budget-gb 12 \
    --graph-capture lazy --name bench_engine_qwen3-4b_b1_$L 2>&1 | grep -E "^\||int2 /" | head -14
  sync_out
done
step "profiles"
for kv in bf16 int2; do
  $P qwen3-4b 65536 1 $kv 2>&1 | grep -A16 "^##"
  $P qwen3-4b 60000 1 $kv 2>&1 | grep -A16 "^##"
done
$P qwen3-4b 65536 1 bf16 --no-pdl 2>&1 | grep -A16 "^##"
$P qwen3-8b 16384 8 bf16 2>&1 | grep -A16 "^##"
$P qwen3-8b 16384 49 int2 --budget-gb 14 2>&1 | grep -A16 "^##"
step done
