#!/usr/bin/env bash
# The GPU runner: GPU tests, benchmarks, training demo, bit digests and profiles on an H200 machine (1, 2 or
# more GPUs). Installs nothing. Writes one log per stage under $OUT/logs (default OUT=/tmp/megamoe_gpu),
# a summary in $OUT/summary.txt, and bundles the logs into $OUT/logs.tar.gz at the end.
#
# Usage: scripts/gpu.sh [STAGE ...]        (no stage: tests bench1 bench2 train trainck)
#   tests       every GPU test (pytest -m "gpu or multigpu"); EP sizes from MEGAMOE_TEST_EP_SIZES (default 1,2)
#   eptests     only the EP GPU tests (tests/test_ep_gpu.py, tests/test_dp_ep_gpu.py)
#   epshared    the EP GPU tests with the ranks sharing the visible GPUs (W = $EPSHARED_SIZES, default 2,4,8):
#               the protocol and kernels at W > 1 on one GPU, not NVLink and not speed; MEGAMOE_TEST_EP_CASES
#               (e.g. fp8,fp8_zero_tokens) runs only those cases of the suite
#   fp8tests    the FP8 GPU tests (tests/test_fp8_*.py, the FP8 training bound in tests/test_train.py)
#   benchfp8    the FP8 benchmark tables: bf16 and FP8 layers, torch-fp8, the EP path in FP8 at W = 1; then bf16
#               beside FP8 with the weights quantized at every call (megamoe-fp8-uncached), both under torch.compile
#   fp8gemm     scripts/fp8_gluon_bench.py: the six FP8 GEMMs, Gluon beside Triton and megamoe's bf16 kernels
#               (profile the FP8 layer with PROFILE_CASES="qwen3-30b-a3b:16384 --fp8")
#   bench1      the single-GPU benchmark table (benchmarks/results/one-gpu)
#   bench2      the EP benchmark table on $EP GPUs (default 2; benchmarks/results/ep2)
#   benchep1    the EP path on one GPU against the direct path and torch (benchmarks/results/ep-path-one-gpu)
#   benchroute  zipf and real routing (the trace written by the train stage; benchmarks/results/routing)
#   train       the training demo ($TRAIN_STEPS steps, default 200); trainck: its --check at W = 1 and 2
#   snippet     the README's usage snippet (tests/test_readme.py on the GPU)
#   digest      scripts/bits_digest.py: SHA-256 of every output and gradient on the benchmark cases
#   profile     scripts/profile_layer.py: kernels per step, idle gaps, host and CUDA-graph time ($PROFILE_CASES)
#   ncu         Nsight Compute on one layer step's grouped GEMMs ($NCU_CASE, default qwen3-30b-a3b:16384, add
#               --fp8 for the FP8 layer; $NCU_KERNELS kernel-name regex, $PER_STEP launches of it per step,
#               default 6; the FP8 weight gradients: NCU_KERNELS=fp8_k_grouped_ws PER_STEP=2)
#   sweep       scripts/gemm_sweep.py: per-GEMM tile candidates, bitwise checked ($SWEEP_ARGS)
#   comm        scripts/comm_bench.py: dispatch / combine GB/s against the peer-copy rate (2 GPUs; $COMM_ARGS;
#               benchmarks/results/comm-ep2)
#   l2          scripts/l2_bandwidth.py: the L2 -> SM read rate the GEMMs' operand traffic is compared with
#   ab          an interleaved A/B of the layer: the benchmark once per arm of $AB_ARMS (arms separated by ";",
#               each a list of extra benchmark arguments; an empty arm is the defaults), $AB_REPS rounds
#               (default 2), on $AB_CASES (default deepseek-v3:8192) with $AB_PROVIDERS (default megamoe);
#               AB_EP=N runs the EP benchmark on N GPUs instead; then one table (python -m megamoe.bench.ab_summary)
# $BENCH_ARGS is appended to every benchmark command (e.g. --providers, --routing, or an A/B option).
# Each stage has its own time limit in seconds (LIMIT_<STAGE>); a stage that fails does not stop the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
COMMIT="${COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}"  # recorded by the benchmark (--commit)
OUT="${OUT:-/tmp/megamoe_gpu}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(tests bench1 bench2 train trainck)
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
ITERS="${ITERS:-10}"
EP="${EP:-2}"
BENCH=(python3 -m megamoe.bench --quiet --iters "$ITERS" --commit "$COMMIT")
DIST=(python3 -m torch.distributed.run --standalone)
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
summary="$OUT/summary.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "commit $COMMIT"
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$summary" 2>&1

