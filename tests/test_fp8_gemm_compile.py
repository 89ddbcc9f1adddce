"""The FP8 grouped GEMMs compiled for sm_90a on the CPU (no launch) at the layer's shapes and the FP8 table's tiles.

Proves, for gate/up, down, the down dgrad (fp32 out), dx (qwen3-30b-a3b and deepseek-v3 sizes) and the weight
gradient: the products are FP8 wgmma instructions (e4m3 x e4m3 -> f32, K = 32), each K-block a fresh dot
(no long FP8 accumulation); no register spills and shared memory within a block's 227 KiB; and where the operands
are K-major (forward weights, K-major dgrad weight copies, block-padded weight-gradient operands) every operand
tile of the K loop is copied asynchronously (none through a synchronous register load); the SwiGLU passes
compile without spills. Speed is measured on the GPU (scripts/fp8_gluon_bench.py: these Triton kernels beside their
Gluon twins).
"""

import re

import pytest

from megamoe.bench.kernel_inventory import HOPPER_SMEM, ptxas_report
from megamoe.kernels.fp8_gemm import fp8_k_grouped_kernel, fp8_m_grouped_kernel
from megamoe.ops.fp8_gemm import Fp8GemmConfig, fp8_config

SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}  # (D, F)
GEMMS = ("gate_up", "down", "dgrad", "dx")


def _compile(kernel, sig, const, cfg):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    assert set(sig) | set(const) == set(names), set(names) ^ (set(sig) | set(const))
    full = {n: sig.get(n, "constexpr") for n in names}
    divisible = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride") or n in ("N", "M")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(kernel, full, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True))


def _ints(sig, const, **values):
    for name, v in values.items():  # a launch specializes 1 to a constant
        if v == 1:
            const[name] = 1
        else:
            sig[name] = "i32"


