#!/usr/bin/env bash
# Nsight Compute on the grouped GEMMs of one fused-layer forward+backward (qwen3-30b-a3b T=16384 by default):
# one launch of each of gate/up, down, dgrad + SwiGLU, dgrad dx, dW2 and dW13 of the third step (after two
# warm-up steps), with speed of light, tensor-pipe use, memory (L2 / DRAM) throughput and occupancy.
# Installs nothing; writes $OUT/ncu_layer_<preset>.log. Usage: OUT=dir (or NCU_OUT=dir) scripts/ncu_layer.sh [preset:T]
# PROFILE_EP1=1 profiles the EP path on a one-rank group instead (scripts/profile_layer.py); NCU_KERNELS and PER_STEP
# then name its GEMMs (deepseek-v3: 9 m-grouped launches and 2 weight gradients per step).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${NCU_OUT:-${OUT:-/tmp/megamoe_ncu}}"; mkdir -p "$OUT"
CASE="${1:-qwen3-30b-a3b:16384}"
PER_STEP="${PER_STEP:-6}"  # grouped-GEMM launches per step (qwen3: 4 m-grouped + 2 k-grouped; no shared expert)
log="$OUT/ncu_layer_${CASE%%:*}.log"
KERNELS="${NCU_KERNELS:-grouped}"  # kernel-name regex; e.g. "_m_grouped_gemm|_k_grouped" with PROFILE_EP1=1 PER_STEP=11
timeout 240 ncu --clock-control none --kernel-name "regex:$KERNELS" --launch-skip $((2 * PER_STEP)) \
  --launch-count "$PER_STEP" --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy \
  env STEPS_ONLY=3 python3 scripts/profile_layer.py "$OUT" "$CASE" > "$log" 2>&1
echo "ncu rc=$?"
grep -E "^  _|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Cache Throughput|Executed Ipc A|Achieved Occupancy|Registers Per|Tensor|SM Busy" "$log" | head -80
