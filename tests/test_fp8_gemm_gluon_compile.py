"""The warp-specialized Gluon FP8 m-grouped and k-grouped (weight-gradient) GEMMs compiled for sm_90a on the CPU
(no GPU needed; runs in CI), and their launchers' argument checks.

Proves, at the layer's "nt" shapes (qwen3-30b-a3b and deepseek-v3 gate/up, down projection, and on the K-major
weight copies the down projection's dgrad (fp32 out) and dx) with the launcher's ring depth and K-loop chunk: the
products are FP8 wgmma instructions (m64n128k32, e4m3 x e4m3 -> f32) and nothing else; every promotion (64 fused
multiply-adds per thread) runs between a ``wgmma.wait_group 1`` and the next wait, i.e. with the next K-block's
wgmma in flight, except the last of each chunk (``wait_group 0``); ptxas neither serializes the wgmmas nor spills;
shared memory within a Hopper block's 227 KiB; operands arrive by TMA and full output blocks leave by TMA stores.

The same for the k-grouped weight-gradient kernel (one kernel per output dtype, fp32 and bf16: M, N and the block
counts are run-time values) with the launcher's ring depth: 128 x 128 tiles of FP8 wgmmas only (m64n128k32); only
``wgmma.wait_group 0`` (no wgmma of the warpgroup in flight during a promotion), each followed by the promotion, one
fused multiply-add per element (``acc + p * (ps[:, None] * qs[None, :])``, 64 per thread); the block's scales
arrive by TMA with its operands (no global load between a wgmma and its wait); no serialization, no spills, shared
memory within 227 KiB, TMA loads and stores. Bits and speed are measured on the GPU
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
    fp8_wgrad_stages,
)

# (K, N) of the "nt" GEMMs: gate/up (K = D, N = 2F), down (K = F, N = D), the dgrad on the K-major w2 copy (K = D,
# N = F, fp32 out) and dx on the K-major w13 copy (K = 2F, N = D)
SHAPES = {"qwen3-gate_up": (2048, 1536), "qwen3-down": (768, 2048), "qwen3-dgrad": (2048, 768),
          "qwen3-dx": (1536, 2048), "deepseek-gate_up": (7168, 4096), "deepseek-down": (2048, 7168),
          "deepseek-dgrad": (7168, 2048), "deepseek-dx": (4096, 7168)}
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


_SLOW = pytest.mark.slow  # the same kernel at other K (more unrolled chunks) or an output dtype checked elsewhere
CASES = [("qwen3-gate_up", torch.bfloat16), ("qwen3-down", torch.bfloat16), ("qwen3-dgrad", torch.float32),
         ("qwen3-dx", torch.bfloat16), ("deepseek-down", torch.bfloat16), ("deepseek-dx", torch.bfloat16),
         pytest.param("deepseek-gate_up", torch.bfloat16, marks=_SLOW),
         pytest.param("deepseek-dgrad", torch.float32, marks=_SLOW),
         pytest.param("qwen3-down", torch.float32, marks=_SLOW)]  # fp32 output: a shallower ring


def _case_id(case):
    shape, out_dtype = case.values if hasattr(case, "values") else case
    return f"{shape}-{_OUT[out_dtype]}"


@pytest.mark.parametrize("shape, out_dtype", CASES, ids=[_case_id(c) for c in CASES])
def test_compiles_with_promotion_overlapping_the_next_wgmma(shape, out_dtype):
    K, N = SHAPES[shape]
    k = _compile(K, N, out_dtype)
    ptx = k.asm["ptx"]
    unroll = fp8_gluon_unroll(K)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)) == {"m64n128k32.f32.e4m3.e4m3"}
    assert "mma.sync" not in ptx
    # two MMA warpgroups, each with the first chunk of `unroll` K-blocks in its code and, when K has more, the
    # chunk of the loop over the others: a promotion after each wait 1 (the next K-block's wgmma issued before it)
    # and the chunk's last after the wait 0
    copies = 1 if K // 128 == unroll else 2
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 2 * copies * (unroll - 1) and waits.count("0") == 2 * copies, waits
    # each warpgroup's previous tile leaves (its TMA store issued) while the tile's first wgmma runs: between
    # that wgmma's commit and its wait
    issued = [seg.split("wgmma.wait_group")[0] for seg in re.split(r"wgmma\.commit_group\.sync\.aligned;", ptx)[1:]]
    assert sum("cp.async.bulk.tensor.2d.global.shared::cta" in seg for seg in issued) == 2
    for segment in re.split(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)[1:]:
        before_next_wait = segment.split("wgmma.wait_group")[0]
        assert len(re.findall(r"\bfma\.rn\.f32\b", before_next_wait)) == 64, "the promotion after a wait 1"
    # the promotion is one fused multiply-add per element (the Triton kernel's rounding), none other
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == 2 * 64 * unroll * copies
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx))
    assert loads >= 2 and loads % 2 == 0, loads  # A and B blocks of a step (the load loop may be unrolled)
    # a store per warpgroup in the loop, and its last tile's after the loop
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)) == 4
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


# ---------------------------------------------------------------------------------------------- k-grouped (wgrad)
_GL_OUT = {"bf16": "bfloat16", "fp32": "float32"}
WGRAD_BLOCK_N = 128  # the launcher's 128 x 128 tiles (fp8_k_grouped_mm_gluon)


def _compile_wgrad(out_dtype):
    """fp8_k_grouped_ws_kernel for sm_90a with the launcher's options (M, N and the block counts are run-time
    values: one kernel per output dtype)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from megamoe.kernels.fp8_gemm_gluon import fp8_k_grouped_ws_kernel as kernel

    out = _OUT[out_dtype]
    layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)  # P's and Q's blocks alike
    c_block = [64, WGRAD_BLOCK_N]
    c_layout = gl.NVMMASharedLayout.get_default_for(c_block, getattr(gl, _GL_OUT[out]))
    row = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # a block's row of 128 scales
    sig = dict(p_desc=f"tensordesc<fp8e4nv[128, 128],{layout!r}>",
               q_desc=f"tensordesc<fp8e4nv[{WGRAD_BLOCK_N}, 128],{layout!r}>",
               sp_desc=f"tensordesc<fp32[1, 128],{row!r}>", sq_desc=f"tensordesc<fp32[1, {WGRAD_BLOCK_N}],{row!r}>",
               row_offsets_ptr="*i32", block_offsets_ptr="*i32",
               c_desc=f"tensordesc<{out}[{c_block[0]}, {c_block[1]}],{c_layout!r}>", M="i32", N="i32",
               num_experts="i32")
    const = dict(BLOCK_M=128, BLOCK_N=WGRAD_BLOCK_N, STAGES=fp8_wgrad_stages(out_dtype), num_warps=4)
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(kernel.arg_names)
    divisible = ("row_offsets_ptr", "block_offsets_ptr", "M", "N")  # M and N are multiples of 128
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=168, enable_fp_fusion=True))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_compiles_to_fp8_wgmma_with_promotion_after_each_block(out_dtype):
    k = _compile_wgrad(out_dtype)
    ptx = k.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)) == {
        f"m64n{WGRAD_BLOCK_N}k32.f32.e4m3.e4m3"}
    assert "mma.sync" not in ptx
    # each warpgroup waits for its block's wgmma, then promotes it: one fused multiply-add per element of its
    # 64 x BLOCK_N accumulator (per_thread of them) after each wait, none with a wgmma of its own in flight
    per_thread = 64 * WGRAD_BLOCK_N // 128
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert set(waits) == {"0"} and len(waits) >= 2, waits  # one K loop per MMA warpgroup
    for segment in re.split(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)[1:]:
        before_next_wait = segment.split("wgmma.mma_async")[0]
        assert len(re.findall(r"\bfma\.rn\.f32\b", before_next_wait)) == per_thread, "the promotion after a wait"
    fmas = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    assert fmas == per_thread * len(waits), fmas
    # each element's scale product ps[m] * qs[n] is rounded before its fused multiply-add (the Triton kernel's
    # ``acc + p * (ps[:, None] * qs[None, :])``), so there is a multiply per fused multiply-add
    assert len(re.findall(r"\bmul(?:\.rn)?\.f32\b", ptx)) >= fmas
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx))
    assert loads >= 4 and loads % 4 == 0, loads  # the P and Q blocks of a step and their rows of scales
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)) >= 2  # TMA output stores
    # the promotion reads its scales from the ring (shared memory), never from global memory: the only global
    # loads are the tile coordinates (expert row offsets, block table), the next tile's issued while each MMA
    # warpgroup's first wgmma of a tile runs, and none while the later blocks' run
    between = [len(re.findall(r"ld\.global", seg.split("wgmma.wait_group")[0]))
               for seg in re.split(r"wgmma\.mma_async", ptx)[1:]]
    # (the expert's two row offsets: the block table's entry, unused by the MMA warpgroups, is not loaded)
    assert sorted(n for n in between if n) == [2, 2], between
    # the scales are read from the slot while the wgmma runs, and the slot is released (one thread's
    # mbarrier.arrive) only after a warpgroup barrier: every thread has read it before the load warp may refill it
    for segment in re.split(r"wgmma\.commit_group", ptx)[1:]:
        assert "ld.shared" in segment.split("wgmma.wait_group")[0], "scales not read between issue and wait"
    for segment in re.split(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)[1:]:
        assert re.search(r"\bbar\.sync\s+\d+, 128;", segment.split("mbarrier.arrive")[0]), "release before a barrier"
    assert len(re.findall(r"ld\.global", ptx)) <= 12, len(re.findall(r"ld\.global", ptx))
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = ptxas_report(ptx)
    assert "serialized" not in report, report  # ptxas C7512-C7515: wgmmas serialized
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
    assert k.metadata.shared <= HOPPER_SMEM, f"{k.metadata.shared} bytes of shared memory"


