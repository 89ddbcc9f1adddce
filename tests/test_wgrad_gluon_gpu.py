"""The persistent Gluon weight-gradient kernel on a Hopper GPU, against the Triton kernels and float64.

Proves: bitwise the same (E, M, N) result as the Triton k-grouped kernels (which the interpreter tests check
against float64 on the CPU), on experts of 0, 1, 63, 64, 65 and 300 rows, with P or Q rows gathered through
an index or read in place, M and N multiples of 128 (TMA-stored tiles) or only of 16 (partial tiles, masked stores), bf16 and fp32
outputs, 128x128 and 128x256 tiles, P streamed or kept on chip (both in one launch), and more tiles than programs (every program walks several tiles and experts);
every element of a NaN-poisoned output is written (empty experts: exact zeros); the result is within bf16
rounding of a float64 reference; launching it reads nothing on the host (no sync under
set_sync_debug_mode("error")).

Run: python -m pytest tests/test_wgrad_gluon_gpu.py -q   (skipped without a Hopper GPU)
"""

import contextlib

import pytest
import torch

from megamoe.config import GemmConfig, KernelConfig

pytestmark = pytest.mark.gpu

# every weight gradient through torch._grouped_mm wherever the operands allow
TORCH_WGRAD = KernelConfig({"wgrad": GemmConfig(128, 128, 64, 8, 3, torch_mm=True)})
DEV = "cuda"
BF16 = torch.bfloat16


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (the Gluon kernel targets sm_90)")

COUNTS = [0, 1, 63, 64, 65, 300, 0, 7, 128, 129]  # rows per expert: empty, partial and full chunks
# (BLOCK_N, stages, resident chunks): P always streamed (0), or kept on chip for experts of up to 3-5 chunks
# (the 300-row expert then streams: both paths in one launch)
GLUON_VARIANTS = [(128, 3, 0), (128, 4, 0), (128, 4, 3), (128, 4, 5), (256, 3, 0), (256, 3, 4)]


