#!/bin/bash
# Device call 3 of 3 (after copying .gl/a/p1 and .gl/c/p2 to /tmp): SmolLM2, then chat retrieval at
# 4K x 300 prompts for the retrieval diagnostics (lab/s39_make_rots.py): the budget-3.0 recipe, the
# s38 retrieval ranking, 4-bit keys everywhere, 4-bit values on the budget-3.0 recipe.
set -u
. lab/gpu_lib.sh
step "smollm2"
[ -d /tmp/smollm2 ] || {
[ -f /tmp/p1 ] || { echo "parts gone"; exit 3; }
cat /tmp/p1 /tmp/p2 .gl/b/p3 > /tmp/smol.gguf && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && echo sha-ok
python -m pip install -q --no-deps --no-index .gl/b/gguf-0.19.0-py3-none-any.whl .gl/b/accelerate-1.16.0-py3-none-any.whl 2>&1 | grep -v WARN | tail -1
timeout 120 python .gl/b/convert_gguf.py /tmp smol.gguf /tmp/smollm2 > $OUT/convert.log 2>&1; echo "convert rc=$?"
}
R=.gl/rot
E="--model /tmp/smollm2 --context 4096 --overwrite --tasks chat-retrieval --retrieval-prompts ${N:-300}"
step "retrieval 4K x ${N:-300}"
timeout 420 python -m oscarkv eval $E --rotations $R/rot-b30 --recipe ra30=$R/rot-ra30 --recipe k4all=$R/rot-k4all \
  --recipe b30v4=$R/rot-b30v4 --methods bf16,oscar --out $OUT/eval_retr300 2>&1 | grep -E "^\||error|Error|s retrieval|s chat"
step done
