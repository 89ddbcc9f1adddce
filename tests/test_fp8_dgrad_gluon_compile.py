"""The FP8 dgrad with the SwiGLU backward in its epilogue (Gluon) compiled for sm_90a on the CPU (no GPU needed;
runs in CI), and its launcher's argument checks.

Proves, at the qwen3-30b-a3b dgrad shape (D = 2048, F = 768; deepseek-v3's D = 7168, F = 2048 in the slow set) with
the launcher's ring depth and K-loop chunk: the main loop is the m-grouped kernel's (FP8 wgmma m64n128k32 only,
each promotion after a ``wgmma.wait_group 1``, no serialized wgmmas); shared memory within a Hopper block's 227 KiB;
operands arrive by TMA and nothing leaves by a TMA store (the epilogue stores dgu, hw, the row dots and dgu's
1x128 blocks); and the epilogue sums the row-dot partials in the layout the SwiGLU-backward pass
(megamoe.kernels.fp8_swiglu.swiglu_bwd_rows_kernel) compiles to under this Triton, which is what makes the two
paths' row dots the same bits. The bits themselves are checked on the GPU (tests/test_fp8_dgrad_gluon_gpu.py).
"""

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from megamoe.bench.kernel_inventory import HOPPER_SMEM, ptxas_report
from megamoe.ops.fp8_gemm_gluon import fp8_dgrad_swiglu_gluon, fp8_gluon_stages, fp8_gluon_unroll

_POINTERS = ("as_ptr", "bs_ptr", "row_offsets_ptr", "tile_offsets_ptr", "scale_ptr", "gu_ptr", "dgu_ptr", "hw_ptr",
             "dot_ptr", "q_ptr", "qs_ptr")


def _compile(source, kernel, sig, const, options):
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(sig, **dict.fromkeys(const, "constexpr"))
    names = list(kernel.arg_names)
    divisible = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride") or n == "N"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(source(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def _compile_fused(D, F):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from megamoe.kernels.fp8_dgrad_gluon import fp8_dgrad_swiglu_ws_kernel as kernel

    layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    desc = f"tensordesc<fp8e4nv[128, 128],{layout!r}>"
    sig = dict(a_desc=desc, b_desc=desc, **dict.fromkeys(_POINTERS, "*fp32"))
    sig.update(gu_ptr="*bf16", dgu_ptr="*bf16", hw_ptr="*bf16", q_ptr="*u8", row_offsets_ptr="*i32",
               tile_offsets_ptr="*i32")
    sig.update(dict.fromkeys(("num_rows", "N", "num_experts", "stride_asm", "stride_bse", "stride_bsn", "stride_gm",
                              "stride_cm", "stride_xm", "stride_qm", "stride_qsm"), "i32"))
    const = dict(K=D, HAS_SCALE=True, HAS_DOT=True, E_POW2=128, STAGES=fp8_gluon_stages(torch.float32),
                 UNROLL=fp8_gluon_unroll(D), num_warps=4)
    # the launch's options: maxnreg 168 for 12 warps (the partitions then trade registers), fused multiply-adds
    return _compile(GluonASTSource, kernel, sig, const, dict(num_warps=4, maxnreg=168, enable_fp_fusion=True))


def _compile_pass():
    from triton.compiler import ASTSource

    from megamoe.kernels.fp8_swiglu import swiglu_bwd_rows_kernel as kernel

    sig = dict(acc_ptr="*fp32", n_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16", c_ptr="*bf16", aux_ptr="*bf16",
               dot_ptr="*fp32", q_ptr="*u8", qs_ptr="*fp32")
    sig.update(dict.fromkeys(("num_rows", "N", "stride_am", "stride_cm", "stride_gm", "stride_xm", "stride_qm",
                              "stride_qsm"), "i32"))
    const = dict(HAS_SCALE=True, HAS_DOT=True, HW_CAST=True, BLOCK_M=32)  # the launcher's, on a GPU
    return _compile(ASTSource, kernel, sig, const, dict(num_warps=4, num_stages=1, enable_fp_fusion=True))


def _row_dot_layouts(ttgir: str) -> set:
    """The layouts (resolved from their aliases) of the fp32 tiles summed along rows into the row-dot partials."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    sums = re.findall(r'%part\w* = "tt\.reduce"\(%\w+\) <\{axis = 1 : i32\}>.*?\}\) : \(tensor<\d+x\d+xf32, (#\w+)>',
                      ttgir, re.S)
    return {aliases[s] for s in sums}


@pytest.mark.parametrize("D, F", [(2048, 768), pytest.param(7168, 2048, marks=pytest.mark.slow)],
                         ids=["qwen3-30b-a3b", "deepseek-v3"])
def test_compiles_to_the_m_grouped_main_loop_and_a_store_epilogue(D, F):
    k = _compile_fused(D, F)
    ptx = k.asm["ptx"]
    unroll = fp8_gluon_unroll(D)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)) == {"m64n128k32.f32.e4m3.e4m3"}
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 2 * (unroll - 1) and waits.count("0") == 2, waits
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx)  # TMA loads
    assert not re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)  # no TMA store
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # dgu's 1x128 bytes by the hardware cast
    report = ptxas_report(ptx)
    assert "serialized" not in report, report  # ptxas C7512-C7515: wgmmas serialized
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= 32, report  # a few registers' worth at most (deepseek-v3's 7 K-chunks)
    assert k.metadata.shared <= HOPPER_SMEM, f"{k.metadata.shared} bytes of shared memory"


def test_row_dots_are_summed_in_the_pass_layout():
    fused, alone = _row_dot_layouts(_compile_fused(2048, 768).asm["ttgir"]), _row_dot_layouts(
        _compile_pass().asm["ttgir"])
    assert len(alone) == 1 and fused == alone, (fused, alone)


def _args(R=256, E=2, F=256, D=256):
    e4m3 = torch.float8_e4m3fn
    return (torch.zeros(R, D).to(e4m3), torch.ones(R, D // 128), torch.zeros(E, F, D).to(e4m3),
            torch.ones(E, F // 128, D // 128), torch.tensor([0, R // 2, R], dtype=torch.int32)[:E + 1],
            torch.zeros(R, 2 * F, dtype=torch.bfloat16))


@pytest.mark.parametrize("change, match", [
    (lambda a: a[:5] + (a[5][:, :256],), "gu_RG"),                      # F columns, not 2F
    (lambda a: a[:5] + (a[5][:-1],), "gu_RG"),                          # a row short
    (lambda a: a[:5] + (a[5].to(torch.int32),), "gu_RG"),
    (lambda a: a[:5] + (torch.zeros(512, 256, dtype=torch.bfloat16).t(),), "gu_RG"),  # rows not contiguous
    (lambda a: (a[0][:, :128],) + a[1:], "aq must be"),
    (lambda a: a[:4] + (a[4].long(),) + a[5:], "offsets_E1"),
])
def test_bad_arguments_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        fp8_dgrad_swiglu_gluon(*change(_args()))


def test_bad_row_scale_and_device():
    with pytest.raises(ValueError, match="row_scale_R"):
        fp8_dgrad_swiglu_gluon(*_args(), row_scale_R=torch.ones(255))
    with pytest.raises(ValueError, match="row_scale_R"):
        fp8_dgrad_swiglu_gluon(*_args(), row_scale_R=torch.ones(256, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="Hopper.*fp8_swiglu_bwd"):  # CPU tensors: no Gluon kernel
        fp8_dgrad_swiglu_gluon(*_args())