def _problem(M, N, counts, p_gather, q_gather, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    R = sum(counts)
    offsets = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    T = max(R // 3, 1)  # token matrices that rows are gathered from (each token used ~3 times)
    p = torch.randn(T if p_gather else R, M, generator=g, device=DEV).to(BF16)
    q = torch.randn(T if q_gather else R, N, generator=g, device=DEV).to(BF16)
    idx = torch.randint(0, T, (R,), generator=g, device=DEV, dtype=torch.int32)
    return p, q, offsets, (idx if p_gather else None), (idx if q_gather else None)


@contextlib.contextmanager
def _launches(*names):
    """Record the first argument (the config) of every call of the ``megamoe.ops.grouped_gemm`` launchers
    ``names`` while the block runs."""
    from megamoe.ops import grouped_gemm

    calls, real = [], {n: getattr(grouped_gemm, n) for n in names}
    for n, fn in real.items():
        setattr(grouped_gemm, n, lambda *a, _fn=fn, **k: (calls.append(a[0]), _fn(*a, **k)))
    try:
        yield calls
    finally:
        for n, fn in real.items():
            setattr(grouped_gemm, n, fn)


def _run(cfg, p, q, offsets, p_idx, q_idx, out_dtype=BF16, expect_gluon=None):
    """k_grouped_mm with ``cfg`` forced; a Gluon config must really launch the Gluon kernel (no silent
    fallback to the Triton kernels, which would compare them with themselves), unless ``expect_gluon`` is
    False (a config the launcher is meant to refuse)."""
    from megamoe.config import KernelConfig
    from megamoe.ops import k_grouped_mm

    M, N = p.shape[1], q.shape[1]
    with _launches("launch_gluon_wgrad", "launch_gluon_wgrad_ws") as launches:
        E = offsets.numel() - 1
        out = torch.full((E, M, N), float("nan"), device=DEV, dtype=out_dtype)
        got = k_grouped_mm(p, q, offsets, p_idx_R=p_idx, q_idx_R=q_idx, out_dtype=out_dtype, out=out,
                           kernel_config=KernelConfig({("wgrad", M, N): cfg}))
    expect_gluon = cfg.gluon if expect_gluon is None else expect_gluon
    assert launches == ([cfg] if expect_gluon else []), f"Gluon launches {launches} for {cfg}"
    return got


@needs_hopper
@pytest.mark.parametrize("M,N", [(256, 384), (192, 208), (128, 144)])
@pytest.mark.parametrize("gather", ["none", "p", "q"])
def test_bitwise_equal_to_triton_kernels(M, N, gather):
    from megamoe.ops import GemmConfig

    p, q, off, pi, qi = _problem(M, N, COUNTS, gather == "p", gather == "q", seed=M + N)
    per_tile = _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, pi, qi)
    resident = _run(GemmConfig(128, 128, 64, 8, 3, resident_chunks=3), p, q, off, pi, qi)
    assert torch.equal(per_tile, resident)
    for bn, stages, res in GLUON_VARIANTS:
        got = _run(GemmConfig(128, bn, 64, 8, stages, resident_chunks=res, gluon=True), p, q, off, pi, qi)
        assert not got.isnan().any(), "an output element was not written"
        assert torch.equal(got, per_tile), f"Gluon kernel (128x{bn}, {stages} stages, {res} resident) differs"
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    # float64 reference: within bf16 rounding of the output (fp32 accumulation over <= 300 rows)
    pr = p.double()[pi.long()] if pi is not None else p.double()
    qr = q.double()[qi.long()] if qi is not None else q.double()
    bounds = off.tolist()
    ref = torch.stack([pr[a:b].T @ qr[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=1e-2)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_many_tiles_per_program(out_dtype):
    """Far more tiles than SMs, so each program carries its load ring across many tiles and experts (the
    case that caught a miscompiled chunk count, see the kernel); bf16 (TMA-stored) and fp32 (masked
    stores) outputs; no host sync while launching; the one refused combination (fp32 output, 128x256
    tiles) falls back to the Triton kernels with the same result."""
    from megamoe.ops import GemmConfig

    counts = [int(c) for c in torch.randint(0, 200, (64,), generator=torch.Generator().manual_seed(3))]
    counts[5] = counts[17] = 0
    p, q, off, pi, qi = _problem(512, 640, counts, False, True, seed=11)
    want = _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, pi, qi, out_dtype=out_dtype)
    for cfg in (GemmConfig(128, 128, 64, 8, 4, gluon=True), GemmConfig(128, 128, 64, 8, 4, resident_chunks=3, gluon=True),
                GemmConfig(128, 256, 64, 8, 3, resident_chunks=4, gluon=True)):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        # fp32 output with 128x256 tiles is refused (its epilogue spills) and runs the Triton kernels
        refused = out_dtype == torch.float32 and cfg.block_n == 256
        try:
            got = _run(cfg, p, q, off, pi, qi, out_dtype=out_dtype, expect_gluon=not refused)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(got, want), f"{cfg}: {int((got != want).sum())} elements differ"


# --- the warp-specialized kernel (megamoe/kernels/wgrad_ws_gluon.py): contiguous rows, 128x128 tiles ---------
# (ring slots, resident chunks): P streamed (0), or on chip for experts of up to 3, 5, 6 chunks (COUNTS has
# experts of 1, 2, 3 and 5 chunks, so res = 3 mixes resident and streamed units in one launch)
WS_VARIANTS = [(2, 0), (3, 0), (5, 0), (5, 3), (4, 5), (6, 5), (6, 6)]


def _ws(stages, res=0):
    from megamoe.ops import GemmConfig

    return GemmConfig(128, 128, 64, 8, stages, resident_chunks=res, gluon=True, warp_specialized=True)


@needs_hopper
@pytest.mark.parametrize("M,N", [(256, 384), (192, 208), (128, 144), (256, 128), (128, 64)])
def test_ws_bitwise_equal_to_triton_kernels(M, N):
    """Every ring size, P streamed or on chip, gives the Triton per-tile kernel's bits on experts of 0-300 rows
    (partial chunks, the next expert's rows zeroed, empty experts), M and N multiples of 128 or only of 16,
    units of one n-tile (N <= 128: the other MMA warpgroup has no tile in them); gathered rows are refused
    (Triton kernels, same bits)."""
    from megamoe.ops import GemmConfig

    p, q, off, _, _ = _problem(M, N, COUNTS, False, False, seed=M * N)
    want = _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, None, None)
    for stages, res in WS_VARIANTS:
        got = _run(_ws(stages, res), p, q, off, None, None)
        assert not got.isnan().any(), "an output element was not written"
        assert torch.equal(got, want), f"{stages} stages, {res} resident: {int((got != want).sum())} elements differ"
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    pg, qg, offg, pi, qi = _problem(M, N, COUNTS, False, True, seed=M * N + 1)
    assert torch.equal(_run(_ws(4), pg, qg, offg, pi, qi, expect_gluon=False),
                       _run(GemmConfig(128, 128, 64, 8, 2), pg, qg, offg, pi, qi))


@needs_hopper
def test_ws_next_experts_rows_never_reach_the_sum():
    """Rows of the next expert inside an expert's last chunk are zeroed in both operands: an expert of non-finite
    rows (inf in P, NaN in Q) leaves its neighbours' gradients finite and equal to the Triton kernels'."""
    from megamoe.ops import GemmConfig

    counts = [65, 40, 7, 130, 0, 33]
    p, q, off, _, _ = _problem(256, 256, counts, False, False, seed=5)
    bad = [1, 3]
    for e in bad:
        a, b = off[e].item(), off[e + 1].item()
        p[a:b, ::3] = float("inf")
        q[a:b, 1::5] = float("nan")
    want = _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, None, None)
    good = [e for e in range(len(counts)) if e not in bad]
    for stages, res in ((4, 0), (5, 5), (5, 2)):  # streamed, resident, both
        got = _run(_ws(stages, res), p, q, off, None, None)
        assert torch.isfinite(got[good]).all(), f"({stages}, {res}): another expert's non-finite rows reached a gradient"
        assert torch.equal(got[good], want[good])
        assert got[bad].isnan().any()


