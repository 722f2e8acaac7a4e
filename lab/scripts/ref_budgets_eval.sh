#!/bin/bash
# The reference model on the CPU: the default recipe and bit budgets 3.0 and 2.6, calibrated per KV head,
# then one `oscarkv eval` ppl at 3K x 8. usage: bash lab/scripts/ref_budgets_eval.sh [OUT_DIR [MODEL_DIR]]
set -u
cd "$(dirname "$0")/../.."
M=${2:-../shared/models/oscar-ref-qwen3-30m}; O=${1:-/tmp/ref39}
for r in "def" "b30 --bits-per-element 3.0" "b26 --bits-per-element 2.6"; do
  set -- $r; name=$1; shift
  t0=$(date +%s)
  python -m oscarkv calibrate --model $M --out $O/rot-$name --granularity kv_head --device cpu --dtype fp32 --quiet --overwrite "$@" > $O/cal-$name.log 2>&1
  echo "cal $name rc=$? $(( $(date +%s) - t0 ))s"
done
t0=$(date +%s)
python -m oscarkv eval --model $M --rotations $O/rot-def --recipe b30=$O/rot-b30 --recipe b26=$O/rot-b26 --methods bf16,oscar --tasks ppl \
    --context 3072 --ppl-sequences 8 --device cpu --dtype fp32 --out $O/eval --overwrite > $O/eval.log 2>&1
echo "eval rc=$? $(( $(date +%s) - t0 ))s"
