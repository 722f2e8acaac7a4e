#!/bin/bash
# The GPU quality runs of docs/eval.md: calibrate the reference model several ways, then one full
# `oscarkv eval` per recipe (all INT2 baselines, 24 ppl sequences, 400 passkeys at the context).
# usage: bash benchmarks/eval_gpu.sh MODEL_DIR OUT_DIR [recipe ...]   (recipes: see below)
set -u
MODEL=$1; OUT=$2; shift 2
command -v oscarkv >/dev/null || oscarkv() { python3 -m oscarkv "$@"; }
RECIPES=${*:-kvhead nll-kvhead-layer nll}
METHODS=bf16,oscar,naive-int2,quarot-int2,clip-only,hadamard-int2,kivi2
mkdir -p "$OUT"
for r in $RECIPES; do
  case $r in
    kvhead) flags="--granularity kv_head" ;;
    nll) flags="--granularity layer --clip-search --clip-objective nll" ;;
    nll-kvhead) flags="--granularity kv_head --clip-search --clip-objective nll" ;;
    nll-kvhead-layer) flags="--granularity kv_head --clip-search --clip-objective nll --clip-per-layer" ;;
    hadamard-nll) flags="--method hadamard --clip-search --clip-objective nll" ;;
    *) echo "unknown recipe $r"; exit 2 ;;
  esac
  t0=$(date +%s)
  oscarkv calibrate --model "$MODEL" --out "$OUT/rot-$r" --quiet $flags || exit 1
  t1=$(date +%s)
  if [ "$r" = hadamard-nll ]; then m=bf16,oscar; tasks=ppl,attn-error; else m=$METHODS; tasks=ppl,passkey,niah,attn-error; fi
  oscarkv eval --model "$MODEL" --rotations "$OUT/rot-$r" --out "$OUT/eval-$r" --methods $m --tasks $tasks \
    --ppl-sequences 24 --passkey-at-context 400 --needle-trials 2 --batch-size 16 || exit 1
  echo "== $r: calibrate $((t1 - t0)) s, eval $(( $(date +%s) - t1 )) s"
  cat "$OUT/eval-$r/results.md"
done
