#!/bin/bash
# #30 after the host-built decode plan: the engine's GPU tests (graph == eager, padding canary,
# pinned staging), then decode-heavy jobs (24 x 1K+1K, 2.25 GiB) with the new planner (profiled)
# and the previous one
# (PROFILE=1: then a cProfile of the int2 side) (.gl/old/src, the commit before it), one after the other in one call.
set -u
. lab/gpu_lib.sh
step "engine gpu tests"
timeout 140 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_plan_host.py 2>&1 | tail -4
B="python benchmarks/bench_engine.py --shape qwen3-8b --workload decode --gen-len 1024 --jobs 24 --kv-budget-gb 2.25"
step "decode-heavy, host planner"
timeout 150 $B --name bench_engine_qwen3-8b_decode_hostplan 2>&1 | grep -E "jobs/min|TPOT|decode-only step|int2 / bf16"
sync_out
step "decode-heavy, previous planner"
ln -sfn $PWD/src/oscarkv/assets .gl/old/src/oscarkv/assets
PYTHONPATH=$PWD/.gl/old/src timeout 100 $B --kv-dtypes int2 --name bench_engine_qwen3-8b_decode_oldplan 2>&1 | grep -E "jobs/min|TPOT|decode-only step|int2 / bf16"
sync_out
[ -n "${PROFILE:-}" ] && { step "int2 profiled (24 x 1K+256)"
timeout 100 python benchmarks/bench_engine.py --shape qwen3-8b --workload decode --gen-len 256 --jobs 24 --kv-budget-gb 2.25 \
  --kv-dtypes int2 --profile 30 --name bench_engine_profile 2>&1 | grep -A34 "Ordered by" | head -36; sync_out; }
step done
