"""The persistent Gluon m-grouped GEMM compiled for sm_90a on the CPU (no GPU needed; runs in CI).

Proves, for the variants the launcher can pick (B stored (N, K) or (K, N), bf16 or fp16, with or without a
row scale, 128x128 and 128x256 tiles), that the kernel compiles with Triton's bundled ptxas; its matrix
products are Hopper wgmma instructions of the tile's shape; both operands arrive by TMA bulk-tensor copies
completed on mbarriers; no register spills or local memory; shared memory within the 227 KiB a Hopper block
can have. Correctness (bitwise equal to the Triton kernel) and speed are measured on the GPU
(tests/test_m_grouped_gluon_gpu.py, docs/perf.md). Also the pure host-side operand conditions.
"""

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402

from megamoe.ops import GemmConfig  # noqa: E402
from megamoe.ops.m_grouped_gluon import (WS_MAXNREG, _m_grouped_plain_kernel, _m_grouped_ws_kernel,  # noqa: E402
                                         m_grouped_operands_fit)
from triton_versions import expected  # noqa: E402

from test_wgrad_gluon_compile import HOPPER_SMEM, _ptxas_report  # noqa: E402

DIVISIBLE = ("c_ptr", "scale_ptr", "row_offsets_ptr", "tile_offsets_ptr", "N", "B_ROWS", "stride_cm")


def test_gluon_m_grouped_imports():
    assert _m_grouped_plain_kernel is not None and _m_grouped_ws_kernel is not None


def _compile(b_nk, block_n, stages, has_scale, dt="bf16", ws=False):
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _m_grouped_ws_kernel if ws else _m_grouped_plain_kernel
    num_warps = 4 if ws else 8
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
    a_block = [128, 64]
    b_block = [block_n, 64] if b_nk else [64, block_n]
    la = gl.NVMMASharedLayout.get_default_for(a_block, gdt)
    lb = gl.NVMMASharedLayout.get_default_for(b_block, gdt)
    sig = dict(a_desc=f"tensordesc<{dt}[{a_block[0]}, {a_block[1]}],{la!r}>",
               b_desc=f"tensordesc<{dt}[{b_block[0]}, {b_block[1]}],{lb!r}>",
               scale_ptr="*fp32", row_offsets_ptr="*i32", tile_offsets_ptr="*i32", c_ptr=f"*{dt}",
               num_rows="i32", N="i32", num_experts="i32", B_ROWS="i32", stride_cm="i32")
    const = dict(K=2048, B_NK=b_nk, HAS_SCALE=has_scale, E_POW2=128, BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64,
                 STAGES=stages, num_warps=num_warps)
    if ws:
        const["COOP"] = block_n == 256
    for name in const:
        sig[name] = "constexpr"
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    options = dict(num_warps=num_warps, maxnreg=WS_MAXNREG) if ws else dict(num_warps=num_warps)
    return triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


@pytest.mark.parametrize("b_nk,block_n,stages,has_scale,dt", [
    (True, 256, 3, False, "bf16"),   # down projection (w2 stored (D, F) per expert)
    (False, 256, 3, False, "bf16"),  # dgrad dx (w13 read as (2F, D) = (K, N))
    (True, 128, 4, True, "bf16"),    # 128-wide tiles, row scale
    (False, 128, 4, False, "fp16"),
])
def test_compiles_to_wgmma_tma_without_spills(tmp_path, b_nk, block_n, stages, has_scale, dt):
    k = _compile(b_nk, block_n, stages, has_scale, dt)
    ptx = k.asm["ptx"]
    ptx_dt = {"bf16": "bf16", "fp16": "f16"}[dt]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.{ptx_dt}\.{ptx_dt}", ptx)
    assert "mma.sync" not in ptx
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx)) >= 2
    assert "mbarrier.try_wait" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = _ptxas_report(ptx, tmp_path)
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
    assert k.metadata.shared <= HOPPER_SMEM, f"{k.metadata.shared} bytes of shared memory"


