#!/bin/bash
# MoE on one GPU: the MoE block against its rooflines, and the engine on a MoE shape (steady decode,
# one long request), int2 vs bf16 in one process each. Runs from .snap (a `git archive` of the
# commit under test, carried), so helpers' uncommitted edits do not travel.
#   bash lab/gpu_moe.sh block|steady|glm|tests [extra args]
set -u
cd .snap || exit 3
. lab/gpu_lib.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
what=$1; shift
case "$what" in
  block)
    step "MoE block"
    timeout 300 python benchmarks/moe_block.py "$@" 2>&1 | grep -v Warn | tail -40 ;;
  steady)
    step "steady decode"
    timeout 560 python benchmarks/bench_engine.py "$@" 2>&1 | grep -v "Warn\|it/s" | tail -40 ;;
  glm)  # GLM-4.5-Air FP8 steady decode: all 46 layers where the GPU holds them (H200), else 20
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    shape=glm-4.5-air-fp8-20l; [ "$mem" -gt 120000 ] && shape=glm-4.5-air-fp8
    step "steady decode $shape"
    timeout 560 python benchmarks/bench_engine.py --shape $shape "$@" 2>&1 | grep -v "Warn\|it/s" | tail -40 ;;
  tests)
    step "GPU tests"
    timeout 300 python -m pytest -q -p no:cacheprovider -m gpu "$@" 2>&1 | grep -E "^E  |^FAILED|passed|failed" | head -30 ;;
  *) echo "unknown $what"; exit 2 ;;
esac
sync_out
step done
