"""The persistent Gluon m-grouped GEMM on a Hopper GPU, against the Triton m-grouped kernel and float64.

Proves: bitwise the same rows as the Triton kernel with the same tiles (TMA loads, PLAIN epilogue) for the
down projection ("nt": B stored (N, K)) and the dgrad dx GEMM ("nn": B stored (K, N)), on experts of 0, 1,
127, 128, 129 and 300 rows, N and K that are not multiples of the tile (masked columns, zero-filled K
tail), with and without a row scale, 128x128 and 128x256 tiles, and more tiles than programs (every program
walks several tiles and experts, its load ring crossing tile boundaries); every row of an expert in a
NaN-poisoned output is written, rows past the last expert are left untouched; the result is within bf16
rounding of a float64 reference; the Gluon launcher really ran (no silent fallback). The same for the
warp-specialized forms (ping-pong 128x128 with 2, 4 and 6 ring slots, cooperative 128x256 with 2-4), also
with several tiles per program so that both MMA warpgroups take several tiles and the ring wraps many times.

Run: python -m pytest tests/test_m_grouped_gluon_gpu.py -q   (skipped without a Hopper GPU)
"""

import pytest
import torch

from test_wgrad_gluon_gpu import BF16, DEV, needs_hopper  # the same device / Hopper checks

pytestmark = pytest.mark.gpu

COUNTS = [0, 1, 127, 128, 129, 300, 0, 7, 256, 45]
PAD = 13  # buffer rows past the last expert (EP capacity slack): never written


def _call(kind, cfg, a, w, off, scale, expect_gluon):
    from megamoe.ops import down_proj, grouped_gemm, grouped_mm_nn, tile_config

    E = w.shape[0]
    N, K = (w.shape[1], w.shape[2]) if kind == "down" else (w.shape[2], w.shape[1])
    saved = dict(tile_config._OVERRIDES)
    tile_config._OVERRIDES[("down" if kind == "down" else "dgrad", N, K)] = cfg
    launches = []
    real = grouped_gemm.launch_gluon_m_grouped
    grouped_gemm.launch_gluon_m_grouped = lambda *x, **k: (launches.append(x[0]), real(*x, **k))
    try:
        out = torch.full((a.shape[0], N), float("nan"), device=DEV, dtype=BF16)
        if kind == "down":
            down_proj(a, w, off, row_scale_R=scale, out=out)
        else:
            grouped_mm_nn(a, w, off, out=out)
    finally:
        grouped_gemm.launch_gluon_m_grouped = real
        tile_config._OVERRIDES.clear()
        tile_config._OVERRIDES.update(saved)
    assert launches == ([cfg] if expect_gluon else []), f"Gluon launches {launches} for {cfg}"
    return out


def _problem(kind, N, K, seed, counts=COUNTS):
    g = torch.Generator(device=DEV).manual_seed(seed)
    E, R = len(counts), sum(counts)
    off = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    a = torch.randn(R + PAD, K, generator=g, device=DEV).to(BF16)
    shape = (E, N, K) if kind == "down" else (E, K, N)
    w = (torch.randn(*shape, generator=g, device=DEV) / K ** 0.5).to(BF16)
    scale = torch.rand(R + PAD, generator=g, device=DEV)
    return a, w, off, scale


def _reference(kind, a, w, off, scale):
    rows = []
    for e in range(w.shape[0]):
        lo, hi = int(off[e]), int(off[e + 1])
        we = w[e].double()
        y = a[lo:hi].double() @ (we.t() if kind == "down" else we)
        rows.append(y * scale[lo:hi, None].double() if scale is not None else y)
    return torch.cat(rows)


