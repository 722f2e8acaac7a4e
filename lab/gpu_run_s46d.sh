#!/bin/bash
# #42 second round, retried (s46c's new side failed at import): GPU tests of the changed kernels in
# the engine, per-kernel profiles of one request at 64K (qwen3-4b), bench_engine at one request.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
P="python lab/s46_profile.py"
step "GPU tests: engine, RoPE"
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py -m gpu 2>&1 | grep -E "^E |passed|failed" | head -5
timeout 30 python -m pytest -q -x -p no:cacheprovider tests/test_norm_kernels.py -m gpu -k "qk_norm_rope and 24" 2>&1 | tail -1
for kv in int2 bf16; do
  step "after: qwen3-4b one request at 64K, $kv"
  timeout 40 $P qwen3-4b 65536 1 $kv 2>&1 | grep -A12 "^##"
done
step "bench: one request at 64K"
timeout 45 python benchmarks/bench_engine.py --shape qwen3-4b --steady 65536 --steps 32 --warmup 4 --max-running 1 \
  --kv-budget-gb 12 --graph-capture lazy --name bench_engine_qwen3-4b_b1_65536 2>&1 | grep -E "^\| (step|roofline|% of|host)"
sync_out
step "bench: one request at 128K"
timeout 60 python benchmarks/bench_engine.py --shape qwen3-4b --steady 131072 --steps 16 --warmup 4 --max-running 1 \
  --kv-budget-gb 24 --graph-capture lazy --name bench_engine_qwen3-4b_b1_131072 2>&1 | grep -E "^\| (step|roofline|% of|host)"
sync_out
step done
