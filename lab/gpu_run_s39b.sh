#!/bin/bash
# Device call 3 of 3 (after copying .gl/a/p1 and .gl/c/p2 to /tmp): SmolLM2, then chat retrieval at
# 4K x 300 prompts for the retrieval diagnostics (lab/s39_make_rots.py): the budget-3.0 recipe, the
# s38 retrieval ranking, 4-bit keys everywhere, 4-bit values on the budget-3.0 recipe.
set -u
. lab/gpu_lib.sh
step "smollm2"
smollm2
R=.gl/rot
E="--model /tmp/smollm2 --context 4096 --overwrite --tasks chat-retrieval --retrieval-prompts ${N:-300}"
step "retrieval 4K x ${N:-300}"
timeout 420 python -m oscarkv eval $E --rotations $R/rot-b30 --recipe ra30=$R/rot-ra30 --recipe k4all=$R/rot-k4all \
  --recipe b30v4=$R/rot-b30v4 --methods bf16,oscar --out $OUT/eval_retr300 2>&1 | grep -E "^\||error|Error|s retrieval|s chat"
step done
