"""The FP8 grouped GEMMs compiled for sm_90a on the CPU (no launch) at the layer's shapes and the FP8 table's tiles.

Proves, for gate/up + SwiGLU, down, dgrad + SwiGLU backward, dgrad dx (qwen3-30b-a3b and deepseek-v3 sizes) and the
weight gradient: the products are FP8 wgmma instructions (e4m3 x e4m3 -> f32, K = 32), each K-block a fresh dot
(no long FP8 accumulation); no register spills and shared memory within a block's 227 KiB; and where the operands
are K-major (forward weights, K-major dgrad weight copies, block-padded weight-gradient operands) every operand
tile of the K loop is copied asynchronously (none through a synchronous register load). Speed is measured on the
GPU (scripts/fp8_gemm_bench.py).
"""

import re

import pytest

from megamoe.bench.kernel_inventory import HOPPER_SMEM, ptxas_report
from megamoe.kernels.fp8_gemm import fp8_k_grouped_kernel, fp8_m_grouped_kernel
from megamoe.ops.fp8_gemm import Fp8GemmConfig, fp8_config

SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}  # (D, F)
KINDS = ("gate_up", "down", "dgrad_swiglu", "dgrad")


def _compile(kernel, sig, const, cfg):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    assert set(sig) | set(const) == set(names), set(names) ^ (set(sig) | set(const))
    full = {n: sig.get(n, "constexpr") for n in names}
    divisible = [n for n, t in sig.items() if t.startswith("*") or n.startswith(("stride", "ld_")) or n in ("N", "M")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(kernel, full, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True))


def _ints(sig, const, **values):
    for name, v in values.items():  # a launch specializes 1 to a constant
        if v == 1:
            const[name] = 1
        else:
            sig[name] = "i32"


