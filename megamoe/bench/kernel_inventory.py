"""What the compiler makes of the grouped GEMMs, without a GPU: ``python -m megamoe.bench.kernel_inventory``.

For each grouped GEMM of the layer at W = 1 (m-grouped: gate/up + SwiGLU, down, dgrad + SwiGLU backward,
dgrad dx; k-grouped: the dW13 and dW2 weight gradients) at a preset's shapes and its tile config (the table),
compiles the Triton kernel the launcher would pick (``m_grouped_gemm_kernel``, or with a RowPush / RowPull
``m_grouped_push_kernel`` / ``m_grouped_pull_kernel``;
``k_grouped_gemm_kernel`` or ``k_grouped_resident_kernel``) for sm_90a with Triton's bundled ptxas, on the
CPU, and reports registers per thread, spill bytes, shared memory, the blocks that fit per SM, the wgmma
instruction shape and how each operand reaches shared memory in the loop that holds the MMA (TMA, cp.async,
or a synchronous load through registers). Weight gradients the table sends to the persistent Gluon kernel
are reported for the Triton kernel of the same tiles, the launcher's fallback (the Gluon kernel has its own
compile test, tests/test_wgrad_gluon_compile.py); those it sends to ``torch._grouped_mm`` (bf16, more than
~154 rows per expert) for the Triton kernel that runs where torch's cannot (gathered rows),
marked "(torch)"; dgrad + SwiGLU then reads dY's rows ungathered, as the backward copies them for torch.
The specialization is the one a
launch at those shapes gets (Triton specializes integer arguments equal to 1 as constants and marks
multiples of 16, and 16-byte aligned pointers, as divisible by 16); the argument lists mirror
``megamoe.ops.grouped_gemm``'s launchers (a kernel parameter the mirror does not name is an error).

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

import torch

from ..config import get_preset
from ..ops.grouped_gemm import dot_cols, weight_descriptor
from ..ops.tile_config import GemmConfig, k_grouped_config, m_grouped_config

__all__ = ["GemmShape", "WgradShape", "torch_wgrad_in_layer", "layer_gemms", "layer_wgrads", "wgrad_config",
           "compile_m_grouped",
           "compile_k_grouped", "inventory_row", "ptxas_report", "main"]

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


def torch_wgrad_in_layer(preset: str, tokens: int) -> bool:
    """Whether the table sends the routed weight gradients at W = 1 to torch._grouped_mm (on a Hopper GPU,
    bf16), so that the backward copies dY's rows into row order and dgrad + SwiGLU reads them ungathered."""
    cfg = get_preset(preset)
    D, E = cfg.hidden_size, cfg.num_experts
    R = tokens * cfg.top_k
    return k_grouped_config(2 * cfg.moe_intermediate_size, D, torch.bfloat16, interpret=False,
                            rows_per_group=R / E).torch_mm


def layer_gemms(preset: str, tokens: int) -> list[GemmShape]:
    """The four routed-expert m-grouped GEMMs of one forward + backward at W = 1 on a Hopper GPU."""
    cfg = get_preset(preset)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    R = tokens * K
    dy_gathered = not torch_wgrad_in_layer(preset, tokens)
    return [GemmShape("gate_up", F, D, R, E, True), GemmShape("down", D, F, R, E, False),
            GemmShape("dgrad_swiglu", F, D, R, E, dy_gathered), GemmShape("dgrad", D, 2 * F, R, E, False)]


@dataclass(frozen=True)
class WgradShape:
    """One k-grouped weight gradient ``C[e] = P[rows_e]^T @ Q[rows_e]`` (E, M, N) over R rows, and which
    operand's rows are gathered from the token matrix; the launcher's rows-per-expert estimate is R / E."""

    kind: str
    M: int
    N: int
    R: int
    E: int
    p_gathered: bool
    q_gathered: bool


def layer_wgrads(preset: str, tokens: int) -> list[WgradShape]:
    """The two routed-expert weight gradients of one backward at W = 1 (dW13: dgu^T x, dW2: dY^T h*s)."""
    cfg = get_preset(preset)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    R = tokens * K
    return [WgradShape("dW13", 2 * F, D, R, E, False, True), WgradShape("dW2", D, F, R, E, True, False)]


