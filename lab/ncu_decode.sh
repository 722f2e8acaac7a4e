#!/bin/bash
# Nsight Compute on stage 1 of the INT2 decode (#52 item 1): per shape BATCHxLEN, one profiled launch
# after two warm-ups, the sections that say where the time goes (speed of light, memory, warp states,
# scheduler, occupancy, launch), printed as text into $OUT/ncu_<shape>.txt.
#   bash lab/ncu_decode.sh 8x4096 1x65536 [-- --tuning programs_few=512]
# Needs the Firecracker runtime (KINDS.md: ncu reads no counters on gVisor); leaves the clocks alone.
set -u
[ -d .snap ] && cd .snap
. lab/gpu_lib.sh
shapes=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do shapes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
for s in "${shapes[@]}"; do
  b=${s%x*} L=${s#*x}
  step "ncu stage1 $s"
  timeout 300 ncu --clock-control none --kernel-name regex:stage1 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --print-units base python lab/scripts/profile_decode.py --batch "$b" --len "$L" "$@" > "$OUT/ncu_$s.txt" 2>&1
  grep -E "plan:|Duration|DRAM Throughput|Memory Throughput|Issued Warp|Eligible Warps|Active Warps|No Eligible|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/ncu_$s.txt" | head -30
done
step done
