#!/usr/bin/env bash
# Nsight Compute profiles of the dW13 weight gradient (deepseek-v3, ~128 and ~256 rows per expert): the
# persistent Gluon kernel against the Triton kernels the table used before it, with stall reasons.
# "ws" (sixteenth session): the warp-specialized Gluon kernel at ~256 rows per expert on contiguous rows, P streamed
# (4 slots) and on chip (6 slots, 5 chunks), and torch._grouped_mm (its name filter also catches a helper kernel).
# Installs nothing; writes $OUT/ncu_*.log. Usage: OUT=dir scripts/ncu_wgrad.sh [ws]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/megamoe_ncu}"; mkdir -p "$OUT"
run() {  # run NAME T CONFIG [KERNEL_REGEX]
  timeout 170 ncu --clock-control none --kernel-name "regex:${4:-k_grouped}" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 scripts/profile_wgrad.py deepseek-v3 "$2" "$3" > "$OUT/ncu_$1.log" 2>&1
  echo "$1 rc=$?"; grep -E "TFLOP/s|Duration|Throughput|Registers Per|Achieved Occupancy|Stall|Issued Warp|No Eligible" \
    "$OUT/ncu_$1.log" | head -24
}
if [[ ${1:-} == ws ]]; then
  run ws_ws_streamed 8192 128x128x64/8/4/ws k_grouped_wgrad_ws
  run ws_ws_resident 8192 128x128x64/8/6/r5/ws k_grouped_wgrad_ws
  run ws_torch 8192 torch 'cutlass|Gemm|gemm'
  exit 0
fi
run gluon_T4096 4096 128x128x64/8/5/r5/gluon
run triton_resident_T4096 4096 table
run gluon_T8192 8192 128x128x64/8/5/r5/gluon
run triton_per_tile_T8192 8192 128x128x64/8/2
