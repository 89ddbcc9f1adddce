#!/usr/bin/env bash
# The one GPU script: installs nothing; runs the GPU tests, the benchmarks and the training demo on a
# 1- or 2-GPU H200 machine and writes logs under $OUT (bundled into $OUT/logs.tar.gz at the end).
# Usage: scripts/gpu_all.sh [STAGE ...]
#   stages: tests bench1 bench2 train trainck (the default set), and gluon (the Gluon kernels' GPU tests and the
#   layer's bit-invariance test), trainref (reference-backend tokens/s),
#   benchroute (zipf + the routing trace written by the train stage), snippet (README snippet verbatim),
#   ab (scripts/ab_backward.py: the EP path keeping round 0's x rows and pre-activations vs pulling / recomputing
#     them; EP=2 on 2 GPUs, else W = 1 on a one-rank group at the same rows per expert; $AB_CASES, and the
#     script's own AB_PULL / AB_SAVES / AB_ROUNDS / AB_TILES; several variants need LIMIT_AB above 150),
#   sweep (scripts/gemm_sweep.py $SWEEP_ARGS: per-GEMM tile candidates, bitwise checked),
#   comm (scripts/comm_bench.py $COMM_ARGS: dispatch / combine GB/s vs the peer-copy rate, 2 GPUs),
#   abgluon (the layer with the Gluon weight-gradient kernel off, MEGAMOE_GLUON=0, then on; $ABGLUON_CASES),
#   eptests (only tests/test_ep_gpu.py, the EP GPU tests at the sizes MEGAMOE_TEST_EP_SIZES allows, and
#     tests/test_dp_ep_gpu.py, DP x EP in 4 ranks: skipped below 4 GPUs),
#   epshared (tests/test_ep_gpu.py and test_dp_ep_gpu.py with the ranks sharing the visible GPUs, MEGAMOE_TEST_EP_SHARED_GPU=1, at
#     the sizes $EPSHARED_SIZES, default 2,4,8, ~140 s: W > 1 on a one-GPU machine; the protocol and kernels,
#     not NVLink or speed),
#   abtiles (layer A/B of tile replacements: the table, then each MEGAMOE_TILES value of the space-separated
#     $ABTILES, interleaved, $ABTILES_REPS rounds, on $ABTILES_CASES; the benchmark checks each against the
#     reference first; e.g. ABTILES="dgrad_swiglu:128,256,64,8,3,tma_b=1 dgrad_swiglu:128,128,64,8,4,tma_b=1";
#     an entry ENV=V[+ENV2=V2]@tiles also sets those variables, e.g. MEGAMOE_PERMUTED_DY=1@dgrad_swiglu:...;
#     ABTILES_EP=2 runs the EP=2 benchmark instead, e.g. ABTILES_EP=2 ABTILES="MEGAMOE_TORCH_WGRAD=1@";
#     ABTILES_PROVIDERS (default megamoe), e.g. "megamoe megamoe-ep": the EP path on a one-rank group too
#     (each provider adds its check and timing to every run: raise LIMIT_ABTILES to match),
#   profile (scripts/profile_layer.py: the layer's kernels, idle gaps, host and CUDA-graph time; $PROFILE_CASES),
#   ncu (scripts/ncu_layer.sh: Nsight Compute on the layer's grouped GEMMs, $NCU_CASE),
#   l2 (scripts/l2_bandwidth.py: L2 -> SM read bandwidth next to the GEMMs' operand-tile traffic),
#   vstorch (scripts/grouped_mm_vs_torch.py: the plain grouped GEMMs against torch._grouped_mm; $VSTORCH_CASES),
#   rounds (scripts/ab_rounds.py: the EP rounds' cost on one GPU, unused and filled, bitwise checked; $ROUNDS_CASES),
#   abwgrad (scripts/ab_wgrad.py: the weight-gradient kernels on contiguous rows, bitwise checked; $ABWGRAD_ARGS)
# Each stage has its own time limit (seconds, env LIMIT_<STAGE>); a stage that fails does not stop the rest.
# Pass MEGAMOE_COMMIT=<local git rev-parse --short HEAD>: the device tool copies the working tree, and the
# checkout's own HEAD there can be stale (seventh session: results labelled "a498e28-dirty").
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MEGAMOE_COMMIT="${MEGAMOE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}"
OUT="${OUT:-/tmp/megamoe_gpu}"
mkdir -p "$OUT/logs"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(tests bench1 bench2 train trainck)
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
ITERS="${ITERS:-10}"
EP="${EP:-2}"   # EP size of the bench2 stage; the tests stage takes MEGAMOE_TEST_EP_SIZES (default "1,2")
# 8-GPU run (issue 7): EP=8 MEGAMOE_TEST_EP_SIZES=2,4,8 \
#   BENCH2_CASES="deepseek-v3:4096 deepseek-v3:2048 kimi-k2:4096 kimi-k2:2048 mok-bench:4096 mok-bench:2048" \
#   scripts/gpu_all.sh tests bench2
summary="$OUT/summary.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "MEGAMOE_COMMIT=$MEGAMOE_COMMIT";
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$summary" 2>&1