@needs_hopper
def test_ws_many_tiles_per_program_without_sync():
    """Far more tiles than SMs (each program's ring runs across many tiles, units and experts, both MMA
    warpgroups take turns), no host sync while launching, the Triton kernels' bits."""
    from megamoe.ops import GemmConfig

    counts = [int(c) for c in torch.randint(0, 300, (96,), generator=torch.Generator().manual_seed(4))]
    counts[0] = counts[40] = counts[95] = 0
    p, q, off, _, _ = _problem(512, 640, counts, False, False, seed=12)
    want = _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, None, None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [_run(_ws(5), p, q, off, None, None), _run(_ws(6, 5), p, q, off, None, None)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for g in got:
        assert torch.equal(g, want), f"{int((g != want).sum())} elements differ"


@needs_hopper
def test_table_takes_ws_kernel_for_contiguous_rows_in_its_window():
    """The table's choice (no override): contiguous rows at ~200 per expert (torch's window, at most 384) run
    the warp-specialized kernel with the Triton kernels' bits; gathered rows, and too few (expert, m-tile)
    units to fill the SMs, keep torch._grouped_mm; a torch_mm "wgrad" entry of the KernelConfig replaces it."""
    from megamoe.ops import GemmConfig, k_grouped_mm

    def table_run(p, q, off, **kw):
        with _launches("launch_gluon_wgrad_ws") as ws:
            return k_grouped_mm(p, q, off, **kw), len(ws)

    counts = [int(c) for c in torch.randint(150, 250, (80,), generator=torch.Generator().manual_seed(6))]
    p, q, off, _, _ = _problem(256, 384, counts, False, False, seed=21)
    got, n_ws = table_run(p, q, off)
    assert n_ws == 1
    assert torch.equal(got, _run(GemmConfig(128, 128, 64, 8, 2), p, q, off, None, None))
    pg, qg, offg, _, qi = _problem(256, 384, counts, False, True, seed=22)
    assert table_run(pg, qg, offg, q_idx_R=qi)[1] == 0  # gathered rows: not this kernel (TMA reads rows in place)
    few = counts[:8]
    pf, qf, offf, _, _ = _problem(256, 384, few, False, False, seed=23)
    assert table_run(pf, qf, offf)[1] == 0  # 16 units < SMs
    off_got, n_ws = table_run(p, q, off, kernel_config=TORCH_WGRAD)
    assert n_ws == 0 and torch.equal(off_got, got)


@needs_hopper
def test_layer_with_ws_weight_gradients_keeps_the_bits():
    """The fused layer at qwen3-30b-a3b's shapes, T = 4096 (~256 rows per expert, contiguous after the layer's row
    copies: the table's warp-specialized window): output, dx and every parameter gradient are bitwise the same
    as with torch._grouped_mm there (a torch_mm "wgrad" entry of the KernelConfig), and the warp-specialized kernel
    did run (dW13, dW2)."""
    import megamoe

    cfg = megamoe.get_preset("qwen3-30b-a3b")
    moe = megamoe.MoE(cfg, backend="fused", device=DEV, seed=3)
    moe_torch = megamoe.MoE(cfg, backend="fused", device=DEV, seed=3, kernel_config=TORCH_WGRAD)
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(4096, cfg.hidden_size, generator=g, device=DEV).to(BF16)
    dy = torch.randn(4096, cfg.hidden_size, generator=g, device=DEV).to(BF16)

    def step(m):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(dy)
        return [y.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in m.parameters()]

    with _launches("launch_gluon_wgrad_ws") as ws:
        with_ws = step(moe)
    assert len(ws) >= 2, f"the warp-specialized kernel ran {len(ws)} times"
    with _launches("launch_gluon_wgrad_ws") as ws:
        with_torch = step(moe_torch)
    assert len(ws) == 0, f"the warp-specialized kernel ran {len(ws)} times with torch's kernel asked for"
    names = ["out", "dx"] + [n for n, _ in moe.named_parameters()]
    for name, a, b in zip(names, with_ws, with_torch):
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