def compile_m(kind, D, F, kmajor):
    """The launch ops.fp8_gemm makes for ``kind`` (E = 128, gathered A for gate/up and dgrad + SwiGLU), B as the
    forward's bytes, or for the dgrad kinds with kmajor a K-major copy of them."""
    cfg = fp8_config(kind, interpret=False)
    N, K, ep = {"gate_up": (F, D, 1), "down": (D, F, 0), "dgrad_swiglu": (F, D, 2), "dgrad": (D, 2 * F, 0)}[kind]
    rows_b = 2 * N if kind == "gate_up" else N
    if kind in ("gate_up", "down") or kmajor:  # element (n, k) at n * K + k
        b = dict(stride_be=rows_b * K, stride_bn=K, stride_bk=1, stride_bse=rows_b * K // 16384,
                 stride_bsn=K // 128, stride_bsk=1)
    else:
        b = dict(stride_be=N * K, stride_bn=1, stride_bk=N, stride_bse=N * K // 16384, stride_bsn=1,
                 stride_bsk=N // 128)
    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", a_idx_ptr="*i32", b_ptr="*fp8e4nv", bs_ptr="*fp32",
               row_offsets_ptr="*i32", tile_offsets_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16", c_ptr="*bf16",
               aux_ptr="*bf16", dot_ptr="*fp32", q_ptr="*u8", qs_ptr="*fp32")
    const = dict(K=K, EPILOGUE=ep, HAS_GATHER=kind in ("gate_up", "dgrad_swiglu"), HAS_SCALE=kind == "dgrad_swiglu",
                 SAVE_AUX=ep != 0, HAS_DOT=ep == 2, FP32_DOT=False, HW_CAST=True, EVEN_N=N % cfg.block_n == 0,
                 E_POW2=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    _ints(sig, const, num_rows=131072, N=N, num_experts=128, stride_am=K, stride_asm=K // 128,
          stride_cm={"dgrad_swiglu": 2 * N}.get(kind, N), stride_gm=2 * N, stride_xm=2 * N if ep == 1 else N,
          stride_qm=2 * N if ep == 2 else N, stride_qsm=(2 * N if ep == 2 else N) // 128, **b)
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


# The one table entry chosen with spills: the SwiGLU-backward epilogue of a 64 x 128 one-warpgroup tile spills ~300
# bytes, and that tile, two CTAs per SM, still measured fastest (qwen3-30b-a3b:16384, H200: 1.40 ms against 1.75 for
# the best tile without spills, scripts/fp8_gemm_bench.py --sweep). A larger spill means the epilogue changed.
SPILL_BYTES_MEASURED = {"dgrad_swiglu": 512}

CASES = [(p, kind, km) for p in SHAPES for kind in KINDS for km in ((False, True) if kind.startswith("dgrad") else
                                                                   (False,))]


@pytest.mark.parametrize("preset, kind, kmajor", CASES, ids=[f"{p}-{k}{'-kmajor' if m else ''}" for p, k, m in CASES])
def test_m_grouped_table_configs_compile(preset, kind, kmajor):
    k, cfg = compile_m(kind, *SHAPES[preset], kmajor)
    r = report(k)
    assert r["wgmma"] == ["k32.f32.e4m3.e4m3"] and not r["other_mma"], r
    assert r["fresh_dots"] >= 1, f"each K-block's dot must start from zero (promotion every 128 of K): {r}"
    assert r["spill"] <= SPILL_BYTES_MEASURED.get(kind, 0) and r["shared"] <= HOPPER_SMEM, r
    if kind in ("gate_up", "down") or kmajor:  # K-major weights: no operand tile through registers
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
    """The SwiGLU-backward pass on the dgrad's fp32 accumulator (the split dgrad of the experiment): no spills, and
    its e4m3 byte tiles stored from the layout they are cast in (tests/test_fp8_quant_compile.py says why)."""
    from megamoe.kernels.fp8_gemm import swiglu_bwd_rows_kernel

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
    """The SwiGLU pass on a plain gate/up GEMM's [g | u] (the split gate/up of the experiment): no spills, its e4m3
    byte tiles stored from the layout they are cast in."""
    from megamoe.kernels.fp8_gemm import swiglu_rows_kernel

    sig = dict(gu_ptr="*bf16", n_ptr="*i32", q_ptr="*u8", qs_ptr="*fp32", num_rows="i32")
    const = dict(HW_CAST=True, BLOCK_M=32)
    _ints(sig, const, N=width, stride_gm=2 * width, stride_qm=width, stride_qsm=width // 128)
    k = _compile(swiglu_rows_kernel, sig, const, Fp8GemmConfig(32, 128, 4, 1))
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
    assert spill is None or int(spill.group(1)) == 0, spill.group(0)
    assert not re.search(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xi8, #[^>]*> -> ", k.asm["ttgir"])


def _row_dot_layouts(ttgir: str) -> set[str]:
    """The layouts (their definitions) of the (rows, 64) fp32 tiles a kernel sums along rows (the row dots: reduced
    along dim 1), with the warps' count along the rows left out (it does not change a row's sum; warps split along
    the columns would)."""
    reduce = r"\}\) : \(tensor<\d+x64xf32, (#\w+)>\) -> tensor<\d+xf32, #ttg\.slice<\{dim = 1, parent = \1\}>"
    names = re.findall(reduce, ttgir)
    defs = (re.search(rf"^{n} = (.*)$", ttgir, re.M).group(1) for n in names)
    return {re.sub(r"warpsPerCTA = \[\d+, 1\]", "warpsPerCTA = [., 1]", d) for d in defs}


@pytest.mark.parametrize("width", [768, 2048])
def test_swiglu_backward_128x1_pass_compiles_without_spills(width):
    """The SwiGLU-backward pass that also makes dgu's and hw's 128x1 K-major blocks (the experiment's SPLIT_128X1):
    no spills, its e4m3 byte tiles stored from the layout they are cast in (the K-major bytes move as int32 words),
    and its row dots summed in the row pass's per-row tile layout (the same association of each row's sum on the
    GPU, hence the same bits)."""
    from megamoe.kernels.fp8_gemm import swiglu_bwd_rows_kernel
    from megamoe.kernels.fp8_swiglu_bwd import swiglu_bwd_128x1_kernel

    sig = dict(acc_ptr="*fp32", offsets_ptr="*i32", block_offsets_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16",
               dot_ptr="*fp32", q_ptr="*u8", qs_ptr="*fp32", dgk_ptr="*i32", dgks_ptr="*fp32", hk_ptr="*i32",
               hks_ptr="*fp32", num_experts="i32")
    const = dict(HAS_SCALE=True, HAS_DOT=True, HW_CAST=True, E_POW2=128)
    _ints(sig, const, N=width, ld_k=128 * 1152, stride_am=width, stride_gm=2 * width, stride_qm=2 * width,
          stride_qsm=2 * width // 128)
    k = _compile(swiglu_bwd_128x1_kernel, sig, const, Fp8GemmConfig(64, 128, 8, 1))
    spill = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
    assert spill is None or int(spill.group(1)) == 0, spill.group(0)
    assert not re.search(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xi8, #[^>]*> -> ", k.asm["ttgir"])
    sig = dict(acc_ptr="*fp32", n_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16", c_ptr="*bf16", aux_ptr="*bf16",
               dot_ptr="*fp32", q_ptr="*u8", qs_ptr="*fp32", num_rows="i32")
    const = dict(HAS_SCALE=True, HAS_DOT=True, HW_CAST=True, BLOCK_M=32)
    _ints(sig, const, N=width, stride_am=width, stride_cm=2 * width, stride_gm=2 * width, stride_xm=width,
          stride_qm=2 * width, stride_qsm=2 * width // 128)
    rows = _compile(swiglu_bwd_rows_kernel, sig, const, Fp8GemmConfig(32, 128, 4, 1))
    layouts = _row_dot_layouts(k.asm["ttgir"])
    assert len(layouts) == 1 and layouts == _row_dot_layouts(rows.asm["ttgir"]), (layouts, rows.asm["ttgir"][:600])
