"""What the compiler makes of the m-grouped GEMMs, without a GPU: ``python -m megamoe.bench.kernel_inventory``.

For each m-grouped GEMM of the layer (gate/up + SwiGLU, down, dgrad + SwiGLU backward, dgrad dx) at a preset's
shapes and its tile config (the table, or ``MEGAMOE_TILES``), compiles ``_m_grouped_gemm_kernel`` for sm_90a
with Triton's bundled ptxas, on the CPU, and reports registers per thread, spill bytes, shared memory, the
wgmma instruction shape and how each operand reaches shared memory in the K loop (TMA, cp.async, or a
synchronous load through registers). The specialization is the one a launch at those shapes gets (Triton
specializes integer arguments equal to 1 as constants and marks multiples of 16, and 16-byte aligned
pointers, as divisible by 16); the argument list mirrors ``megamoe.ops.grouped_gemm._launch_m_grouped``
(tests/test_m_grouped_compile.py checks it names every kernel parameter).

Numbers from this report are compile-time facts, not speed: the time is measured on the GPU
(``python -m megamoe.bench``, docs/perf.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import get_preset
from ..ops.tile_config import GemmConfig, m_grouped_config

__all__ = ["GemmShape", "layer_gemms", "compile_m_grouped", "inventory_row", "main"]

HOPPER_SMEM = 227 * 1024  # bytes of shared memory a Hopper thread block can have
SM_SMEM = 228 * 1024      # per SM, of which 1 KiB is reserved per resident block (CUDA occupancy rules)
SM_REGS = 65536           # 32-bit registers per SM, allocated per warp in units of 256


@dataclass(frozen=True)
class GemmShape:
    """One m-grouped GEMM of the layer: ``kind``, N, K, rows R, experts E and the launch's operand facts."""

    kind: str
    N: int
    K: int
    R: int
    E: int
    gathered: bool  # A's rows gathered from the token matrix (gate/up, dgrad + SwiGLU at W = 1)


def layer_gemms(preset: str, tokens: int) -> list[GemmShape]:
    """The four routed-expert m-grouped GEMMs of one forward + backward at W = 1."""
    cfg = get_preset(preset)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    R = tokens * K
    return [GemmShape("gate_up", F, D, R, E, True), GemmShape("down", D, F, R, E, False),
            GemmShape("dgrad_swiglu", F, D, R, E, True), GemmShape("dgrad", D, 2 * F, R, E, False)]


def _int_arg(value: int):
    """(signature type, constant or None, divisible by 16) of an integer argument, as a launch specializes it."""
    if value == 1:
        return "constexpr", 1, False
    return "i32", None, value % 16 == 0


def _launch_args(g: GemmShape, cfg: GemmConfig) -> tuple[dict, dict, set]:
    """(signature, constants, names divisible by 16) of the launch ``_launch_m_grouped`` makes for ``g``."""
    # B's strides (stride_e, stride_n, stride_k) and the weight's shape, as the ops.grouped_gemm launchers pass them
    if g.kind == "gate_up":         # w13 [E, 2F, D] read (N = F, K = D), nt
        stride_b, shape_b = (2 * g.N * g.K, g.K, 1), (g.E, 2 * g.N, g.K)
    elif g.kind == "down":          # w2 [E, D, F] read (N = D, K = F), nt
        stride_b, shape_b = (g.N * g.K, g.K, 1), (g.E, g.N, g.K)
    elif g.kind == "dgrad_swiglu":  # w2 [E, D, F] read (K = D, N = F), nn
        stride_b, shape_b = (g.K * g.N, 1, g.N), (g.E, g.K, g.N)
    else:                           # dgrad dx: w13 [E, 2F, D] read (K = 2F, N = D), nn
        stride_b, shape_b = (g.K * g.N, 1, g.N), (g.E, g.K, g.N)
    # TMA_B and B_ROWS as ops.grouped_gemm._weight_descriptor chooses them (16-bit weights, aligned rows)
    if not cfg.tma_b:
        tma_b, b_rows = 0, 1
    elif stride_b[2] == 1:
        tma_b, b_rows = 1, shape_b[1]
    elif stride_b[1] == 1 and g.K % cfg.block_k == 0:
        tma_b, b_rows = 2, shape_b[1]
    else:
        tma_b, b_rows = 0, 1
    tma_a = cfg.tma_a and tma_b != 0 and not g.gathered
    c_cols = {"gate_up": g.N, "down": g.N, "dgrad_swiglu": 2 * g.N, "dgrad": g.N}[g.kind]
    ints = dict(num_rows=g.R, N=g.N, num_experts=g.E, stride_am=g.K, stride_ak=1, stride_be=stride_b[0],
                stride_bn=stride_b[1], stride_bk=stride_b[2], stride_cm=c_cols,
                stride_gm=2 * g.N if g.kind == "dgrad_swiglu" else 0,
                stride_xm={"gate_up": 2 * g.N, "dgrad_swiglu": g.N}.get(g.kind, 0))
    bn, bk = cfg.block_n, cfg.block_k
    b_block = [bn, bk] if tma_b == 1 else [bk, bn]
    sig = dict(a_ptr="*bf16", a_desc=f"tensordesc<bf16[{cfg.block_m}, {bk}]>" if tma_a else "*bf16",
               a_idx_ptr="*i32", b_ptr="*bf16",
               b_desc=f"tensordesc<bf16[{b_block[0]}, {b_block[1]}]>" if tma_b else "*bf16",
               row_offsets_ptr="*i32", tile_offsets_ptr="*i32", scale_ptr="*fp32", gu_ptr="*bf16", c_ptr="*bf16",
               aux_ptr="*bf16", dot_ptr="*fp32")
    divisible = {n for n, t in sig.items() if t.startswith("*")}
    const = {}
    for name, value in ints.items():
        ty, c, div = _int_arg(value)
        sig[name] = ty
        if c is not None:
            const[name] = c
        if div:
            divisible.add(name)
    epilogue = {"gate_up": 1, "down": 0, "dgrad_swiglu": 2, "dgrad": 0}[g.kind]
    const.update(K=g.K, EPILOGUE=epilogue, HAS_GATHER=g.gathered, HAS_SCALE=g.kind == "dgrad_swiglu",
                 SAVE_AUX=epilogue != 0, HAS_DOT=g.kind == "dgrad_swiglu", FP32_DOT=False,
                 EVEN_K=g.K % bk == 0, EVEN_N=g.N % bn == 0, E_POW2=1 << max(0, (g.E - 1).bit_length()),
                 TMA_A=tma_a, TMA_B=tma_b, B_ROWS=b_rows, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk,
                 DOT_N=min(bn, 128) if epilogue == 2 else bn)
    for name in const:
        sig[name] = "constexpr"
    return sig, const, divisible


