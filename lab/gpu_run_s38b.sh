#!/bin/bash
# Device call 3 of 3 (after copying .gl/a/p1 and .gl/c/p2 to /tmp): SmolLM2, then the retrieval-
# sensitive ranking experiment (lab/s38_retrieval_rank.py) and `oscarkv eval` of its recipes at
# 4K (chat retrieval x 100, the eval's prompts; perplexity x 24).
set -u
. lab/gpu_lib.sh
export PYTHONPATH=$PWD/.gl/clean/src  # the committed tree (helpers edit the working tree)
step "smollm2"
smollm2
R=.gl/rot; X=$OUT/rank
step "rank"
timeout 240 python .gl/clean/lab/s38_retrieval_rank.py /tmp/smollm2 $R/rot-auto $X 48 2>&1 | grep -v Warn | tail -8
E="--model /tmp/smollm2 --context 4096 --overwrite"
step "retrieval 4K x 100"
timeout 150 python -m oscarkv eval $E --rotations $X/rot-ra30 --recipe rg30=$X/rot-rg30 --recipe ra26=$X/rot-ra26 \
  --recipe rg26=$X/rot-rg26 --recipe k4all=$X/rot-k4all --methods bf16,oscar --tasks chat-retrieval \
  --retrieval-prompts 100 --out $OUT/eval_retr 2>&1 | grep "^|"
step "retrieval 4K x 100: 4-bit values"
timeout 100 python -m oscarkv eval $E --rotations $X/rot-v4 --recipe k4v4=$X/rot-k4v4 --methods bf16,oscar --tasks chat-retrieval \
  --retrieval-prompts 100 --out $OUT/eval_retr_v4 2>&1 | grep "^|"
step "ppl 4K x 24"
timeout 100 python -m oscarkv eval $E --rotations $X/rot-ra30 --recipe rg30=$X/rot-rg30 --recipe ra26=$X/rot-ra26 \
  --recipe rg26=$X/rot-rg26 --methods bf16,oscar --tasks ppl --ppl-sequences 24 --out $OUT/eval_ppl 2>&1 | grep "^|" | head -8
rm -f $X/*/rotations.safetensors.tmp
step done
