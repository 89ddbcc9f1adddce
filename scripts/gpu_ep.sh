#!/usr/bin/env bash
# Expert parallelism on a 2-GPU machine: the 2-rank GPU tests, a dispatch/combine bandwidth
# microbenchmark against the NVLink peer-copy rate measured in the same run, then the layer benchmark
# (megamoe vs the NCCL all_to_all recipe) for deepseek-v3 and mok-bench at T = 4096 and 2048 per rank.
# Usage: scripts/gpu_ep.sh [all|tests|comm|bench]   Logs go to $OUT (default /tmp/gpu_ep).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu_ep}"
mkdir -p "$OUT"
MODE="${1:-all}"
rc=0
if [[ "$MODE" == all || "$MODE" == tests ]]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/test_ep_gpu.py -q -ra --durations=5 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if [[ "$MODE" == all || "$MODE" == comm ]]; then
  timeout "${COMM_TIMEOUT:-120}" torchrun --standalone --nproc-per-node 2 scripts/comm_bench.py 2>&1 | tee "$OUT/comm.log"
  crc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] && rc=$crc
fi
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  timeout "${BENCH_TIMEOUT:-240}" torchrun --standalone --nproc-per-node 2 -m megamoe.bench \
    --cases deepseek-v3:4096 deepseek-v3:2048 mok-bench:4096 mok-bench:2048 --providers megamoe nccl \
    --iters "${ITERS:-6}" --round-iters 3 --warmup 2 --check-tokens 256 --quiet --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] && rc=$brc
  cat "$OUT/bench/results.txt" 2>/dev/null
fi
exit $rc
