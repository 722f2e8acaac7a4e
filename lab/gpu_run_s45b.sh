#!/bin/bash
# #41, second call: from a snapshot of one commit (.snap): the engine's graph and canary GPU tests
# on the store/ layout, one request at 64K on the Qwen3-4B shape, 50 jobs of 16K+512 (Qwen3-8B).
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py"
step "engine GPU tests: graph == eager (overlap), padded-replay canary"
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py -k "graph_replay or padded" 2>&1 | tail -2
step "one request at 65536, qwen3-4b"
timeout 90 $B --shape qwen3-4b --steady 65536 --steps 32 --warmup 4 --max-running 1 --kv-budget-gb 12 \
  --graph-capture lazy --name bench_engine_qwen3-4b_b1_65536 2>&1 | grep -E "^\||int2 /" | head -14
sync_out
step "50 jobs of 16K+512, qwen3-8b, bf16 fits 8"
timeout 230 $B --shape qwen3-8b --prompt-len 16384 --gen-len 512 --jobs 50 --name bench_engine_qwen3-8b_16k_512 \
  2>&1 | grep -E "^\||int2 /" | head -24
sync_out
step done