def compile_m(gemm, D, F, kmajor):
    """The launch ops.fp8_gemm makes for ``gemm`` (E = 128), B as the forward's bytes, or for the "nn" GEMMs (dgrad,
    dx) with kmajor a K-major copy of them."""
    N, K, nt = {"gate_up": (2 * F, D, True), "down": (D, F, True), "dgrad": (F, D, False),
                "dx": (D, 2 * F, False)}[gemm]
    cfg = fp8_config("nt" if nt else "nn", interpret=False)
    if nt or kmajor:  # element (n, k) at n * K + k
        b = dict(stride_be=N * K, stride_bn=K, stride_bk=1, stride_bse=N * K // 16384, stride_bsn=K // 128,
                 stride_bsk=1)
    else:
        b = dict(stride_be=N * K, stride_bn=1, stride_bk=N, stride_bse=N * K // 16384, stride_bsn=1,
                 stride_bsk=N // 128)
    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", row_offsets_ptr="*i32",
               tile_offsets_ptr="*i32", c_ptr="*fp32" if gemm == "dgrad" else "*bf16")
    const = dict(K=K, FP32_DOT=False, EVEN_N=N % cfg.block_n == 0, E_POW2=128, BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n)
    _ints(sig, const, num_rows=131072, N=N, num_experts=128, stride_am=K, stride_asm=K // 128, stride_cm=N, **b)
    return _compile(fp8_m_grouped_kernel, sig, const, cfg), cfg


def compile_w(M, N, padded):
    cfg = fp8_config("wgrad", interpret=False)
    sig = dict(p_ptr="*fp8e4nv", ps_ptr="*fp32", q_ptr="*fp8e4nv", qs_ptr="*fp32", row_offsets_ptr="*i32",
               block_offsets_ptr="*i32", c_ptr="*bf16")
    const = dict(FP32_DOT=False, INTERPRET=False, PADDED=padded, EVEN_M=M % cfg.block_m == 0,
                 EVEN_N=N % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    nb_rows = 128 * 1152  # block-padded, transposed (rows contiguous): a column's stride is the buffer's rows
    strides = dict(stride_pr=1, stride_pm=nb_rows, stride_qr=1, stride_qn=nb_rows) if padded else dict(
        stride_pr=M, stride_pm=1, stride_qr=N, stride_qn=1)
    _ints(sig, const, M=M, N=N, stride_psb=M, stride_qsb=N, stride_ce=M * N, stride_cm=N, **strides)
    return _compile(fp8_k_grouped_kernel, sig, const, cfg), cfg


def report(k):
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(ptx))
    dot = ttgir.find("ttng.warp_group_dot ")
    loop = ttgir[ttgir.rfind("scf.for", 0, dot):ttgir.find("scf.yield", dot)]
    return dict(wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+(k\d+\.f32\.e4m3\.e4m3)", ptx))),
                other_mma=re.findall(r"\bmma\.sync\.aligned\.\S+", ptx), spill=int(spill.group(1)) if spill else 0,
                shared=k.metadata.shared, async_loads=loop.count("ttg.async_copy_global_to_local"),
                sync_tile_loads=len(re.findall(r"= tt\.load [^\n]*: tensor<\d+x\d+x![^\n]*f8E4M3FN", loop)),
                fresh_dots=len(re.findall(r"ttng\.warp_group_dot [^\n]*%cst", loop)))


CASES = [(p, gemm, km) for p in SHAPES for gemm in GEMMS for km in ((False, True) if gemm in ("dgrad", "dx") else
                                                                   (False,))]


@pytest.mark.parametrize("preset, gemm, kmajor", CASES, ids=[f"{p}-{g}{'-kmajor' if m else ''}" for p, g, m in CASES])
def test_m_grouped_table_configs_compile(preset, gemm, kmajor):
    k, cfg = compile_m(gemm, *SHAPES[preset], kmajor)
    r = report(k)
    assert r["wgmma"] == ["k32.f32.e4m3.e4m3"] and not r["other_mma"], r
    assert r["fresh_dots"] >= 1, f"each K-block's dot must start from zero (promotion every 128 of K): {r}"
    assert r["spill"] == 0 and r["shared"] <= HOPPER_SMEM, r
    if gemm in ("gate_up", "down") or kmajor:  # K-major weights: no operand tile through registers
        assert r["sync_tile_loads"] == 0 and r["async_loads"] >= 2, r


@pytest.mark.parametrize("padded", [False, True], ids=["row-order", "padded-kmajor"])
def test_weight_gradient_compiles(padded):
    k, cfg = compile_w(1536, 2048, padded)
    r = report(k)
    assert r["wgmma"] == ["k32.f32.e4m3.e4m3"] and not r["other_mma"] and r["spill"] == 0, r
    if padded:
        assert r["sync_tile_loads"] == 0 and r["async_loads"] >= 2, r
        # column offsets (column index x the buffer's rows) in int64: at deepseek-v3's D = 7168 an int32 product
        # overflows from ~2.4e5 buffer rows (~33k tokens on one GPU, fewer per rank under EP)
        ttir = k.asm["ttir"]
        assert not re.search(r"arith\.muli %\S+, %\S+ : tensor<1x\d+xi32>", ttir), "int32 column offsets"
        assert re.search(r"arith\.muli %\S+, %\S+ : tensor<\d+xi64>", ttir), "no int64 column offsets found"


@pytest.mark.parametrize("width", [768, 2048])
def test_swiglu_backward_pass_compiles_without_spills(width):
    """The SwiGLU-backward pass on the dgrad's fp32 accumulator (the FP8 layer's dgrad): no spills, and
    its e4m3 byte tiles stored from the layout they are cast in (tests/test_fp8_quant_compile.py says why)."""
    from megamoe.kernels.fp8_swiglu import swiglu_bwd_rows_kernel

    sig = dict(acc_ptr="*fp32", n_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16", c_ptr="*bf16", aux_ptr="*bf16",
               dot_ptr="*fp32", q_ptr="*u8", qs_ptr="*fp32", num_rows="i32")
    const = dict(HAS_SCALE=True, HAS_DOT=True, HW_CAST=True, BLOCK_M=32)
    _ints(sig, const, N=width, stride_am=width, stride_cm=2 * width, stride_gm=2 * width, stride_xm=width,
          stride_qm=2 * width, stride_qsm=2 * width // 128)
    k = _compile(swiglu_bwd_rows_kernel, sig, const, Fp8GemmConfig(32, 128, 4, 1))
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
    assert spill is None or int(spill.group(1)) == 0, spill.group(0)
    assert not re.search(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xi8, #[^>]*> -> ", k.asm["ttgir"])


@pytest.mark.parametrize("width", [768, 2048])
def test_swiglu_pass_compiles_without_spills(width):
    """The SwiGLU pass on a plain gate/up GEMM's [g | u] (the FP8 layer's gate/up): no spills, its e4m3
    byte tiles stored from the layout they are cast in."""
    from megamoe.kernels.fp8_swiglu import swiglu_rows_kernel

    sig = dict(gu_ptr="*bf16", n_ptr="*i32", q_ptr="*u8", qs_ptr="*fp32", num_rows="i32")
    const = dict(HW_CAST=True, BLOCK_M=32)
    _ints(sig, const, N=width, stride_gm=2 * width, stride_qm=width, stride_qsm=width // 128)
    k = _compile(swiglu_rows_kernel, sig, const, Fp8GemmConfig(32, 128, 4, 1))
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
    assert spill is None or int(spill.group(1)) == 0, spill.group(0)
    assert not re.search(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xi8, #[^>]*> -> ", k.asm["ttgir"])
