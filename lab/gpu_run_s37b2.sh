#!/bin/bash
# Device call 3 of 3 (straight after copying .gl/a/p1 and .gl/c/p2 to /tmp): join and convert SmolLM2, run the
# engine's GPU tests, the bf16 engine at batch 16 / 8K, then the SmolLM2 evaluation of every
# recipe on one set of sequences.
set -u
. lab/gpu_lib.sh
step "smollm2"
cat /tmp/p1 /tmp/p2 .gl/b/p3 > /tmp/smol.gguf && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && echo sha-ok
pip install -q --no-deps --no-index .gl/b/gguf-0.19.0-py3-none-any.whl .gl/b/accelerate-1.16.0-py3-none-any.whl 2>&1 | tail -1
(timeout 120 python .gl/b/convert_gguf.py /tmp smol.gguf /tmp/smollm2 > $OUT/convert.log 2>&1; echo "convert rc=$?") &
CONV=$!
step "gpu tests"
timeout 170 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/test_key_bits.py::test_mixed_key_bits_on_the_triton_kernels -s 2>&1 | grep -v "^$" | tail -12
wait $CONV
step "b16 8K engine"
timeout 60 python benchmarks/bench_engine.py --shape qwen3-8b --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | grep -i "tpot\|decode-only\|wall" ; sync_out
step "smollm2 eval: ppl, every method, 4K x 24"
R=.gl/rot
timeout 200 python -m oscarkv eval --model /tmp/smollm2 --rotations $R/rot-pub --recipe auto=$R/rot-auto \
  --recipe b26=$R/rot-b26 --recipe b30=$R/rot-b30 --methods bf16,oscar,hadamard-int2,turboquant-k3v3,kivi2,quarot-int2,naive-int2 \
  --tasks ppl --context 4096 --ppl-sequences 24 --out $OUT/eval_smollm2_ppl 2>&1 | tail -16
step "smollm2 eval: chat retrieval 4K"
timeout 170 python -m oscarkv eval --model /tmp/smollm2 --rotations $R/rot-pub --recipe auto=$R/rot-auto \
  --recipe b26=$R/rot-b26 --recipe b30=$R/rot-b30 --methods bf16,oscar --tasks chat-retrieval --context 4096 --retrieval-prompts 100 --out $OUT/eval_smollm2_retrieval 2>&1 | tail -10
step done