def _kargs(M=256, N=384, counts=(100, 0, 156), dev="cpu"):
    """Block-padded K-major operands as quantize_128x1_grouped(..., kmajor=True) lays them out (zeros):
    pq (128 NB, M) = buf.t() of a contiguous (M, 128 NB) buffer, ps (NB, M); qq, qs likewise; offsets and the
    128-row block table."""
    e4m3 = torch.float8_e4m3fn
    E, R = len(counts), sum(counts)
    nb = -(-R // 128) + E
    offsets = torch.tensor([0, *counts], device=dev).cumsum(0).to(torch.int32)
    blocks = torch.tensor([0, *[-(-c // 128) for c in counts]], device=dev).cumsum(0).to(torch.int32)
    return (torch.zeros(M, 128 * nb, device=dev).to(e4m3).t(), torch.ones(nb, M, device=dev),
            torch.zeros(N, 128 * nb, device=dev).to(e4m3).t(), torch.ones(nb, N, device=dev), offsets, blocks)


def _wgrad_call(a, **kw):
    from megamoe.ops.fp8_gemm_gluon import fp8_k_grouped_mm_gluon

    return fp8_k_grouped_mm_gluon(*a[:5], block_offsets_E1=a[5], **kw)


def _replace(a, i, t):
    return a[:i] + (t,) + a[i + 1:]


@pytest.mark.parametrize("change, match", [
    (lambda a: _replace(a, 0, a[0].float()), "pq"),                              # not e4m3
    (lambda a: _replace(a, 2, a[2].to(torch.float8_e5m2)), "qq"),
    (lambda a: _replace(a, 0, a[0].contiguous()), "pq"),                         # row-major, not K-major
    (lambda a: _replace(a, 2, a[2].contiguous()), "qq"),
    (lambda a: _replace(a, 1, a[1][:, :128].contiguous()), "ps"),                # (NB, 128) for M = 256
    (lambda a: _replace(a, 1, a[1][:-1].contiguous()), "ps"),                    # NB - 1 scale rows
    (lambda a: _replace(a, 3, a[3][:, :256].contiguous()), "qs"),
    (lambda a: _replace(a, 1, a[1].double()), "ps"),
    (lambda a: _replace(a, 2, torch.zeros(a[2].shape[1], a[2].shape[0] - 128).to(torch.float8_e4m3fn).t()),
     "qq"),  # K-major, fewer rows than pq
    (lambda a: _replace(a, 4, a[4].long()), "offsets_E1"),
    (lambda a: _replace(a, 5, a[5][:2]), "block_offsets_E1"),
    (lambda a: _kargs(M=200), "128"),                                            # M not a multiple of 128
    (lambda a: _kargs(N=320), "128"),
])
def test_wgrad_bad_arguments_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        _wgrad_call(change(_kargs()))


def test_wgrad_bad_out_dtype_and_device():
    with pytest.raises(TypeError, match="out_dtype"):
        _wgrad_call(_kargs(), out_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Hopper"):  # CPU tensors: no Gluon kernel
        _wgrad_call(_kargs())
    with pytest.raises(RuntimeError, match="Hopper"):
        _wgrad_call(_kargs(), out_dtype=torch.bfloat16)