stage() {  # stage NAME LIMIT CMD...: run CMD under a time limit, log to $LOGS/NAME.log, summarize
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$summary"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$summary"
  tail -n "${TAIL:-25}" "$LOGS/$name.log" | tee -a "$summary"
}

needs() {  # needs N STAGE: true when N GPUs are visible, else a note in the summary
  [[ $NGPU -ge $1 ]] && return 0
  echo "=== $2 skipped: needs $1 GPUs, $NGPU visible" | tee -a "$summary"; return 1
}

ncu_layer() {  # Nsight Compute on the grouped GEMMs of the third step of scripts/profile_layer.py
  local case="${NCU_CASE:-qwen3-30b-a3b:16384}" per_step="${PER_STEP:-6}"
  # $case is split into words: "qwen3-30b-a3b:16384 --fp8" profiles the FP8 layer
  # shellcheck disable=SC2086
  ncu --clock-control none --kernel-name "regex:${NCU_KERNELS:-grouped}" --launch-skip $((2 * per_step)) \
    --launch-count "$per_step" --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    python3 scripts/profile_layer.py "$LOGS" $case --steps-only 3
}
export -f ncu_layer; export LOGS

for s in "${STAGES[@]}"; do
  case $s in
    tests) stage tests "${LIMIT_TESTS:-600}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=10 tests ;;
    eptests) stage eptests "${LIMIT_EPTESTS:-300}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=5 \
               tests/test_ep_gpu.py tests/test_dp_ep_gpu.py ;;
    epshared) MEGAMOE_TEST_EP_SHARED_GPU=1 MEGAMOE_TEST_EP_SIZES="${EPSHARED_SIZES:-2,4,8}" stage epshared \
               "${LIMIT_EPSHARED:-480}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=5 \
               tests/test_ep_gpu.py tests/test_dp_ep_gpu.py ;;
    fp8tests) stage fp8tests "${LIMIT_FP8TESTS:-420}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=5 \
                tests/test_fp8_gemm.py tests/test_fp8_gemm_gluon_gpu.py tests/test_fp8_dgrad_gluon_gpu.py \
                tests/test_fp8_quant.py tests/test_fp8_kmajor.py \
                tests/test_fp8_layer.py \
                tests/test_train.py::test_gpu_fp8_tracks_bf16_over_200_steps ;;
    benchfp8) stage benchfp8 "${LIMIT_BENCHFP8:-300}" "${BENCH[@]}" \
                --providers megamoe megamoe-fp8 torch-fp8 megamoe-ep-fp8 \
                --cases qwen3-30b-a3b:16384 deepseek-v3:8192 --out "$LOGS/benchfp8" "${EXTRA[@]}"
              # a run of its own: beside megamoe-fp8's cached blocks deepseek-v3 would not fit an 80 GB GPU
              stage benchfp8-uncached "${LIMIT_BENCHFP8:-420}" "${BENCH[@]}" --providers megamoe megamoe-fp8-uncached \
                megamoe-compiled megamoe-fp8-compiled \
                --cases qwen3-30b-a3b:16384 deepseek-v3:8192 --out "$LOGS/benchfp8-uncached" "${EXTRA[@]}" ;;
    fp8gemm) stage fp8gemm "${LIMIT_FP8GEMM:-240}" python3 scripts/fp8_gluon_bench.py \
               ${FP8GEMM_CASES:-qwen3-30b-a3b:16384 deepseek-v3:8192} ;;
    bench1) stage bench1 "${LIMIT_BENCH1:-200}" "${BENCH[@]}" \
              --cases qwen3-30b-a3b:16384 deepseek-v3:4096 mok-bench:2048 --out "$LOGS/bench1" "${EXTRA[@]}" ;;
    bench2) needs "$EP" bench2 && stage bench2 "${LIMIT_BENCH2:-240}" "${DIST[@]}" --nproc-per-node "$EP" \
              -m megamoe.bench --quiet --iters "$ITERS" --commit "$COMMIT" --providers megamoe nccl \
              --cases deepseek-v3:4096 deepseek-v3:2048 mok-bench:4096 mok-bench:2048 --out "$LOGS/bench2" \
              "${EXTRA[@]}" ;;
    benchep1) stage benchep1 "${LIMIT_BENCHEP1:-300}" "${BENCH[@]}" --providers megamoe megamoe-ep torch \
              --cases deepseek-v3:8192 mok-bench:4096 qwen3-30b-a3b:16384 qwen3-30b-a3b:4096 \
              --out "$LOGS/benchep1" "${EXTRA[@]}" ;;
    benchroute) stage benchroute "${LIMIT_BENCHROUTE:-150}" "${BENCH[@]}" --cases qwen3-30b-a3b:16384 \
              --routing zipf:1.2 "trace:$LOGS/train/routing_trace.pt" --out "$LOGS/benchroute" "${EXTRA[@]}" ;;
    train) stage train "${LIMIT_TRAIN:-150}" python3 -m megamoe.train --no-progress --steps "${TRAIN_STEPS:-200}" \
             --out "$LOGS/train" ;;
    trainck) stage trainck1 "${LIMIT_TRAINCK:-120}" python3 -m megamoe.train --check --no-progress \
               --steps "${CHECK_STEPS:-30}" --out ""
             needs 2 trainck2 && stage trainck2 "${LIMIT_TRAINCK:-120}" "${DIST[@]}" --nproc-per-node 2 \
               -m megamoe.train --check --no-progress --steps "${CHECK_STEPS:-30}" --out "" ;;
    snippet) stage snippet "${LIMIT_SNIPPET:-90}" python3 -m pytest -q -ra -m gpu tests/test_readme.py ;;
    digest) stage digest "${LIMIT_DIGEST:-300}" python3 scripts/bits_digest.py --out "$LOGS/digest.txt" ;;
    profile) stage profile "${LIMIT_PROFILE:-150}" python3 scripts/profile_layer.py "$LOGS" \
               ${PROFILE_CASES:-qwen3-30b-a3b:16384 deepseek-v3:4096} ;;
    ncu) stage ncu "${LIMIT_NCU:-260}" bash -c ncu_layer ;;
    sweep) stage sweep "${LIMIT_SWEEP:-240}" python3 scripts/gemm_sweep.py "$LOGS" \
             ${SWEEP_ARGS:-deepseek-v3:4096 qwen3-30b-a3b:16384} ;;
    comm) needs 2 comm && stage comm "${LIMIT_COMM:-150}" "${DIST[@]}" --nproc-per-node 2 scripts/comm_bench.py \
            ${COMM_ARGS:-} ;;
    ab) IFS=';' read -r -a arms <<< "${AB_ARMS:-}"; [[ ${#arms[@]} -eq 0 ]] && arms=("")
        runner=("${BENCH[@]}")
        if [[ ${AB_EP:-1} -gt 1 ]]; then
          needs "$AB_EP" ab || continue
          runner=("${DIST[@]}" --nproc-per-node "$AB_EP" -m megamoe.bench --quiet --iters "$ITERS" --commit "$COMMIT")
        fi
        for r in $(seq 1 "${AB_REPS:-2}"); do
          for i in "${!arms[@]}"; do
            read -r -a arm <<< "${arms[$i]}"
            stage "ab_r${r}_arm$i" "${LIMIT_AB:-150}" "${runner[@]}" --providers ${AB_PROVIDERS:-megamoe} \
              --cases ${AB_CASES:-deepseek-v3:8192} --out "$LOGS/ab_r$r/arm$i" "${arm[@]}"
            echo "    (arm$i: ${arms[$i]:-the defaults})" | tee -a "$summary"
          done
        done
        python3 -m megamoe.bench.ab_summary --by-folder --reference arm0 "$LOGS"/ab_r* 2>&1 | tee -a "$summary" ;;
    l2) stage l2 "${LIMIT_L2:-90}" python3 scripts/l2_bandwidth.py "$LOGS" ;;
    *) echo "unknown stage $s" | tee -a "$summary" ;;
  esac
done
find "$LOGS" -name "*.pt" -delete
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
cat "$summary"
