#!/usr/bin/env bash
# Single-GPU fused MoE path on a CUDA machine: the GPU tests, then a quick timing of forward and
# forward+backward against the eager torch path (sort + torch._grouped_mm, megamoe.bench.providers)
# for qwen3-30b-a3b T=16384 and deepseek-v3 T=4096, plus the per-GEMM tile-config sweep (scripts/gemm_sweep.py).
# Usage: [SWEEP=0] scripts/gpu_fused.sh [all|tests|bench]   Logs go to $OUT (default /tmp/gpu_fused).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/gpu_fused}"
mkdir -p "$OUT"
MODE="${1:-all}"
rc=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1 || true
if [[ "$MODE" == all || "$MODE" == tests ]]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_fused_gpu.py -q -ra --durations=8 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
  tail -4 "$OUT/tests.log"
fi
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 - "$OUT" "${SWEEP:-1}" <<'PY' 2>&1 | tee "$OUT/bench.log"
import json, sys
import torch
from megamoe.config import get_preset
from megamoe.functional import moe_experts
from megamoe.bench.providers import torch_moe_experts

sys.path.insert(0, "scripts")
from gemm_sweep import timeit  # noqa: E402 - median of CUDA-event times after warm-ups (shared with the sweep)

out_dir = sys.argv[1]
dev = torch.device("cuda")
results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
ms = timeit(lambda: a @ b, iters=20, warm=3)
dense = 2 * 8192 ** 3 / ms / 1e9
results["dense_bf16_tflops"] = dense
print(f"dense bf16 8192^3: {ms:.3f} ms  {dense:.0f} TFLOP/s")
del a, b


def problem(name, T, seed=0):
    cfg = get_preset(name)
    D, F, E, K, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, cfg.shared_intermediate_size
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=dev).bfloat16()
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)
    w13 = (torch.randn(E, 2 * F, D, generator=g, device=dev) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g, device=dev) / F ** 0.5).bfloat16()
    s13 = (torch.randn(2 * S, D, generator=g, device=dev) / D ** 0.5).bfloat16() if S else None
    s2 = (torch.randn(D, S, generator=g, device=dev) / S ** 0.5).bfloat16() if S else None
    flops = 6 * T * D * (K * F + S)
    return (x, ids, w, w13, w2, s13, s2), flops, (T, D, F, E, K, S)


def bench_layer(name, T):
    args, flops, shape = problem(name, T)
    x, ids, w, w13, w2, s13, s2 = args
    params = [p.requires_grad_() for p in (x, w, w13, w2, s13, s2) if p is not None]
    dout = torch.randn_like(x)
    row = {"shape": shape, "fwd_flop": flops}
    for prov, fn in (("megamoe", lambda *a: moe_experts(*a, backend="fused")), ("torch", torch_moe_experts)):
        torch.cuda.reset_peak_memory_stats()
        f = lambda: fn(x, ids, w, w13, w2, s13, s2)
        fb = lambda: torch.autograd.grad(f(), params, dout)
        tf = timeit(f, iters=10, warm=3)
        tfb = timeit(fb, iters=10, warm=3)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30
        row[prov] = {"fwd_ms": tf, "fwdbwd_ms": tfb, "fwd_tflops": flops / tf / 1e9,
                     "fwdbwd_tflops": 3 * flops / tfb / 1e9, "peak_gib": mem}
        print(f"{name:14s} T={T:6d} {prov:8s} fwd {tf:8.3f} ms ({flops / tf / 1e9:5.0f} TF/s)  fwd+bwd {tfb:8.3f} ms "
              f"({3 * flops / tfb / 1e9:5.0f} TF/s, {100 * 3 * flops / tfb / 1e9 / dense:4.1f}% dense)  peak {mem:6.1f} GiB", flush=True)
    row["speedup_fwdbwd"] = row["torch"]["fwdbwd_ms"] / row["megamoe"]["fwdbwd_ms"]
    row["speedup_fwd"] = row["torch"]["fwd_ms"] / row["megamoe"]["fwd_ms"]
    print(f"{name:14s} speedup vs torch: fwd {row['speedup_fwd']:.2f}x  fwd+bwd {row['speedup_fwdbwd']:.2f}x", flush=True)
    return row, args


for name, T in (("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096)):
    row, args = bench_layer(name, T)
    results[name] = row
    del args
    torch.cuda.empty_cache()
    json.dump(results, open(f"{out_dir}/bench.json", "w"), indent=1, default=str)
print("done")
PY
  brc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] && rc=$brc
  if [[ "${SWEEP:-1}" == 1 ]]; then  # per-GEMM tile-config sweep with bitwise checks (SWEEP=0 skips it)
    timeout "${SWEEP_TIMEOUT:-400}" python3 scripts/gemm_sweep.py "$OUT" 2>&1 | tee "$OUT/sweep.log"
  fi
fi
exit $rc
