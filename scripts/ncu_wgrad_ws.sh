#!/usr/bin/env bash
# Nsight Compute on the dW13 weight gradient at ~256 rows per expert (deepseek-v3 T=8192, rows contiguous as in
# the EP receive buffers): the warp-specialized Gluon kernel (P streamed, 4 slots; P on chip, 6 slots) against
# torch._grouped_mm, with stall reasons and memory traffic. Installs nothing; writes $OUT/ncu_ws_*.log.
# Usage: OUT=dir scripts/ncu_wgrad_ws.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/megamoe_ncu}"; mkdir -p "$OUT"
run() {  # run NAME KERNEL_REGEX CONFIG
  timeout 170 ncu --clock-control none --kernel-name "regex:$2" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 scripts/profile_wgrad.py deepseek-v3 8192 "$3" > "$OUT/ncu_ws_$1.log" 2>&1
  echo "$1 rc=$?"; grep -E "TFLOP/s|Duration|Throughput|Achieved Occupancy|Stall|Issued Warp|No Eligible|Busy|Pipe" \
    "$OUT/ncu_ws_$1.log" | head -40
}
run ws_streamed k_grouped_wgrad_ws 128x128x64/8/4/ws
run ws_resident k_grouped_wgrad_ws 128x128x64/8/6/r5/ws
run torch 'cutlass|Gemm|gemm' torch
