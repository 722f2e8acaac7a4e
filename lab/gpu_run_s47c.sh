#!/bin/bash
# Device call 3 of 3 (after copying .gl/a/p1 and .gl/c/p2 to /tmp): SmolLM2, then #43's chat
# retrieval at 4K x 300 prompts: the default calibration (2% held-out perplexity target) vs BF16.
set -u
cd .snap || exit 3
ln -s ../.gl .gl
. lab/gpu_lib.sh
step "smollm2"
smollm2
step "retrieval 4K x ${N:-300}"
timeout 400 python -m oscarkv eval --model /tmp/smollm2 --context 4096 --overwrite --tasks chat-retrieval \
  --retrieval-prompts ${N:-300} --rotations .gl/rot/rot_default --methods bf16,oscar --out $OUT/eval_retr300_default 2>&1 \
  | grep -E "^\||error|Error|s retrieval|s chat"
step done
