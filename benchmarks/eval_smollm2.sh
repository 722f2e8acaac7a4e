#!/bin/bash
# SmolLM2-135M-Instruct, every recipe on one set of sequences (docs/eval.md, README results):
#   calibrate (CPU, fp32, per-KV-head rotations): OSCAR as published (no offsets), offsets auto,
#   and offsets auto with a bit budget of 2.6 and 3.0 bits per element at 128K (mixed key bits);
#   then one `oscarkv eval` for perplexity (with TurboQuant K3V3) and one for chat retrieval,
#   the recipes as methods oscar:NAME.
# usage: bash benchmarks/eval_smollm2.sh SMOLLM2_DIR OUT_DIR [CONTEXT SEQUENCES PROMPTS DEVICE]
#   defaults 2048 8 24 cpu (the docs' CPU run); on a GPU: 4096 24 100 cuda
# get the model: scripts/get_smollm2.sh DIR
set -eu
M=$1; O=$2; CTX=${3:-2048}; SEQ=${4:-8}; PROMPTS=${5:-24}; DEV=${6:-cpu}
DT=$([ "$DEV" = cpu ] && echo fp32 || echo bf16)
mkdir -p "$O"
cal() { [ -f "$O/rot-$1/rotations.safetensors" ] || python -m oscarkv calibrate --model "$M" --out "$O/rot-$1" \
  --granularity kv_head --device cpu --dtype fp32 --quiet "${@:2}"; }
cal pub --offsets none
cal auto
cal b26 --bits-per-element 2.6
cal b30 --bits-per-element 3.0
R="--rotations $O/rot-pub --recipe auto=$O/rot-auto --recipe b26=$O/rot-b26 --recipe b30=$O/rot-b30"
E="--context $CTX --device $DEV --dtype $DT --overwrite"
python -m oscarkv eval --model "$M" $R $E --methods bf16,oscar,turboquant-k3v3 --tasks ppl --ppl-sequences "$SEQ" \
  --out "$O/eval-ppl"
python -m oscarkv eval --model "$M" --rotations "$O/rot-pub" --recipe b26="$O/rot-b26" --recipe b30="$O/rot-b30" $E \
  --methods bf16,oscar --tasks chat-retrieval --retrieval-prompts "$PROMPTS" \
  --out "$O/eval-retrieval"
