#!/bin/bash
# SmolLM2-135M-Instruct, every recipe on one set of sequences (docs/eval.md, README results):
#   calibrate (CPU, fp32, per-KV-head rotations): OSCAR as published (no offsets), offsets auto,
#   and offsets auto with a bit budget of 2.6 and 3.0 bits per element at 128K (mixed key bits);
#   then one `oscarkv eval` for perplexity (4K context, 24 sequences, every baseline) and one for
#   chat retrieval (100 prompts at 4K), each with the recipes as oscar:NAME methods.
# usage: bash benchmarks/eval_smollm2.sh SMOLLM2_DIR OUT_DIR   (get the model: ../shared/tools/get_smollm2.sh)
set -eu
M=$1; O=$2; mkdir -p "$O"
cal() { python -m oscarkv calibrate --model "$M" --out "$O/rot-$1" --granularity kv_head --device cpu --dtype fp32 \
  --quiet --overwrite "${@:2}"; }
cal pub --offsets none
cal auto
cal b26 --bits-per-element 2.6
cal b30 --bits-per-element 3.0
R="--rotations $O/rot-pub --recipe auto=$O/rot-auto --recipe b26=$O/rot-b26 --recipe b30=$O/rot-b30"
python -m oscarkv eval --model "$M" $R --methods bf16,oscar,hadamard-int2,turboquant-k3v3,kivi2,quarot-int2,naive-int2 \
  --tasks ppl --context 4096 --ppl-sequences 24 --out "$O/eval-ppl" --overwrite
python -m oscarkv eval --model "$M" $R --methods bf16,oscar --tasks chat-retrieval --context 4096 \
  --retrieval-prompts 100 --out "$O/eval-retrieval" --overwrite
