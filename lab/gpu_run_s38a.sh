#!/bin/bash
# Device call 3 of 3 (straight after copying .gl/a/p1 and .gl/c/p2 to /tmp): join and convert
# SmolLM2, the decode-vs-SDPA check (quick grid), then #31's protocol: every method's perplexity at
# 4K x 24 sequences, and chat retrieval at 4K x 100 prompts (the bar recipe first).
set -u
. lab/gpu_lib.sh
step "smollm2"
[ -f /tmp/p1 ] || { echo "parts gone"; exit 3; }
cat /tmp/p1 /tmp/p2 .gl/b/p3 > /tmp/smol.gguf && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && echo sha-ok
python -m pip install -q --no-deps --no-index .gl/b/gguf-0.19.0-py3-none-any.whl .gl/b/accelerate-1.16.0-py3-none-any.whl 2>&1 | tail -1
(timeout 120 python .gl/b/convert_gguf.py /tmp smol.gguf /tmp/smollm2 > $OUT/convert.log 2>&1; echo "convert rc=$?") &
CONV=$!
step "gpu_check quick"
[ -n "${SKIP_CHECK:-}" ] || timeout 100 python benchmarks/gpu_check.py --quick --name gpu_check_s38 2>&1 | grep -E "^\| (1|8|32) \|" ; sync_out
wait $CONV
R=.gl/rot
E="--model /tmp/smollm2 --rotations $R/rot-pub --context 4096 --overwrite"
step "smollm2 eval: ppl, every method, 4K x 24"
timeout 190 python -m oscarkv eval $E --recipe auto=$R/rot-auto --recipe b26=$R/rot-b26 --recipe b30=$R/rot-b30 \
  --methods bf16,oscar,hadamard-int2,turboquant-k3v3,kivi2,quarot-int2,naive-int2 \
  --tasks ppl --ppl-sequences 24 --out $OUT/eval_smollm2_ppl 2>&1 | tail -14
step "smollm2 eval: chat retrieval 4K x 100 (bf16, oscar, b30)"
timeout 150 python -m oscarkv eval $E --recipe b30=$R/rot-b30 --methods bf16,oscar \
  --tasks chat-retrieval --retrieval-prompts 100 --out $OUT/eval_smollm2_retr_a 2>&1 | tail -6
step "smollm2 eval: chat retrieval 4K x 100 (oscar = b26 here, auto)"
timeout 100 python -m oscarkv eval ${E/rot-pub/rot-b26} --recipe auto=$R/rot-auto --methods bf16,oscar \
  --tasks chat-retrieval --retrieval-prompts 100 --out $OUT/eval_smollm2_retr_b 2>&1 | tail -6
step done
