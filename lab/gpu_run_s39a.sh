#!/bin/bash
# #30: where one decode step's time goes (lab/s39_step_trace.py): step-time distribution, host phases
# and the GPU kernel table, int2 at 24 running vs bf16 at 8, 1K prompts, the 2.25 GiB budget.
set -u
. lab/gpu_lib.sh
step "step trace"
timeout 300 python lab/s39_step_trace.py $OUT/trace 24 8 1024 2.25 20 2>&1 | grep -v Warn | grep -E "^==|^   " 
step done
