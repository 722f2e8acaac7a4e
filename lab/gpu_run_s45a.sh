#!/bin/bash
# #41: run from a snapshot of one commit (.snap, carried: the working tree may be mid-change):
# the engine's GPU tests (graph == eager with overlap, canary, staging), then steady-state decode
# at 4K / 16K / 32K and 24 jobs of 1K+1K, int2 vs bf16 at one budget, with the roofline columns.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step "engine GPU tests"
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py -m gpu 2>&1 | tail -4
step "host plan and device list expansion, 49 x 1K/16K/32K"
timeout 60 python lab/s45_plan_cost.py cuda 2>&1 | tail -3
for L in 16384 4096 32768; do
  step "steady $L"
  timeout 200 $B --steady $L --steps 48 --warmup 6 --graph-capture lazy 2>&1 | grep -v "Loading\|Warn" | tail -24
  sync_out
done
step "24 jobs of 1K+1K at 2.25 GiB"
timeout 150 $B --workload decode --gen-len 1024 --jobs 24 --kv-budget-gb 2.25 2>&1 | grep -v "Loading\|Warn" | tail -30
sync_out
step done
