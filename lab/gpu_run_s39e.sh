#!/bin/bash
# #30: bench_serving against `oscarkv serve` (int2, random-weight Qwen3-8B, 24 GiB KV budget) at
# concurrency 1, 8 and 32, max_running 64 with every graph captured at start-up (1024 prompt + 256 generated tokens, 4 requests per slot).
set -u
. lab/gpu_lib.sh
M=$(mktemp -d)
python benchmarks/bench_engine.py --shape qwen3-8b --write-model "$M"
step "serve"
python -m oscarkv serve --model "$M/qwen3-8b" --rotations "$M/qwen3-8b-rot" --load-format dummy \
  --kv-budget-gb 24 --max-model-len 4096 --max-running 64 --graph-capture startup --port 8011 >"$M/serve.log" 2>&1 &
PID=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
grep -m2 -E "KV pools|Uvicorn running" "$M/serve.log"
for c in 1 8 32; do
  step "c=$c"
  timeout 120 python benchmarks/bench_serving.py --url http://127.0.0.1:8011 --num-requests $((c * 4)) --concurrency $c \
    --input-len 1024 --output-len 256 --prompt-type token-ids --ignore-eos --no-progress \
    --name "bench_serving_qwen3-8b_c$c" 2>&1 | tail -6
done
kill $PID; wait $PID 2>/dev/null
sync_out
step done
