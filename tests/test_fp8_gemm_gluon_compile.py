"""The warp-specialized Gluon FP8 m-grouped GEMM compiled for sm_90a on the CPU (no GPU needed; runs in CI), and
its launcher's argument checks.

Proves, at the layer's plain-epilogue "nt" shapes (qwen3-30b-a3b and deepseek-v3 down projection and K-major dgrad
dx) with the launcher's ring depth and K-loop chunk: the products are FP8 wgmma instructions (m64n128k32, e4m3 x
e4m3 -> f32) and nothing else; every promotion (64 fused multiply-adds per thread) runs between a
``wgmma.wait_group 1`` and the next wait, i.e. with the next K-block's wgmma in flight, except the last of each
chunk (``wait_group 0``); ptxas neither serializes the wgmmas nor spills; shared memory within a Hopper block's
227 KiB; operands arrive by TMA and full output blocks leave by TMA stores. Bits and speed are measured on the GPU
(tests/test_fp8_gemm_gluon_gpu.py, scripts/fp8_gluon_bench.py).
"""

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from megamoe.bench.kernel_inventory import HOPPER_SMEM, ptxas_report
from megamoe.ops.fp8_gemm_gluon import (
    FP8_GLUON_AVAILABLE,
    fp8_gluon_stages,
    fp8_gluon_unroll,
    fp8_grouped_mm_nt_gluon,
)

# (K, N) of the plain-epilogue "nt" GEMMs: down (K = F, N = D) and dgrad dx (K = 2F, N = D)
SHAPES = {"qwen3-down": (768, 2048), "qwen3-dx": (1536, 2048), "deepseek-down": (2048, 7168),
          "deepseek-dx": (4096, 7168)}
_OUT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def test_gluon_kernel_imports():
    """Gluon imports here, so the FP8 Gluon kernel must too (a broken import would make the launcher raise)."""
    assert FP8_GLUON_AVAILABLE


def _compile(K, N, out_dtype):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from megamoe.kernels.fp8_gemm_gluon import fp8_m_grouped_ws_kernel as kernel

    out = _OUT[out_dtype]
    ab = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    c_layout = gl.NVMMASharedLayout.get_default_for([64, 128], {"bf16": gl.bfloat16, "fp32": gl.float32}[out])
    desc = f"tensordesc<fp8e4nv[128, 128],{ab!r}>"
    sig = dict(a_desc=desc, b_desc=desc, as_ptr="*fp32", bs_ptr="*fp32", row_offsets_ptr="*i32",
               tile_offsets_ptr="*i32", c_ptr=f"*{out}", c_desc=f"tensordesc<{out}[64, 128],{c_layout!r}>",
               num_rows="i32", N="i32", num_experts="i32", stride_asm="i32", stride_bse="i32", stride_bsn="i32",
               stride_cm="i32")
    const = dict(K=K, E_POW2=128, BLOCK_M=128, BLOCK_N=128, STAGES=fp8_gluon_stages(out_dtype),
                 UNROLL=fp8_gluon_unroll(K), num_warps=4)
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(kernel.arg_names)
    divisible = ("as_ptr", "bs_ptr", "row_offsets_ptr", "tile_offsets_ptr", "c_ptr", "N", "stride_cm", "stride_bse",
                 "stride_bsn")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if N % 16 == 0 or n != "N"}
    # the launch's options: maxnreg 168 for 12 warps (the partitions then trade registers), fused multiply-adds
    return triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=168, enable_fp_fusion=True))


CASES = [(name, torch.bfloat16) for name in SHAPES] + [
    pytest.param("qwen3-down", torch.float32, marks=pytest.mark.slow)]  # fp32 output: a shallower ring


@pytest.mark.parametrize("shape, out_dtype", CASES, ids=[*SHAPES, "qwen3-down-fp32"])
def test_compiles_with_promotion_overlapping_the_next_wgmma(shape, out_dtype):
    K, N = SHAPES[shape]
    k = _compile(K, N, out_dtype)
    ptx = k.asm["ptx"]
    unroll = fp8_gluon_unroll(K)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)) == {"m64n128k32.f32.e4m3.e4m3"}
    assert "mma.sync" not in ptx
    # two MMA warpgroups, each with one chunk of `unroll` K-blocks in its code: a promotion after each wait 1
    # (the next K-block's wgmma issued before it) and the chunk's last after the wait 0
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 2 * (unroll - 1) and waits.count("0") == 2, waits
    for segment in re.split(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)[1:]:
        before_next_wait = segment.split("wgmma.wait_group")[0]
        assert len(re.findall(r"\bfma\.rn\.f32\b", before_next_wait)) == 64, "the promotion after a wait 1"
    # the promotion is one fused multiply-add per element (the Triton kernel's rounding), none other
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == 2 * 64 * unroll
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx))
    assert loads >= 2 and loads % 2 == 0, loads  # A and B blocks of a step (the load loop may be unrolled)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)) == 2  # a store per warpgroup
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = ptxas_report(ptx)
    assert "serialized" not in report, report  # ptxas C7512-C7515: wgmmas serialized (in-flight registers touched)
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
    assert k.metadata.shared <= HOPPER_SMEM, f"{k.metadata.shared} bytes of shared memory"


def _args(R=256, E=2, N=256, K=256, dev="cpu"):
    e4m3 = torch.float8_e4m3fn
    return (torch.zeros(R, K, device=dev).to(e4m3), torch.ones(R, K // 128, device=dev),
            torch.zeros(E, N, K, device=dev).to(e4m3), torch.ones(E, N // 128, K // 128, device=dev),
            torch.tensor([0, R // 2, R], dtype=torch.int32, device=dev)[:E + 1])


@pytest.mark.parametrize("change, error, match", [
    (lambda a: (a[0].float(),) + a[1:], ValueError, "aq must be a 2-D"),
    (lambda a: (a[0][:, :128],) + a[1:], ValueError, "aq must be"),
    (lambda a: (a[0], a[1][:, :1].contiguous()) + a[2:], ValueError, "as_"),
    (lambda a: a[:2] + (a[2].transpose(1, 2),) + a[3:], ValueError, "bq must be contiguous"),
    (lambda a: a[:3] + (a[3][:, :1],) + a[4:], ValueError, "bs must be"),
    (lambda a: a[:4] + (a[4].long(),), ValueError, "offsets_E1"),
    (lambda a: a[:4] + (a[4][:2],), ValueError, "offsets_E1"),
    (lambda a: (a[0][:, :200],) + a[1:], ValueError, "aq must be contiguous"),
])
def test_bad_arguments_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        fp8_grouped_mm_nt_gluon(*change(_args()))


def test_bad_out_dtype_and_device():
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_grouped_mm_nt_gluon(*_args(), out_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Hopper"):  # CPU tensors: no Gluon kernel
        fp8_grouped_mm_nt_gluon(*_args())
