"""Temporary: which change made the Gluon weight-gradient kernel differ from the Triton kernels on many tiles."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megamoe.ops import GemmConfig, k_grouped_mm, tile_config

dev = "cuda"
def problem(M, N, counts, pg, qg, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    R = sum(counts); off = torch.tensor([0] + counts, device=dev).cumsum(0).to(torch.int32)
    T = max(R // 3, 1)
    p = torch.randn(T if pg else R, M, generator=g, device=dev).bfloat16()
    q = torch.randn(T if qg else R, N, generator=g, device=dev).bfloat16()
    idx = torch.randint(0, T, (R,), generator=g, device=dev, dtype=torch.int32)
    return p, q, off, idx if pg else None, idx if qg else None
def run(cfg, p, q, off, pi, qi, dt):
    M, N = p.shape[1], q.shape[1]
    tile_config._OVERRIDES[("wgrad", M, N)] = cfg
    out = torch.full((off.numel() - 1, M, N), float("nan"), device=dev, dtype=dt)
    r = k_grouped_mm(p, q, off, p_idx_R=pi, q_idx_R=qi, out_dtype=dt, out=out)
    tile_config._OVERRIDES.clear(); return r
cases = []
counts = [int(c) for c in torch.randint(0, 200, (64,), generator=torch.Generator().manual_seed(3))]; counts[5] = counts[17] = 0
cases.append(("fp32 512x640", problem(512, 640, counts, False, True, 11), torch.float32))
cases.append(("bf16 512x640", problem(512, 640, counts, False, True, 11), torch.bfloat16))
counts2 = [int(c) for c in torch.randint(100, 160, (64,), generator=torch.Generator().manual_seed(4))]
cases.append(("bf16 1024x1024 nogap", problem(1024, 1024, counts2, True, False, 12), torch.bfloat16))
for name, (p, q, off, pi, qi), dt in cases:
    want = run(GemmConfig(128, 128, 64, 8, 2), p, q, off, pi, qi, dt)
    for dbg in ["", "wait0", "fillafter", "wait0,fillafter"]:
        os.environ["MEGAMOE_GLUON_DEBUG"] = dbg
        for cfg in (GemmConfig(128, 128, 64, 8, 4, gluon=True), GemmConfig(128, 128, 64, 8, 3, gluon=True)):
            got = run(cfg, p, q, off, pi, qi, dt)
            d = (got != want) & ~(got.isnan() & want.isnan())
            bad_e = d.flatten(1).any(1).nonzero().flatten().tolist()
            cnt = off.diff().tolist()
            print(f"{name:22s} dbg={dbg or '-':16s} stages={cfg.num_stages} diff={int(d.sum())} nan={int(got.isnan().sum())} "
                  f"max|d|={float((got.float()-want.float()).abs().nan_to_num(0).max()):.3g} experts={bad_e[:8]} rows={[cnt[e] for e in bad_e[:8]]}", flush=True)
