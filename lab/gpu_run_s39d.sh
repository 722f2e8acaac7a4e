#!/bin/bash
# #30: decode-heavy at a longer generation, 40 x (1K+4K), the budget where bf16 holds 8 (INT2 about
# 41): the 1K+8K does not fit one call (bf16 alone would take ~8 minutes).
set -u
. lab/gpu_lib.sh
step "decode-heavy 40 x 1K+4K, bf16 fits 8"
timeout 560 python benchmarks/bench_engine.py --shape qwen3-8b --workload decode --gen-len ${GEN:-4096} --jobs ${JOBS:-40} \
  --name bench_engine_qwen3-8b_decode_${GEN:-4096} 2>&1 | grep -E "^\||int2 / bf16|jobs/min"
sync_out
step done