@pytest.mark.parametrize("b_nk,block_n,stages,has_scale,dt", [
    (True, 128, 4, False, "bf16"),   # down projection, ping-pong
    (False, 128, 4, False, "bf16"),  # dgrad dx, ping-pong
    (True, 128, 6, True, "bf16"),    # deepest 128x128 ring that fits, row scale
    (False, 128, 2, False, "fp16"),
    (True, 256, 4, False, "bf16"),   # cooperative 128x256 (64 rows per MMA warpgroup), deepest ring that fits
    (False, 256, 3, False, "bf16"),
])
def test_warp_specialized_kernel_compiles(tmp_path, b_nk, block_n, stages, has_scale, dt):
    """The warp-specialized kernel: 12 warps (two MMA warpgroups, one load warp padded to a warpgroup) under
    the launcher's maxnreg, the MMA warpgroups raised to 232 registers and the load warp lowered to 40
    (setmaxnreg), wgmma m64n{block_n}k16, TMA loads only in the load warp, no spills, <= 227 KiB and within the
    config check's estimate."""
    k = _compile(b_nk, block_n, stages, has_scale, dt, ws=True)
    ptx = k.asm["ptx"]
    ptx_dt = {"bf16": "bf16", "fp16": "f16"}[dt]
    assert k.metadata.num_warps == 12
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.{ptx_dt}\.{ptx_dt}", ptx)
    assert "mma.sync" not in ptx
    regs = set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert ("inc", "232") in regs and ("dec", "40") in regs, regs
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx)) >= 2
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.shared::cta.b64" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = _ptxas_report(ptx, tmp_path)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    # the row-scale epilogue (not used by the layer: its down projection is unscaled) spills a few words at
    # 232 registers (28 bytes with Triton 3.6, 36 with 3.7); the unscaled kernels must not spill at all
    assert spill and int(spill.group(1)) <= (expected({(3, 7): 36, "default": 32}) if has_scale else 0), report
    assert k.metadata.shared <= HOPPER_SMEM, f"{k.metadata.shared} bytes of shared memory"
    estimate = 2 * stages * 64 * (128 + block_n) + 2 * 64 * block_n + 256  # GemmConfig's check
    assert k.metadata.shared <= estimate, (k.metadata.shared, estimate)


def test_warp_specialized_config_checks():
    GemmConfig(128, 128, 64, 8, 6, tma_b=True, tma_a=True, gluon=True, warp_specialized=True)
    GemmConfig(128, 256, 64, 8, 4, tma_b=True, tma_a=True, gluon=True, warp_specialized=True)
    for bad in [dict(gluon=False), dict(block_n=64), dict(num_stages=7), dict(num_warps=4),
                dict(block_n=256, num_stages=5)]:
        kw = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, gluon=True, warp_specialized=True)
        kw.update(bad)
        with pytest.raises(ValueError, match="warp-specialized"):
            GemmConfig(**kw)


def test_operand_conditions():
    cfg = GemmConfig(128, 256, 64, 8, 3, tma_b=True, tma_a=True, gluon=True)
    bf = torch.bfloat16
    a, c = torch.empty(300, 768, dtype=bf), torch.empty(300, 2048, dtype=bf)
    w2 = torch.empty(4, 2048, 768, dtype=bf)  # nt: (E, N, K)
    assert m_grouped_operands_fit(cfg, a, w2, (2048 * 768, 768, 1), 768, c, gathered=False)
    assert not m_grouped_operands_fit(cfg, a, w2, (2048 * 768, 768, 1), 768, c, gathered=True)
    assert not m_grouped_operands_fit(cfg, a.float(), w2, (2048 * 768, 768, 1), 768, c, gathered=False)
    assert not m_grouped_operands_fit(cfg, a, w2, (2048 * 768, 768, 1), 768, c.float(), gathered=False)
    a_pitch = torch.empty(300, 772, dtype=bf)[:, :768]  # row pitch 1544 bytes: not a TMA view
    assert not m_grouped_operands_fit(cfg, a_pitch, w2, (2048 * 768, 768, 1), 768, c, gathered=False)
    w13 = torch.empty(4, 1536, 2048, dtype=bf)  # nn: (E, K, N)
    a2 = torch.empty(300, 1536, dtype=bf)
    assert m_grouped_operands_fit(cfg, a2, w13, (1536 * 2048, 1, 2048), 1536, c, gathered=False)
    w13b = torch.empty(4, 1504, 2048, dtype=bf)  # K = 1504 is not a multiple of BLOCK_K: a tile would cross experts
    assert not m_grouped_operands_fit(cfg, a2[:, :1504], w13b, (1504 * 2048, 1, 2048), 1504, c, gathered=False)
