#!/usr/bin/env bash
# Nsight Compute profiles of the dW13 weight gradient (deepseek-v3, ~128 and ~256 rows per expert): the
# persistent Gluon kernel against the Triton kernels the table used before it, with stall reasons.
# Installs nothing; writes $OUT/ncu_*.log. Usage: OUT=dir scripts/ncu_wgrad.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/megamoe_ncu}"; mkdir -p "$OUT"
run() {  # run NAME T CONFIG
  timeout 150 ncu --clock-control none --kernel-name regex:k_grouped --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 scripts/profile_wgrad.py deepseek-v3 "$2" "$3" > "$OUT/ncu_$1.log" 2>&1
  echo "$1 rc=$?"; grep -E "TFLOP/s|Duration|Throughput|Registers Per|Achieved Occupancy|Stall|Issued Warp|No Eligible" "$OUT/ncu_$1.log" | head -24
}
run gluon_T4096 4096 128x128x64/8/5/r5/gluon
run triton_resident_T4096 4096 table
run gluon_T8192 8192 128x128x64/8/5/r5/gluon
run triton_per_tile_T8192 8192 128x128x64/8/2
