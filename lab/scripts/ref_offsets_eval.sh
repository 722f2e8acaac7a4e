#!/bin/bash
# The reference model on the CPU: per-KV-head calibration with offsets auto / none, then `oscarkv
# eval` ppl (bf16 and oscar) at 3K for each. usage: bash lab/scripts/ref_offsets_eval.sh MODEL_DIR OUT_DIR
set -eu
M=$1; O=$2; mkdir -p "$O"
for off in auto none; do
  python -m oscarkv calibrate --model "$M" --out "$O/rot-$off" --granularity kv_head --offsets "$off" \
    --device cpu --dtype fp32 --quiet --overwrite
  python -m oscarkv eval --model "$M" --rotations "$O/rot-$off" --methods bf16,oscar --tasks ppl \
    --context 3072 --ppl-sequences 8 --device cpu --dtype fp32 --out "$O/eval-$off" --overwrite
done
