#!/bin/bash
# The workloads of engine.md §7 on one GPU, int2 vs bf16 at one budget: prefix reuse (bench_prefix.py),
# jobs (bench_engine.py), and a served run (oscarkv serve on a random-weight shape, driven over HTTP by
# bench_serving.py, then the same jobs in-process). Runs from .snap (a `git archive` of the commit under
# test, carried). A CPU smoke runs the same steps with DEVICE=cpu SHAPE=demo.
#   bash lab/gpu_workloads.sh prefix|jobs|served|fp8 [extra args]
#   fp8: the fp8-window GPU tests, then steady decode at 4K and 1.5K with int2, int2-fp8w and bf16
#   served: bash lab/gpu_workloads.sh served KV_DTYPE BUDGET_GIB PROMPT GEN JOBS CONCURRENCY
# The device has no FastAPI stack and no network: for `served`, put the wheels in .snap/.wheels
# (pip download fastapi uvicorn pydantic prometheus-client httpx --only-binary :all:
#  --python-version 3.12 --platform manylinux2014_x86_64 -d .snap/.wheels; ~4 MB) and carry .snap.
set -u
[ -d .snap ] && cd .snap
. lab/gpu_lib.sh
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-qwen3-8b}
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
what=$1; shift
case "$what" in
  prefix)
    step "prefix reuse"
    timeout 580 python benchmarks/bench_prefix.py --shape "$SHAPE" --device "$DEVICE" "$@" 2>&1 | grep -v "Warn\|it/s" | tail -60 ;;
  jobs)
    step "jobs"
    timeout 580 python benchmarks/bench_engine.py --shape "$SHAPE" --device "$DEVICE" "$@" 2>&1 | grep -v "Warn\|it/s" | tail -45 ;;
  served)
    kv=$1 budget=$2 plen=$3 glen=$4 jobs=$5 conc=$6
    python -c "import fastapi, uvicorn" 2> /dev/null || python -m pip install -q --no-index --find-links .wheels \
      fastapi uvicorn pydantic prometheus-client httpx || { echo "no FastAPI and no .wheels"; exit 4; }
    wm=$(mktemp -d)
    python benchmarks/bench_engine.py --shape "$SHAPE" --write-model "$wm"
    rot=(); [ "$kv" = int2 ] && rot=(--rotations "$wm/$SHAPE-rot")
    step "serve $kv"
    python -m oscarkv serve --model "$wm/$SHAPE" "${rot[@]}" --kv-dtype "$kv" --device "$DEVICE" --load-format dummy \
      --kv-budget-gb "$budget" --max-running "$conc" --max-model-len $((plen + glen + 1)) --graph-capture lazy \
      --insecure-no-api-key --port 8017 > "$OUT/serve_$kv.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:8017/health > /dev/null && break; kill -0 $pid 2> /dev/null || { tail -5 "$OUT/serve_$kv.log"; exit 4; }; sleep 1; done
    step "bench_serving $kv"
    # a warm-up round (kernels compile, graphs are captured) that is not timed
    python benchmarks/bench_serving.py --url http://127.0.0.1:8017 --num-requests "$conc" --concurrency "$conc" \
      --input-len "$plen" --output-len 8 --prompt-type token-ids --vocab-size 2048 --ignore-eos --seed 1 \
      --no-progress --name "served_warm_$kv" > /dev/null 2>&1
    timeout 500 python benchmarks/bench_serving.py --url http://127.0.0.1:8017 --num-requests "$jobs" \
      --concurrency "$conc" --input-len "$plen" --output-len "$glen" --prompt-type token-ids --vocab-size 2048 \
      --ignore-eos --no-progress --name "served_${SHAPE}_${kv}" 2>&1 | tail -30
    kill -INT $pid; wait $pid
    rm -f benchmarks/results/served_warm_*
    step "in-process $kv"
    timeout 500 python benchmarks/bench_engine.py --shape "$SHAPE" --device "$DEVICE" --kv-dtypes "$kv" \
      --kv-budget-gb "$budget" --max-running "$conc" --prompt-len "$plen" --gen-len "$glen" --jobs "$jobs" \
      --graph-capture lazy --name "inproc_${SHAPE}_${kv}" 2>&1 | grep -v "Warn\|it/s" | tail -30 ;;
  fp8)
    step "fp8-window GPU tests"
    timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/engine/test_engine_gpu.py \
      -k "fp8 or window or rotate" 2>&1 | grep -E "^E  |^FAILED|passed|failed|error" | head -20
    for L in 4096 1536; do
      step "steady $L: int2, int2-fp8w, bf16"
      timeout 200 python benchmarks/bench_engine.py --shape "$SHAPE" --device "$DEVICE" --steady $L --steps 24 --warmup 4 \
        --graph-capture lazy --kv-dtypes int2,int2-fp8w,bf16 --name "bench_engine_${SHAPE}_steady_${L}_fp8w" "$@" 2>&1 \
        | grep -E "decode tok/s|requests held|roofline|step ms|/ bf16"
    done ;;
  *) echo "unknown $what"; exit 2 ;;
esac
sync_out
step done
