#!/bin/bash
# SmolLM2-135M-Instruct on the CPU: calibrate with offsets auto / none, then `oscarkv eval` ppl for
# bf16, both artifacts' oscar and turboquant-k3v3 at 2K context (real OscarCache path).
# usage: bash benchmarks/eval_smollm2_cpu.sh MODEL_DIR OUT_DIR
set -eu
M=$1; O=$2; mkdir -p "$O"
for off in auto none; do
  python -m oscarkv calibrate --model "$M" --out "$O/rot-$off" --granularity kv_head --offsets "$off" \
    --device cpu --dtype fp32 --quiet --overwrite
done
python -m oscarkv eval --model "$M" --rotations "$O/rot-auto" --methods bf16,oscar,turboquant-k3v3 --tasks ppl \
  --context 2048 --ppl-sequences 8 --device cpu --dtype fp32 --out "$O/eval-auto" --overwrite
python -m oscarkv eval --model "$M" --rotations "$O/rot-none" --methods oscar --tasks ppl \
  --context 2048 --ppl-sequences 8 --device cpu --dtype fp32 --out "$O/eval-none" --overwrite