@needs_hopper
@pytest.mark.parametrize("kind,N,K", [("down", 320, 768), ("down", 2048, 96), ("dgrad", 384, 1536),
                                      ("dgrad", 200, 128)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_bitwise_equal_to_triton_kernel(kind, N, K, with_scale):
    from megamoe.ops import GemmConfig

    if kind == "dgrad" and with_scale:
        pytest.skip("grouped_mm_nn takes no row scale")
    a, w, off, scale = _problem(kind, N, K, seed=N + K)
    scale = scale if with_scale else None
    R = int(off[-1])
    for bn, stages, ws in [(256, 3, False), (128, 4, False), (128, 3, False), (128, 4, True), (128, 2, True),
                           (128, 6, True), (256, 4, True), (256, 2, True)]:
        triton_cfg = GemmConfig(128, bn, 64, 8, stages, tma_b=True, tma_a=True)
        gluon_cfg = GemmConfig(128, bn, 64, 8, stages, tma_b=True, tma_a=True, gluon=True, warp_specialized=ws)
        ref = _call(kind, triton_cfg, a, w, off, scale, expect_gluon=False)
        got = _call(kind, gluon_cfg, a, w, off, scale, expect_gluon=True)
        assert torch.isfinite(got[:R]).all(), "a row of an expert was not written"
        assert torch.isnan(got[R:]).all(), "a row past the last expert was written"
        assert torch.equal(got[:R], ref[:R]), f"Gluon {gluon_cfg} differs from Triton {triton_cfg}"
    want = _reference(kind, a, w, off, scale)
    # bf16 output rounding plus fp32 accumulation: within a few bf16 ulps of the float64 value
    err = (got[:R].double() - want).abs()
    assert (err <= 2 ** -7 * want.abs() + 1e-2).all(), err.max().item()


@needs_hopper
@pytest.mark.parametrize("kind,N,K", [("down", 1024, 768), ("dgrad", 1152, 1536)])
@pytest.mark.parametrize("block_n,stages", [(128, 2), (128, 4), (256, 3)])
def test_warp_specialized_many_tiles_per_program(kind, N, K, block_n, stages):
    """The warp-specialized kernel with several tiles per program (ping-pong: both MMA warpgroups take several
    tiles, odd and even counts per program; cooperative: both on every tile; the load ring wraps many times):
    bitwise the Triton kernel's rows, every expert row written, rows past the last expert untouched, repeated
    launches identical."""
    from megamoe.ops import GemmConfig

    a, w, off, _ = _problem(kind, N, K, seed=stages, counts=[c * 8 for c in COUNTS] + [3, 0, 1000])
    R = int(off[-1])
    ref = _call(kind, GemmConfig(128, 128, 64, 8, 4, tma_b=True, tma_a=True), a, w, off, None, expect_gluon=False)
    cfg = GemmConfig(128, block_n, 64, 8, stages, tma_b=True, tma_a=True, gluon=True, warp_specialized=True)
    for _ in range(3):
        got = _call(kind, cfg, a, w, off, None, expect_gluon=True)
        assert torch.isfinite(got[:R]).all(), "a row of an expert was not written"
        assert torch.isnan(got[R:]).all(), "a row past the last expert was written"
        assert torch.equal(got[:R], ref[:R]), f"warp-specialized {cfg} differs from the Triton kernel"


@needs_hopper
def test_gathered_rows_and_fp32_output_take_the_triton_kernel():
    """Gathered A rows (no TMA gather on Hopper) and fp32 outputs are refused: the Triton kernel runs, and a
    gathered call gives the same rows as the Gluon kernel on the same rows copied in order."""
    from megamoe.ops import GemmConfig, grouped_gemm, grouped_mm_nt, tile_config

    a, w, off, _ = _problem("down", 256, 256, seed=3)
    R = int(off[-1])
    cfg = GemmConfig(128, 256, 64, 8, 3, tma_b=True, tma_a=True, gluon=True)
    launches = []
    real = grouped_gemm.launch_gluon_m_grouped
    grouped_gemm.launch_gluon_m_grouped = lambda *x, **k: (launches.append(1), real(*x, **k))
    saved = dict(tile_config._OVERRIDES)
    tile_config._OVERRIDES[("down", 256, 256)] = cfg
    try:
        idx = torch.randperm(R, device=DEV).to(torch.int32)
        gathered = grouped_mm_nt(a, w, off, gather_idx_R=idx)
        assert launches == []
        grouped_mm_nt(a[:R], w, off, out_dtype=torch.float32)
        assert launches == []
        in_order = grouped_mm_nt(a[idx.long()].contiguous(), w, off)
        assert launches == [1]
        assert torch.equal(gathered, in_order)
    finally:
        grouped_gemm.launch_gluon_m_grouped = real
        tile_config._OVERRIDES.clear()
        tile_config._OVERRIDES.update(saved)
