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
  cat > "$OUT/comm_bench.py" <<'PY'
# Dispatch (pull) and combine (push) GB/s per rank for deepseek-v3 / mok-bench rows, identity experts.
import os, statistics, sys
import torch, torch.distributed as dist
from megamoe.distributed import get_workspace, reserve_workspace, default_capacity_rows, max_rounds
from megamoe.ops import ep_comm as X
from megamoe.ops.combine import combine_fwd
from megamoe.config import get_preset
rank = int(os.environ["RANK"]); W = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
def t_ms(fn, iters=10):
    for _ in range(3): fn()
    ts = []
    for _ in range(iters):
        dist.barrier(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    t = torch.tensor([statistics.median(ts)], device=dev); dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
reserve_workspace(None, 4096)
for name in ("deepseek-v3", "mok-bench"):
    cfg = get_preset(name); D, E, K, T = cfg.hidden_size, cfg.num_experts, cfg.top_k, 4096
    ws = get_workspace(None, num_tokens=T, hidden=D, top_k=K, num_experts=E, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev, generator=g)
    C = default_capacity_rows(ws.spec); rounds = max_rounds(ws.spec, C)
    bufs = X.ExchangeBuffers(ws, C, backward=False)
    def dispatch():
        X.publish(ws, ids, x); X.build_schedule(ws, bufs, rounds, 10.0)
        for r in range(rounds): X.dispatch_round(ws, bufs, r, False)
    def exchange():
        dispatch()
        for r in range(rounds): X.push_round(ws, bufs, r, bufs.xr_CD)
        X.signal_done(ws); X.wait_done(ws, 10.0)
        rows, row_of, _ = X.slot_views(ws, T); return combine_fwd(rows, row_of, w, None, out_dtype=x.dtype)
    def finish():  # keep epochs in step: complete the exchange untimed after a dispatch-only timing
        for r in range(rounds): X.push_round(ws, bufs, r, bufs.xr_CD)
        X.signal_done(ws); X.wait_done(ws, 10.0)
    out = exchange(); torch.cuda.synchronize()
    ok = torch.allclose(out.float(), (w.sum(1, keepdim=True) * x.float()), rtol=2e-2, atol=2e-2)
    R = int(bufs.sched[0].item()); nbytes = R * D * 2
    L = E // W; cnt = bufs.sched[80:80 + E].view(L, W).sum(0).tolist()
    remote = (R - cnt[rank]) * D * 2  # rows that crossed NVLink (the rest come from this rank's own memory)
    tx = t_ms(exchange)
    tdo = []
    for _ in range(10):
        dist.barrier(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); dispatch(); e.record(); finish(); torch.cuda.synchronize(); tdo.append(s.elapsed_time(e))
    t_disp = statistics.median(tdo); t_comb = tx - t_disp
    peer = ws._keepalive.get_buffer(1 - rank, (ws.rows_2TD.numel() * 2,), torch.uint8) if W == 2 else None
    loc = torch.empty_like(peer)
    tp = t_ms(lambda: loc.copy_(peer))
    peer_gbs = peer.numel() / tp / 1e6
    if rank == 0:
        print(f"{name}: T={T}/rank R={R} rows ({remote / nbytes:.0%} remote)  dispatch {t_disp:.3f} ms "
              f"{nbytes / t_disp / 1e6:.0f} GB/s all rows, {remote / t_disp / 1e6:.0f} GB/s NVLink  "
              f"combine(+reduce) {t_comb:.3f} ms {nbytes / t_comb / 1e6:.0f} GB/s all rows, "
              f"{remote / t_comb / 1e6:.0f} GB/s NVLink  peer copy {peer_gbs:.0f} GB/s  "
              f"exchange {tx:.3f} ms  correct={ok}", flush=True)
dist.barrier(); dist.destroy_process_group()
PY
  timeout "${COMM_TIMEOUT:-120}" torchrun --standalone --nproc-per-node 2 "$OUT/comm_bench.py" 2>&1 | tee "$OUT/comm.log"
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
