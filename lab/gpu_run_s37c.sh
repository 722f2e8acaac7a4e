#!/bin/bash
# Device call: the engine's GPU tests (graphs with the fused norms, padding canary over per-layer
# pools, Triton-vs-torch logits against the noise floor, 4-bit key layers on Triton), then the bf16
# engine at batch 16 / 8K (decode-only step time) for the model.generate comparison.
set -u
. lab/gpu_lib.sh
step "gpu tests"
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/test_key_bits.py::test_mixed_key_bits_on_the_triton_kernels -s 2>&1 | grep -v "^$" | tail -14
step "b16 8K engine"
timeout 70 python benchmarks/bench_engine.py --shape qwen3-8b --kv-dtypes bf16 --prompt-len 8192 --gen-len 128 --jobs 16 --max-running 16 --kv-budget-gb 24 --name bench_engine_qwen3-8b_b16_8k 2>&1 | tail -20; sync_out
step done
