"""The rounds' weight-gradient kernels (megamoe.kernels.wgrad_rounds) compile for sm_90a on the CPU, with the
table's bf16 tiles (and the FP8 weight-gradient table's tile for the FP8 round kernel): the split experts'
partial sums and the whole experts' stores are both there, and the reduction uses wgmma. Their results are
tested in tests/test_wgrad_rounds_interpret.py and on the GPU."""

import re

import pytest

triton = pytest.importorskip("triton")


def _compile(kernel, sig: dict, const: dict, num_warps: int, num_stages: int = 1):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    assert set(sig) == set(kernel.arg_names), set(kernel.arg_names) ^ set(sig)
    return triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True))


def test_round_kernel_compiles_with_wgmma():
    import torch

    from megamoe.kernels.wgrad_rounds import k_grouped_round_kernel
    from megamoe.ops.tile_config import k_grouped_config

    cfg = k_grouped_config(4096, 7168, torch.bfloat16, interpret=False, allow_gluon=False, allow_torch=False)
    ints = ("M", "N", "L", "C", "round_idx", "S", "stride_pr", "stride_pm", "stride_qr", "stride_qn", "stride_ce",
            "stride_cm", "stride_se", "stride_sm")
    sig = {"p_ptr": "*bf16", "q_ptr": "*bf16", "roff_ptr": "*i32", "full_off_ptr": "*i32", "rstart_ptr": "*i32",
           "c_ptr": "*bf16",
           "s_ptr": "*fp32", **dict.fromkeys(ints, "i32")}
    const = dict(FP32_DOT=False, INTERPRET=False, EVEN_M=True, EVEN_N=True, L_PAD=32, BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    c = _compile(k_grouped_round_kernel, sig, const, cfg.num_warps, cfg.num_stages)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert re.search(r"st\.global[\.\w]*\.b16|st\.global\.v\d\.b32", ptx)  # bf16 stores (whole experts)
    assert "ld.global" in ptx and c.metadata.shared <= 227 * 1024


def test_fp8_round_kernel_compiles_with_fp8_wgmma():
    """The FP8 round kernel as the FP8 recipe launches it (the table's weight-gradient tile; K-major block-padded
    operands, so a row's stride is 1 and a launch specializes it; deepseek-v3's M, N): e4m3 wgmma, shared memory
    within a block's, no register spills."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megamoe.bench.kernel_inventory import ptxas_report
    from megamoe.kernels.wgrad_rounds import fp8_k_grouped_round_kernel
    from megamoe.ops.fp8_gemm import fp8_config

    cfg = fp8_config("wgrad", interpret=False)
    M, N, nb_rows = 4096, 7168, 128 * 1152  # a column's stride in the K-major copy: the padded rows
    ints = dict(M=M, N=N, L="", C="", round_idx="", S="", stride_pm=nb_rows, stride_psb=M, stride_qn=nb_rows,
                stride_qsb=N, stride_ce=M * N, stride_cm=N, stride_se=M * N, stride_sm=N)
    sig = {"pq_ptr": "*fp8e4nv", "ps_ptr": "*fp32", "qq_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "roff_ptr": "*i32",
           "boff_ptr": "*i32", "full_off_ptr": "*i32", "rstart_ptr": "*i32", "c_ptr": "*bf16", "s_ptr": "*fp32",
           **dict.fromkeys(ints, "i32")}
    const = dict(stride_pr=1, stride_qr=1, FP32_DOT=False, INTERPRET=False, EVEN_M=True, EVEN_N=True, L_PAD=32,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    names = list(fp8_k_grouped_round_kernel.arg_names)
    full = {n: sig.get(n, "constexpr") for n in names}
    assert set(full) == set(names) and set(sig) | set(const) == set(names)
    divisible = [n for n, t in sig.items() if t.startswith("*") or ints.get(n)]  # a launch's 16-divisible ints
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    c = triton.compile(ASTSource(fp8_k_grouped_round_kernel, full, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True))
    ptx = c.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx), "no FP8 wgmma"
    assert c.metadata.shared <= 227 * 1024
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(ptx))
    assert spill is None or int(spill.group(1)) == 0, spill.group(0)


def test_finalize_kernel_compiles():
    from megamoe.kernels.wgrad_rounds import split_finalize_kernel

    sig = {"s_ptr": "*fp32", "full_off_ptr": "*i32", "c_ptr": "*bf16", "MN": "i64", "L": "i32", "C": "i32"}
    c = _compile(split_finalize_kernel, sig, dict(L_PAD=32, BLOCK=4096), 4)
    assert "cvt.rn.bf16" in c.asm["ptx"]