def _int_arg(value: int):
    """(signature type, constant or None, divisible by 16) of an integer argument, as a launch specializes it."""
    if value == 1:
        return "constexpr", 1, False
    return "i32", None, value % 16 == 0


def _launch_args(g: GemmShape, cfg: GemmConfig, push: bool = False, pull: bool = False) -> tuple[dict, dict, set]:
    """(signature, constants, names divisible by 16) of the launch ``_launch_m_grouped`` makes for ``g``
    (``push``: with a RowPush, the EP path's down projection / dx GEMM storing into the owners' slots; ``pull``:
    with a RowPull, the EP path's first GEMM of round 0 beside the pull, GPU timer waits and the end-of-grid
    wait of a programmatic dependent launch)."""
    # B's strides (stride_e, stride_n, stride_k) and the weight's shape, as the ops.grouped_gemm launchers pass them
    if g.kind == "gate_up":         # w13 [E, 2F, D] read (N = F, K = D), nt
        stride_b, shape_b = (2 * g.N * g.K, g.K, 1), (g.E, 2 * g.N, g.K)
    elif g.kind == "down":          # w2 [E, D, F] read (N = D, K = F), nt
        stride_b, shape_b = (g.N * g.K, g.K, 1), (g.E, g.N, g.K)
    elif g.kind == "dgrad_swiglu":  # w2 [E, D, F] read (K = D, N = F), nn
        stride_b, shape_b = (g.K * g.N, 1, g.N), (g.E, g.K, g.N)
    else:                           # dgrad dx: w13 [E, 2F, D] read (K = 2F, N = D), nn
        stride_b, shape_b = (g.K * g.N, 1, g.N), (g.E, g.K, g.N)
    # TMA_B and B_ROWS from the launcher's own choice, on a bf16 weight of that shape (meta: aligned, no memory)
    weight = torch.empty(shape_b, dtype=torch.bfloat16, device="meta")
    tma_b, _, b_rows = weight_descriptor(cfg, weight, stride_b, g.K, False)
    tma_a = cfg.tma_a and tma_b != 0 and not g.gathered
    c_cols = {"gate_up": g.N, "down": g.N, "dgrad_swiglu": 2 * g.N, "dgrad": g.N}[g.kind]
    epilogue = {"gate_up": 1, "down": 0, "dgrad_swiglu": 2, "dgrad": 0}[g.kind]
    ints = dict(num_rows=g.R, N=g.N, num_experts=g.E, stride_am=g.K, stride_ak=1, stride_be=stride_b[0],
                stride_bn=stride_b[1], stride_bk=stride_b[2])
    bn, bk = cfg.block_n, cfg.block_k
    b_block = [bn, bk] if tma_b == 1 else [bk, bn]
    sig = dict(a_ptr="*bf16", a_desc=f"tensordesc<bf16[{cfg.block_m}, {bk}]>" if tma_a else "*bf16",
               b_ptr="*bf16", b_desc=f"tensordesc<bf16[{b_block[0]}, {b_block[1]}]>" if tma_b else "*bf16",
               row_offsets_ptr="*i32", tile_offsets_ptr="*i32", scale_ptr="*fp32", c_ptr="*bf16")
    const: dict = dict(K=g.K, HAS_SCALE=g.kind == "dgrad_swiglu", FP32_DOT=False, EVEN_K=g.K % bk == 0,
                       EVEN_N=g.N % bn == 0, E_POW2=1 << max(0, (g.E - 1).bit_length()), TMA_A=tma_a, TMA_B=tma_b,
                       B_ROWS=b_rows, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk)
    if not pull:  # the pull kernel reads its receive buffer's rows, never gathered
        sig["a_idx_ptr"] = "*i32"
        const["HAS_GATHER"] = g.gathered
    if push:  # ops.ep_tiles.push_launch: the row-table width, top-k; the plain epilogue into the slots
        sig.update(push_deltas_ptr="*i64", push_tab_ptr="*i32")
        ints.update(push_c=g.R, push_k=8)
    else:
        sig.update(gu_ptr="*bf16", aux_ptr="*bf16", dot_ptr="*fp32")
        ints.update(stride_cm=c_cols, stride_gm=2 * g.N if g.kind == "dgrad_swiglu" else 0,
                    stride_xm={"gate_up": 2 * g.N, "dgrad_swiglu": g.N}.get(g.kind, 0))
        const.update(EPILOGUE=epilogue, SAVE_AUX=epilogue != 0, HAS_DOT=g.kind == "dgrad_swiglu",
                     DOT_N=dot_cols(cfg) if epilogue == 2 else bn)
    if pull:  # ops.ep_tiles.pull_launch: a rank, a spin bound (the GPU's: 2**31 - 1), a timeout in ns
        sig.update(pull_ptr="*i32", pull_flags_ptr="*i32", pull_timeout_ns="i64")
        ints.update(pull_rank=3, pull_max_iters=2**31 - 1)
        const.update(PULL_BM=32, PULL_TIMER=True, PULL_GDC=True)
    divisible = {n for n, t in sig.items() if t.startswith("*")}
    _with_ints(sig, const, divisible, ints)
    for name in const:
        sig[name] = "constexpr"
    return sig, const, divisible


