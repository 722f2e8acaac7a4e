#!/bin/bash
# #42: quantize_pack_into's strided scatter on CUDA (the test fixed to compare metadata as bytes);
# steady full slots at 4K / 32K (and 16K again: one card for the README row); INT2 stage 1 at
# batch 1: programs in flight for few (sequence, head) pairs, inside the engine.
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
B="python benchmarks/bench_engine.py --shape qwen3-8b"
P="python lab/s46_profile.py"
step "GPU test: quantize_pack_into"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k quantize_pack_into 2>&1 | grep -E "^E |passed|failed" | head -5
step "INT2 stage 1 at batch 1, qwen3-4b 64K: programs_few"
for pf in 1024 2048 4096; do
  timeout 60 $P qwen3-4b 65536 1 int2 --tuning programs_few=$pf 2>&1 | grep -A4 "^##" | grep -E "^##|stage1|merge"
done
for L in 4096 32768 16384; do
  step "steady $L"
  timeout 150 $B --steady $L --steps 48 --warmup 6 --graph-capture lazy 2>&1 | grep -E "^\| (decode tok|step ms|% of|requests held)|int2 /|rror" | head -8
  sync_out
done
step done