stage() {  # stage NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$summary"
  timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$summary"
  tail -n "${TAIL:-25}" "$OUT/logs/$name.log" | tee -a "$summary"
}

for s in "${STAGES[@]}"; do
  case $s in
    tests) stage tests "${LIMIT_TESTS:-480}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=10 \
              tests/test_fused_gpu.py tests/test_wgrad_gluon_gpu.py tests/test_m_grouped_gluon_gpu.py tests/test_torch_wgrad_gpu.py \
              tests/test_ep_gpu.py tests/test_dp_ep_gpu.py ;;
    eptests) stage eptests "${LIMIT_EPTESTS:-240}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=5 \
              tests/test_ep_gpu.py tests/test_dp_ep_gpu.py ;;
    epshared) MEGAMOE_TEST_EP_SHARED_GPU=1 MEGAMOE_TEST_EP_SIZES="${EPSHARED_SIZES:-2,4,8}" stage epshared \
              "${LIMIT_EPSHARED:-480}" python3 -m pytest -q -ra -m "gpu or multigpu" --durations=5 tests/test_ep_gpu.py \
              tests/test_dp_ep_gpu.py ;;
    gluon) stage gluon "${LIMIT_GLUON:-200}" python3 -m pytest -q -ra -m gpu tests/test_m_grouped_gluon_gpu.py tests/test_wgrad_gluon_gpu.py \
              tests/test_fused_gpu.py::test_bits_do_not_depend_on_tile_shape ;;
    bench1) stage bench1 "${LIMIT_BENCH1:-200}" python3 -m megamoe.bench --quiet --iters "$ITERS" \
              --cases qwen3-30b-a3b:16384 deepseek-v3:4096 mok-bench:2048 --out "$OUT/logs/bench1" ;;
    bench2) [[ $NGPU -ge $EP ]] && stage bench2 "${LIMIT_BENCH2:-240}" python3 -m torch.distributed.run --standalone \
              --nproc-per-node "$EP" -m megamoe.bench --quiet --iters "$ITERS" --providers ${BENCH2_PROVIDERS:-megamoe nccl} \
              --cases ${BENCH2_CASES:-deepseek-v3:4096 deepseek-v3:2048 mok-bench:4096 mok-bench:2048} \
              --out "$OUT/logs/bench2" ;;
    train) stage train "${LIMIT_TRAIN:-150}" python3 -m megamoe.train --no-progress --steps "${TRAIN_STEPS:-200}" \
              --out "$OUT/logs/train" ;;
    trainck) stage trainck1 "${LIMIT_TRAINCK:-120}" python3 -m megamoe.train --check --no-progress \
               --steps "${CHECK_STEPS:-30}" --out ""
             [[ $NGPU -ge 2 ]] && stage trainck2 "${LIMIT_TRAINCK:-120}" python3 -m torch.distributed.run --standalone \
              --nproc-per-node 2 -m megamoe.train --check --no-progress --steps "${CHECK_STEPS:-30}" --out "" ;;
    trainref) stage trainref "${LIMIT_TRAINREF:-120}" python3 -m megamoe.train --no-progress --backend reference \
               --steps "${TRAINREF_STEPS:-40}" --out "" ;;
    benchroute) stage benchroute "${LIMIT_BENCHROUTE:-150}" python3 -m megamoe.bench --quiet --iters "$ITERS" \
               --cases qwen3-30b-a3b:16384 --routing zipf:1.2 "trace:$OUT/logs/train/routing_trace.pt" \
               --out "$OUT/logs/benchroute" ;;
    ab) if [[ $NGPU -ge 2 ]]; then stage ab2 "${LIMIT_AB:-150}" python3 -m torch.distributed.run --standalone \
              --nproc-per-node 2 scripts/ab_backward.py "$OUT/logs" ${AB_CASES:-deepseek-v3:4096 mok-bench:2048}
        else stage ab1 "${LIMIT_AB:-150}" python3 scripts/ab_backward.py "$OUT/logs" \
              ${AB_CASES:-deepseek-v3:8192 mok-bench:4096}; fi ;;
    sweep) stage sweep "${LIMIT_SWEEP:-240}" python3 scripts/gemm_sweep.py "$OUT/logs" ${SWEEP_ARGS:-deepseek-v3:4096 qwen3-30b-a3b:16384} ;;
    comm) [[ $NGPU -ge 2 ]] && stage comm "${LIMIT_COMM:-150}" python3 -m torch.distributed.run --standalone \
              --nproc-per-node 2 scripts/comm_bench.py ${COMM_ARGS:-} ;;
    abgluon) for g in 0 1; do MEGAMOE_GLUON=$g stage "abgluon$g" "${LIMIT_ABGLUON:-120}" python3 -m megamoe.bench --quiet \
               --iters "$ITERS" --providers megamoe --cases ${ABGLUON_CASES:-deepseek-v3:8192} --out "$OUT/logs/abgluon$g"; done ;;
    abtiles) runner=(python3 -m megamoe.bench)  # ABTILES_EP=N (N > 1): the EP benchmark on N GPUs, tokens per rank
             [[ ${ABTILES_EP:-1} -gt 1 ]] && runner=(python3 -m torch.distributed.run --standalone \
               --nproc-per-node "$ABTILES_EP" -m megamoe.bench)
             [[ ${ABTILES_EP:-1} -gt $NGPU ]] && { echo "abtiles: ABTILES_EP=$ABTILES_EP needs $ABTILES_EP GPUs" | tee -a "$summary"; continue; }
             for r in $(seq 1 "${ABTILES_REPS:-2}"); do i=0
               for t in table ${ABTILES:-}; do
                 [[ $t == table ]] && t=""
                 envs=""; [[ $t == *@* ]] && { envs="${t%%@*}"; t="${t#*@}"; }  # VAR=1+VAR2=0@tiles
                 ( for a in ${envs//+/ }; do export "$a"; done
                   MEGAMOE_TILES="$t" stage "abtiles_r${r}_${i}" "${LIMIT_ABTILES:-120}" "${runner[@]}" --quiet \
                     --iters "$ITERS" --providers ${ABTILES_PROVIDERS:-megamoe} --cases ${ABTILES_CASES:-qwen3-30b-a3b:16384} \
                     --out "$OUT/logs/abtiles_r${r}_${i}" )
                 echo "    (abtiles_r${r}_${i}: ${envs//+/ } MEGAMOE_TILES='$t')" | tee -a "$summary"; i=$((i + 1))
               done; done
             python3 -m megamoe.bench.ab_summary "$OUT"/logs/abtiles_r* 2>&1 | tee -a "$summary" ;;
    ncu) NCU_OUT="$OUT/logs" stage ncu "${LIMIT_NCU:-260}" scripts/ncu_layer.sh ${NCU_CASE:-qwen3-30b-a3b:16384} ;;
    profile) stage profile "${LIMIT_PROFILE:-150}" python3 scripts/profile_layer.py "$OUT/logs" \
               ${PROFILE_CASES:-qwen3-30b-a3b:16384 deepseek-v3:4096} ;;
    l2) stage l2 "${LIMIT_L2:-90}" python3 scripts/l2_bandwidth.py "$OUT/logs" ;;
    vstorch) stage vstorch "${LIMIT_VSTORCH:-150}" python3 scripts/grouped_mm_vs_torch.py "$OUT/logs" ${VSTORCH_CASES:-} ;;
    abwgrad) stage abwgrad "${LIMIT_ABWGRAD:-300}" python3 scripts/ab_wgrad.py "$OUT/logs" ${ABWGRAD_ARGS:-} ;;
    rounds) stage rounds "${LIMIT_ROUNDS:-300}" python3 scripts/ab_rounds.py "$OUT/logs" ${ROUNDS_CASES:-} ;;
    snippet) stage snippet "${LIMIT_SNIPPET:-90}" python3 -m pytest -q -ra -m gpu tests/test_readme.py ;;
    *) echo "unknown stage $s" | tee -a "$summary" ;;
  esac
done
find "$OUT/logs" -name "*.pt" -delete; tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
cat "$summary"