def compile_m_grouped(g: GemmShape, cfg: GemmConfig):
    """The sm_90a compilation of the m-grouped kernel for ``g`` with ``cfg`` (CPU only; no launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels.grouped_gemm import _m_grouped_gemm_kernel as kernel

    sig, const, divisible = _launch_args(g, cfg)
    names = list(kernel.arg_names)
    if set(sig) != set(names):
        raise RuntimeError(f"kernel_inventory: the launch mirror is out of date: missing {set(names) - set(sig)}, "
                           f"extra {set(sig) - set(names)}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _ptxas(ptx: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(90)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run([getattr(tool, "path", tool), "-arch=sm_90a", "-v", str(path), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def _k_loop(ttgir: str) -> str:
    """The text of the kernel's K loop: the innermost ``scf.for`` that holds the warp-group dot."""
    dot = ttgir.find("ttng.warp_group_dot ")
    start = ttgir.rfind("scf.for", 0, dot)
    return ttgir[start:ttgir.find("scf.yield", dot)]


def inventory_row(g: GemmShape, cfg: GemmConfig) -> dict:
    """Compile ``g`` with ``cfg``; registers, spill bytes, shared bytes, the thread blocks of this kernel that
    fit on one SM at once (registers and shared memory; the config's programs_per_sm only helps up to it), the
    wgmma shape and the operand paths."""
    k = compile_m_grouped(g, cfg)
    report = _ptxas(k.asm["ptx"])
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    loop = _k_loop(k.asm["ttgir"])
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))
    n_regs = int(regs.group(1)) if regs else -1
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    blocks_per_sm = min(SM_REGS // (warp_regs * cfg.num_warps), SM_SMEM // (k.metadata.shared + 1024), 32)
    return dict(kind=g.kind, N=g.N, K=g.K, config=cfg, registers=n_regs, blocks_per_sm=blocks_per_sm,
                spill_bytes=int(spill.group(1)) if spill else -1, shared_bytes=k.metadata.shared, wgmma=wgmma,
                tma_loads=loop.count("ttng.async_tma_copy_global_to_local"),
                cp_async_loads=loop.count("ttg.async_copy_global_to_local"),
                sync_tile_loads=len(re.findall(r"= tt\.load [^\n]*: tensor<\d+x\d+x", loop)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe.bench.kernel_inventory", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", default=["qwen3-30b-a3b:16384", "deepseek-v3:4096"],
                    help="preset:tokens (default: qwen3-30b-a3b:16384 deepseek-v3:4096)")
    args = ap.parse_args(argv)
    import torch

    print(f"{'case':24s} {'kind':13s} {'config':34s} {'regs':>4s} {'spill B':>7s} {'smem KiB':>8s} "
          f"{'fit/SM':>6s} {'TMA':>3s} {'cp.async':>8s} {'sync':>4s}  wgmma")
    for case in args.cases:
        preset, _, tokens = case.partition(":")
        for g in layer_gemms(preset, int(tokens or 4096)):
            cfg = m_grouped_config(g.kind, g.N, g.K, torch.bfloat16, interpret=False)
            r = inventory_row(g, cfg)
            shown = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                     + (" tma_b" if cfg.tma_b else "") + (" tma_a" if cfg.tma_a else "")
                     + (f" {cfg.programs_per_sm}/SM" if cfg.programs_per_sm > 1 else ""))
            print(f"{case:24s} {g.kind:13s} {shown:34s} {r['registers']:4d} {r['spill_bytes']:7d} "
                  f"{r['shared_bytes'] / 1024:8.1f} {r['blocks_per_sm']:6d} {r['tma_loads']:3d} {r['cp_async_loads']:8d} "
                  f"{r['sync_tile_loads']:4d}  {','.join(r['wgmma'])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
