#!/bin/bash
# The engine's speed runs on one GPU (docs/engine.md, README results table), in one go:
#   1. decode-heavy jobs at a fixed KV budget, int2 vs bf16 (Qwen3-8B shape, random weights);
#   2. prefill-heavy jobs, the same;
#   3. one request decoding at 32K context, int2 vs bf16 engine;
#   4. the bf16 engine at batch 16 / 8K against model.generate with DynamicCache (e2e_decode.py);
#   5. bench_serving against `oscarkv serve` (int2) at a few concurrencies.
# usage: bash benchmarks/engine_gpu.sh [GEN_LEN] [JOBS]   (decode-heavy generated tokens and jobs)
set -u
GEN=${1:-2048}
JOBS=${2:-31}  # INT2 max_running at 1K+2K: no job is left to run alone after the first wave
B="python benchmarks/bench_engine.py --shape qwen3-8b"
step() { echo "== $1 ($(date +%T))"; }

step "decode-heavy: $JOBS jobs of 1024 + $GEN tokens, bf16 fits 8"
$B --workload decode-1k --gen-len "$GEN" --jobs "$JOBS" --name bench_engine_qwen3-8b_decode 2>&1 | tail -22
step "prefill-heavy: 16 jobs of 32768 + 1024 tokens, bf16 fits 8"
$B --workload long-32k --jobs 16 --name bench_engine_qwen3-8b_long-32k 2>&1 | tail -22
step "one request at 32K context"
$B --prompt-len 32768 --gen-len 256 --jobs 1 --max-running 1 --kv-budget-gb 8 \
  --name bench_engine_qwen3-8b_b1_32k 2>&1 | tail -22
step "bf16 engine at batch 16 / 8K vs model.generate (DynamicCache)"
$B --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 \
  --name bench_engine_qwen3-8b_b16_8k 2>&1 | tail -20
python benchmarks/e2e_decode.py --shapes 16x8192 --caches bf16,oscar --new 32 --repeats 3 \
  --name e2e_decode_b16_8k 2>&1 | tail -8
step "bench_serving against oscarkv serve (int2)"
M=$(mktemp -d)
$B --write-model "$M"
python -m oscarkv serve --model "$M/qwen3-8b" --rotations "$M/qwen3-8b-rot" --load-format dummy \
  --kv-budget-gb 24 --max-model-len 4096 --port 8011 >"$M/serve.log" 2>&1 &
PID=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
head -3 "$M/serve.log"
for c in 1 8 32; do
  python benchmarks/bench_serving.py --url http://127.0.0.1:8011 --num-requests $((c * 4)) --concurrency $c \
    --input-len 1024 --output-len 256 --prompt-type token-ids --ignore-eos --no-progress \
    --name "bench_serving_qwen3-8b_c$c" 2>&1 | tail -6
done
kill $PID
wait $PID 2>/dev/null
echo "== done ($(date +%T))"
