#!/bin/bash
# #42 first round (and #41's one-request runs): per-kernel GPU time of engine decode steps before
# (.snap_old) and after (.snap: splits scaled to live lengths, R_V^T folded into o_proj, q/k norm + RoPE in one launch), the GPU
# tests of the kernels and the engine, one request at 32K/64K (qwen3-4b) in bench_engine.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
P="python lab/s46_profile.py"
PO="python ../.snap_old/lab/s46_profile.py"
for kv in bf16 int2; do
  step "before: qwen3-4b, one request at 64K, $kv"
  (cd ../.snap_old && PYTHONPATH=$PWD/src timeout 100 python lab/s46_profile.py qwen3-4b 65536 1 $kv 2>&1 | grep -A12 "^##")
  step "after"
  timeout 100 $P qwen3-4b 65536 1 $kv 2>&1 | grep -A12 "^##"
done
step "before: qwen3-8b 8 x 16K bf16"
(cd ../.snap_old && PYTHONPATH=$PWD/src timeout 100 python lab/s46_profile.py qwen3-8b 16384 8 bf16 2>&1 | grep -A12 "^##")
step "after"
timeout 100 $P qwen3-8b 16384 8 bf16 2>&1 | grep -A12 "^##"
step "GPU tests: kernels, engine"
timeout 300 python -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py tests/test_norm_kernels.py tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py -m gpu 2>&1 | tail -3
for L in 32768 65536; do
  step "one request at $L, qwen3-4b"
  timeout 100 python benchmarks/bench_engine.py --shape qwen3-4b --steady $L --steps 32 --warmup 4 --max-running 1 \
    --kv-budget-gb 12 --graph-capture lazy --name bench_engine_qwen3-4b_b1_$L 2>&1 | grep -E "^\||int2 /" | head -14
  sync_out
done
step "after: qwen3-8b 49 x 16K int2"
timeout 120 $P qwen3-8b 16384 49 int2 --budget-gb 14 2>&1 | grep -A12 "^##"
step done
