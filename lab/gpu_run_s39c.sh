#!/bin/bash
# #30 with start-up graph capture: the engine GPU tests, then decode-heavy 24 x (1K+1K) at 2.25 GiB
# (the README row) and prefill-heavy 16 x (32K+1K) (bf16 fits 8), both sides in one process each.
set -u
. lab/gpu_lib.sh
step "engine gpu tests"
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py 2>&1 | tail -4
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step "decode-heavy 24 x 1K+1K, 2.25 GiB"
timeout 200 $B --workload decode --gen-len 1024 --jobs 24 --kv-budget-gb 2.25 --name bench_engine_qwen3-8b_decode 2>&1 | grep -E "^\||int2 / bf16"
sync_out
step "prefill-heavy 16 x 32K+1K"
timeout 260 $B --workload prefill --jobs 16 --name bench_engine_qwen3-8b_prefill 2>&1 | grep -E "^\||int2 / bf16"
sync_out
step done