def _compile(kernel, sig: dict, const: dict, divisible: set, cfg: GemmConfig):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    if set(sig) != set(names):
        raise RuntimeError(f"kernel_inventory: the launch mirror of {kernel.__name__} is out of date: missing "
                           f"{set(names) - set(sig)}, extra {set(sig) - set(names)}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True))


def _with_ints(sig: dict, const: dict, divisible: set, ints: dict) -> None:
    for name, value in ints.items():
        ty, c, div = _int_arg(value)
        sig[name] = ty
        if c is not None:
            const[name] = c
        if div:
            divisible.add(name)


def compile_m_grouped(g: GemmShape, cfg: GemmConfig, push: bool = False, pull: bool = False):
    """The sm_90a compilation of the m-grouped kernel for ``g`` with ``cfg`` (CPU only; no launch); ``push``:
    the plain epilogue storing through a RowPush (the EP path's down projection and dx GEMM); ``pull``: waiting
    on a RowPull (the EP path's gate/up forward, dgrad + SwiGLU backward)."""
    from ..kernels.ep_tiles import m_grouped_pull_kernel, m_grouped_push_kernel
    from ..kernels.grouped_gemm import m_grouped_gemm_kernel

    kernel = m_grouped_push_kernel if push else m_grouped_pull_kernel if pull else m_grouped_gemm_kernel
    return _compile(kernel, *_launch_args(g, cfg, push, pull), cfg)


def wgrad_config(g: WgradShape) -> GemmConfig:
    """The Triton kernels' config the launcher uses for ``g`` (the table's; a Gluon choice falls back)."""
    return k_grouped_config(g.M, g.N, torch.bfloat16, interpret=False, rows_per_group=g.R / g.E, allow_gluon=False,
                            allow_torch=False)


def compile_k_grouped(g: WgradShape, cfg: GemmConfig):
    """The sm_90a compilation of the k-grouped kernel ``k_grouped_mm`` launches for ``g`` with ``cfg``: the
    resident kernel when cfg.resident_chunks, else the per-tile kernel (CPU only; no launch)."""
    from ..kernels.grouped_gemm import k_grouped_gemm_kernel, k_grouped_resident_kernel

    kernel = k_grouped_resident_kernel if cfg.resident_chunks else k_grouped_gemm_kernel
    sig = dict(p_ptr="*bf16", p_idx_ptr="*i32", q_ptr="*bf16", q_idx_ptr="*i32", row_offsets_ptr="*i32",
               c_ptr="*bf16")
    divisible = set(sig)
    const: dict = {}
    # P rows: (T or R, M) contiguous, Q rows: (T or R, N) contiguous, C: (E, M, N) contiguous
    _with_ints(sig, const, divisible, dict(M=g.M, N=g.N, stride_pr=g.M, stride_pm=1, stride_qr=g.N, stride_qn=1,
                                           stride_ce=g.M * g.N, stride_cm=g.N))
    const.update(P_GATHER=g.p_gathered, Q_GATHER=g.q_gathered, FP32_DOT=False, INTERPRET=False,
                 EVEN_M=g.M % cfg.block_m == 0, EVEN_N=g.N % cfg.block_n == 0, BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    if cfg.resident_chunks:
        const["CHUNKS"] = cfg.resident_chunks
    for name in const:
        sig[name] = "constexpr"
    return _compile(kernel, sig, const, divisible, cfg)


def ptxas_report(ptx: str) -> str:
    """ptxas's verbose report (registers, spills, warnings) of sm_90a PTX, assembled in a scratch folder."""
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


def _report(k, cfg: GemmConfig) -> dict:
    report = ptxas_report(k.asm["ptx"])
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    loop = _k_loop(k.asm["ttgir"])
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))
    n_regs = int(regs.group(1)) if regs else -1
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    blocks_per_sm = min(SM_REGS // (warp_regs * cfg.num_warps), SM_SMEM // (k.metadata.shared + 1024), 32)
    return dict(config=cfg, registers=n_regs, blocks_per_sm=blocks_per_sm,
                spill_bytes=int(spill.group(1)) if spill else -1, shared_bytes=k.metadata.shared, wgmma=wgmma,
                tma_loads=loop.count("ttng.async_tma_copy_global_to_local"),
                cp_async_loads=loop.count("ttg.async_copy_global_to_local"),
                sync_tile_loads=len(re.findall(r"= tt\.load [^\n]*: tensor<\d+x\d+x", loop)))


def inventory_row(g: GemmShape | WgradShape, cfg: GemmConfig, push: bool = False, pull: bool = False) -> dict:
    """Compile ``g`` with ``cfg``; registers, spill bytes, shared bytes, the thread blocks of this kernel that
    fit on one SM at once (registers and shared memory; the config's programs_per_sm only helps up to it), the
    wgmma shape and the operand paths. ``push``: the m-grouped plain epilogue with a RowPush; ``pull``: the
    m-grouped kernel waiting on a RowPull."""
    k = compile_k_grouped(g, cfg) if isinstance(g, WgradShape) else compile_m_grouped(g, cfg, push, pull)
    return dict(kind=g.kind, **_report(k, cfg))


def _shown(cfg: GemmConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            + (" tma_b" if cfg.tma_b else "") + (" tma_a" if cfg.tma_a else "")
            + (f" {cfg.programs_per_sm}/SM" if cfg.programs_per_sm > 1 else "")
            + (f" resident {cfg.resident_chunks}" if cfg.resident_chunks else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe.bench.kernel_inventory", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", default=["qwen3-30b-a3b:16384", "deepseek-v3:4096"],
                    help="preset:tokens (default: qwen3-30b-a3b:16384 deepseek-v3:4096)")
    args = ap.parse_args(argv)
    print(f"{'case':24s} {'kind':13s} {'config':34s} {'regs':>4s} {'spill B':>7s} {'smem KiB':>8s} "
          f"{'fit/SM':>6s} {'TMA':>3s} {'cp.async':>8s} {'sync':>4s}  wgmma")
    for case in args.cases:
        preset, _, tokens = case.partition(":")
        T = int(tokens or 4096)
        shapes = [(g, m_grouped_config(g.kind, g.N, g.K, torch.bfloat16, interpret=False, gathered=g.gathered))
                  for g in layer_gemms(preset, T)] + [(w, wgrad_config(w)) for w in layer_wgrads(preset, T)]
        torch_wgrad = torch_wgrad_in_layer(preset, T)
        for g, cfg in shapes:
            r = inventory_row(g, cfg)
            shown = _shown(cfg) + (" (torch)" if torch_wgrad and isinstance(g, WgradShape) else "")
            print(f"{case:24s} {g.kind:13s} {shown:34s} {r['registers']:4d} {r['spill_bytes']:7d} "
                  f"{r['shared_bytes'] / 1024:8.1f} {r['blocks_per_sm']:6d} {r['tma_loads']:3d} "
                  f"{r['cp_async_loads']:8d} "
                  f"{r['sync_tile_loads']:4d}  {','.join(r['wgmma'])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
