"""Tile configurations of the fused MoE GEMMs: a checked-in table, chosen by a pure function of shape.

Legend: D hidden size, F expert FFN size, G = 2F, E experts, N output columns, K reduction size.

Determinism: the only part of a config that can change bits is BLOCK_K (the K-loop order); it is fixed
by (GEMM kind, dtype, interpreter or not), never by the number of tokens, the routing, or timing (no
run-time autotuning). The rest (BLOCK_M, BLOCK_N, stages, load path, grid, and for the weight gradients
the kernel structure, Triton, Gluon or torch._grouped_mm) was verified on H200 not to change bits
(tests/test_fused_gpu.py::test_bits_do_not_depend_on_tile_shape), so the weight-gradient choice may also use a
host-known static estimate of rows per expert. The same token therefore gets the same bits whatever else is in
the batch, and every EP rank gets the same bits (docs/design.md, batch invariance).

Replacements (layer A/B runs, sweeps, tuning on other hardware, tests) come as an argument, never from
the environment: a :class:`megamoe.config.KernelConfig` passed down to the launchers and into the functions
here, whose ``tiles`` entries win over the table (a kind's entry at every shape of that kind, a (kind, a, b)
entry at one shape). :func:`parse_tiles` reads the benchmark's text form of them,
``kind:BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,field=value...]`` entries separated by ``;``, e.g.
``"dgrad_swiglu:128,256,64,8,3,tma_b=1"``; its BLOCK_K must be the table's (it fixes the K order, hence the
bits), so such text can change speed, never results.

Sources of the values: BLOCK_M 128 / BLOCK_K 64 / 8 warps / 3-4 stages are the usual Hopper wgmma
shapes of the Triton matmul tutorials (03, 09); the shape-specific entries record the measurement that
chose them (docs/perf.md).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..config import GemmConfig, KernelConfig

__all__ = ["GemmConfig", "KernelConfig", "m_grouped_config", "k_grouped_config", "ws_wgrad_config", "combine_block",
           "parse_tiles", "router_kernel_config", "router_wgrad_chunks", "DEFAULT_KERNELS"]

DEFAULT_KERNELS = KernelConfig()  # no overrides: the table below


# CPU interpreter (TRITON_INTERPRET=1): tiny tiles so that tiny test shapes still span several tiles.
_INTERPRET = GemmConfig(16, 16, 16, 4, 1)
# fp32 operands use input_precision="ieee" FMA dots (fp32 experts; the router of fp16 / fp32 x): small tiles.
_FP32 = GemmConfig(64, 64, 32, 4, 3)
# Plain fp32 GEMMs: the router's logits x @ W.T ("down" kind) and dx = dlogits @ W ("dgrad"), and its
# dW = dlogits^T @ x (one group of all T rows). scripts/bench_hf.py --profile on H200 (2026-12-03; BLOCK_K stays
# 32, the K order, and every tile gave the table's bits), ms: qwen3-30b-a3b T=16384 logits 0.416 vs 0.732, dx
# 0.230 vs 0.307, dW (E 128 x D 2048: 64 tiles of 64 x 64) 0.310 with 32 x 64 tiles vs 0.905; deepseek-v3
# T=4096 logits 0.988 vs 1.271, dx 0.376 vs 0.488, dW (E 256 x D 7168) 0.553 with 32 x 32 tiles vs 0.762.
_FP32_PLAIN = {"down": GemmConfig(64, 128, 32, 4, 3, programs_per_sm=2),
               "dgrad": GemmConfig(128, 64, 32, 8, 3, programs_per_sm=2)}
_FP32_WGRAD = GemmConfig(32, 32, 32, 2, 3)
_FP32_FEW_OUTPUTS = GemmConfig(32, 64, 32, 4, 3)
_FP32_FEW_TILES = 128  # fewer 64 x 64 output tiles than this per group: _FP32_FEW_OUTPUTS

# m-grouped kinds: "gate_up" (SwiGLU fwd, two accumulators, N = F, K = D), "down" (N = D, K = F),
# "dgrad_swiglu" (dY @ W2, N = F, K = D, SwiGLU backward epilogue), "dgrad" (dGU @ W13, N = D, K = 2F).
# TMA for the weights (and for A where rows are not gathered): scripts/gemm_sweep.py, three H200 runs of
# 2026-11-30, deepseek-v3 T=4096 / qwen3 T=16384, ms (docs/perf.md "TMA and tile shapes"):
#   gate_up  tma_b        5.55-5.73 vs 5.78-6.01        | 1.67-1.90 vs 1.75-1.93
#   down     tma_a+tma_b  3.03 vs 3.17 (3.02 vs 2.95 b) | 0.97 vs 0.91 (within run-to-run spread)
#   dgrad    128x256 tma  5.70 vs 6.18                  | 1.55 vs 1.73
#   dgrad_swiglu with tma_b: 1-4% slower alone (its epilogue, not the loads, limits it); see its entry.
_M_GROUPED_BF16 = {
    "gate_up": GemmConfig(128, 128, 64, 8, 3, tma_b=True),  # 2 x (128x128) accumulators, 48 KiB smem / stage
    # 128x256x64/3 stages beat 128x128x64/4 on H200 (2026-11-30): qwen3 1.00 vs 1.04 ms, deepseek-v3 2.88 vs 3.25 ms
    "down": GemmConfig(128, 256, 64, 8, 3, tma_b=True, tma_a=True),
    # dY's rows contiguous (the W=1 backward copies them into row order when the weight gradients go to
    # torch._grouped_mm; the EP path receives them so): TMA for A and B. Layer A/B on H200 (2026-12-01,
    # fwd+bwd ms, pointer loads vs this, qwen3-30b-a3b T=16384): 8.59 vs 8.51 and 7.94 vs 7.86 (two runs, 2 and 3
    # interleaved rounds). Gathered rows: _DGRAD_SWIGLU_GATHERED below.
    "dgrad_swiglu": GemmConfig(128, 128, 64, 8, 4, tma_b=True, tma_a=True),
    "dgrad": GemmConfig(128, 256, 64, 8, 3, tma_b=True, tma_a=True),
}
# dgrad + SwiGLU with dY's rows gathered (A by pointer loads): B by TMA was 1-4% slower alone and in
# the layer +0.41 and -0.04 ms on deepseek-v3 T=4096 in two A/Bs, so pointer loads stay.
_DGRAD_SWIGLU_GATHERED = GemmConfig(128, 128, 64, 8, 4)
_K_GROUPED_BF16 = GemmConfig(128, 128, 64, 8, 3)
# few rows per expert (weight gradients at W = 1, 2): P chunks kept on chip, see k_grouped_config. Stages
# matter most (H200 2026-11-30, deepseek-v3 T=4096, ~128 rows per expert, 3 chunks: dW13 6.36 ms
# with 3 stages vs 9.81 with 2 and 9.01 for the per-tile kernel; dW2 3.48 vs 5.01 vs 4.86). 3 chunks and 3
# stages fill the shared memory (224 KiB); at ~256 rows per expert (4 chunks, which only fit with 2 stages)
# the per-tile kernel was faster (12.4 vs 18.7 ms), so the resident kernel stops at 3 chunks.
_K_GROUPED_RESIDENT = GemmConfig(128, 128, 64, 8, 3)
_RESIDENT_MAX_CHUNKS = 3
_RESIDENT_STAGES = {1: 4, 2: 4, 3: 3}

_BOOL_FIELDS = ("tma_b", "tma_a", "gluon", "warp_specialized", "torch_mm")
_INT_FIELDS = ("programs_per_sm", "resident_chunks")


def parse_tiles(text: str) -> dict[str, GemmConfig]:
    """Tile text -> {kind: GemmConfig}, the ``tiles`` of a :class:`KernelConfig` (see the module docstring for
    the format; the benchmark's ``--tiles``).

    Raises ValueError naming the bad entry: an unknown kind or field, a malformed number, a BLOCK_K other
    than the table's for that kind, or a config GemmConfig itself rejects."""
    table = {**_M_GROUPED_BF16, "wgrad": _K_GROUPED_BF16}
    out: dict[str, GemmConfig] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        kind, sep, spec = entry.partition(":")
        kind = kind.strip()
        if not sep or kind not in table:
            raise ValueError(f"tiles: entry {entry!r} must be 'kind:BM,BN,BK,WARPS,STAGES[,field=value]' "
                             f"with kind one of {sorted(table)}")
        parts = [x.strip() for x in spec.split(",")]
        try:
            sizes = [int(x) for x in parts[:5]]
            if len(sizes) != 5:
                raise ValueError
            fields = {}
            for item in parts[5:]:
                name, _, value = item.partition("=")
                if name in _BOOL_FIELDS and value.lower() in ("0", "1", "true", "false"):
                    fields[name] = value.lower() in ("1", "true")
                elif name in _INT_FIELDS:
                    fields[name] = int(value)
                else:
                    raise ValueError
        except ValueError:
            raise ValueError(f"tiles: entry {entry!r}: expected five integers BM,BN,BK,WARPS,STAGES, then "
                             f"field=value with fields {_BOOL_FIELDS} (0/1) or {_INT_FIELDS} (integers)") from None
        cfg = GemmConfig(*sizes, **fields)
        if cfg.block_k != table[kind].block_k:
            raise ValueError(f"tiles: entry {entry!r}: BLOCK_K must stay {table[kind].block_k} for {kind} "
                             f"(it fixes the reduction order, so another value would change the bits)")
        if cfg.torch_mm and kind != "wgrad":
            raise ValueError(f"tiles: entry {entry!r}: torch_mm is a weight-gradient (wgrad) field")
        if kind in out:
            raise ValueError(f"tiles: {kind} is given twice")
        out[kind] = cfg
    return out


# per-tile weight-gradient kernel at shapes where it was measured (docs/perf.md): deepseek-v3 (D 7168, F 2048),
# ~128 rows per expert, so a program runs ~2 K-steps; 2 stages beat 3 (H200 2026-11-30, T=4096: dW13 9.03 vs
# 10.18 ms, dW2 4.97 vs 5.28 ms). Used when the rows per expert are too many for the resident kernel.
# qwen3-30b-a3b dW13 (2F 1536, D 2048), ~1024 rows per expert: 2 stages beat 3 in all four sweeps
# (1.94-2.03 vs 2.09-2.22 ms); its dW2 stays at 3 (1.13-1.23 vs 1.22-1.30 ms with 2).
_K_GROUPED_PER_TILE: dict[tuple[int, int], GemmConfig] = {
    (4096, 7168): GemmConfig(128, 128, 64, 8, 2),
    (7168, 2048): GemmConfig(128, 128, 64, 8, 2),
    (1536, 2048): GemmConfig(128, 128, 64, 8, 2),
}


# ~256 rows per expert (EP=2's deepseek-v3 at T=4096 per rank; W=1 at T=8192): the persistent Gluon kernel with
# every expert's P^T on chip (up to 5 chunks) beat the Triton per-tile kernel (H200 2026-12-01,
# gathered operands, deepseek-v3 T=8192: dW13 12.35 vs 13.41 ms, dW2 5.73 vs 7.04 ms; after a later tuning 11.51-11.86
# vs 12.90 and 5.57-5.64 vs 6.92), while at ~128 rows the Triton resident kernel (dW13 6.35-6.60 vs 8.79-8.94)
# and at ~1024 rows (qwen3) the Triton per-tile kernel (1.96-2.07 vs 2.27-2.59) stayed faster
# (docs/perf.md). Only measured at ~256 rows, where its streamed path (an
# expert over 5 chunks) was not faster than the Triton per-tile kernel, so the window ends where experts of up
# to 1.25x the estimate still fit on chip (5 x 64 = 320 rows); the launcher also falls back to the Triton
# kernels when there are fewer (expert, m-tile) units than SMs (ops.wgrad_gluon.operands_fit).
_K_GROUPED_GLUON = GemmConfig(128, 128, 64, 8, 5, resident_chunks=5, gluon=True)
_GLUON_MAX_ROWS = 256

# bf16 experts with more rows than the resident kernel's window: torch._grouped_mm (CUTLASS's SM90 grouped GEMM,
# cluster-shared operand tiles; bitwise the Triton kernels' result). Interleaved layer A/B on H200 (2026-12-01,
# fwd+bwd ms, Triton vs torch, W=1, the backward copying dY and x into row order for it):
# qwen3-30b-a3b T=4096 / 8192 / 16384 (256 / 512 / 1024 rows per expert) 2.96 vs 2.94, 4.76 vs 4.42, 8.59 vs
# 7.91; deepseek-v3 T=8192 / 16384 (256 / 512 rows) 48.73 vs 46.81, 88.91 vs 79.58; at ~128 rows (deepseek-v3
# T=4096, the resident kernel) 30.74 vs 31.58, so the resident window keeps the Triton kernel. It precedes the
# Gluon kernel's window (beaten at 256 rows on deepseek-v3, and at 192 rows: deepseek-v3 T=6144 39.41 vs 40.34
# ms with torch's kernel off; between ~155 and 192 rows not measured). The EP path's receive
# buffers are contiguous (no copies): its layer at W = 1 (provider megamoe-ep), deepseek-v3 M=8192 (256 rows
# per local expert) 52.01 -> 49.66 ms with torch's kernel forced, 52.59 -> 51.00 ms table vs
# torch's kernel off once adopted; mok-bench M=4096 (64 rows, resident window) 52.47 -> 54.87 when forced.
# k_grouped_config(..., allow_torch=False) gives the kernel that runs where torch's cannot; a
# KernelConfig "wgrad" entry replaces the choice (with torch_mm: torch's kernel wherever the operands allow).
_K_GROUPED_TORCH = GemmConfig(128, 128, 64, 8, 3, torch_mm=True)

# Contiguous rows (the EP receive buffers, and W = 1's rows after the copies) inside torch's window but at most
# ~384 per expert: megamoe's warp-specialized Gluon kernel (megamoe/kernels/wgrad_ws_gluon.py: ping-pong, P
# streamed, 5 ring slots, TMA-stored tiles) instead of torch._grouped_mm, the same bits from megamoe's own
# reduction order. An A/B of the weight-gradient kernels (scripts/ab_wgrad.py in git history), H200 2026-12-02,
# an EP=2 rank of deepseek-v3 at 4096 tokens (128 experts, ~256 rows): dW13 4.18 vs torch 4.35 ms, dW2 2.02 vs
# 2.29; at ~1024 rows (qwen3) level (1.35 / 0.712 vs 1.33 / 0.706), so the window ends at 384 (only ~256
# measured). Gathered rows, fp32 outputs and fewer (expert, m-tile) units than SMs (a shared expert's single
# group) keep torch's kernel.
_K_GROUPED_WS = GemmConfig(128, 128, 64, 8, 5, gluon=True, warp_specialized=True)
_WS_MAX_ROWS = 384


def ws_wgrad_config(rows_per_group: float | None) -> GemmConfig | None:
    """The warp-specialized config that replaces a ``torch_mm`` choice of :func:`k_grouped_config` for
    contiguous 16-bit rows at this rows-per-expert estimate, or None (a pure function; the launcher checks
    the operands and the device). It only replaces the table's own ``torch_mm`` choice, never an explicit
    "wgrad" entry of a :class:`KernelConfig`."""
    if rows_per_group is not None and 0 < rows_per_group <= _WS_MAX_ROWS:
        return _K_GROUPED_WS
    return None


def _is_half(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def m_grouped_config(kind: str, n: int, k: int, dtype: torch.dtype, *, interpret: bool,
                     gathered: bool = False, kernel_config: KernelConfig = DEFAULT_KERNELS) -> GemmConfig:
    """Config of an m-grouped GEMM of ``kind`` with N output columns and reduction size K (pure function);
    ``gathered``: A's rows are gathered from a token matrix (only dgrad + SwiGLU has its own entry for it);
    ``kernel_config``'s entry for (kind, N, K) or kind wins over the table (16-bit GEMMs on the GPU)."""
    if kind not in _M_GROUPED_BF16:
        raise ValueError(f"m_grouped_config: unknown kind {kind!r}; valid: {sorted(_M_GROUPED_BF16)}")
    if interpret:
        return _INTERPRET
    if not _is_half(dtype):
        return _FP32_PLAIN.get(kind, _FP32)
    if gathered and kind == "dgrad_swiglu":
        return kernel_config.tile(kind, n, k) or _DGRAD_SWIGLU_GATHERED
    return kernel_config.tile(kind, n, k) or _M_GROUPED_BF16[kind]


def _resident_chunks(rows_per_group: float | None, block_k: int) -> int:
    """Chunks of block_k rows kept on chip for ``rows_per_group`` expected rows (0: per-tile kernel).

    Sized for 1.25x the expected rows (uniform routing puts ~all experts under it); 0 when that needs
    more than _RESIDENT_MAX_CHUNKS chunks, where the per-tile kernel was measured faster."""
    if rows_per_group is None or rows_per_group <= 0:
        return 0
    chunks = -(-int(1.25 * rows_per_group) // block_k)
    return max(1, chunks) if chunks <= _RESIDENT_MAX_CHUNKS else 0


def k_grouped_config(m: int, n: int, dtype: torch.dtype, *, interpret: bool,
                     rows_per_group: float | None = None, allow_gluon: bool = True,
                     allow_torch: bool = True, kernel_config: KernelConfig = DEFAULT_KERNELS) -> GemmConfig:
    """Config of a k-grouped (weight-gradient) GEMM producing [E, M, N].

    A pure function of (M, N, dtype, rows_per_group), where rows_per_group is a host-known static
    estimate (buffer rows / groups; never read from the device). The estimate only picks the kernel
    structure and tile shape, which do not change bits (block_k, hence the reduction order, is fixed per
    dtype), so ranks or batches that estimate differently still agree bitwise. ``kernel_config``'s entry for
    ("wgrad", M, N), else its "wgrad" entry, wins (A/B runs, sweeps, tests); ``allow_gluon=False`` asks for the
    Triton kernels' entry (the launcher's fallback where the Gluon kernel cannot run; a Gluon entry is then
    skipped); likewise ``allow_torch=False`` for torch._grouped_mm (``torch_mm``), which a torch without
    ``torch._grouped_mm`` also turns off."""
    if interpret:
        chunks = _resident_chunks(rows_per_group, _INTERPRET.block_k)
        return dataclasses.replace(_INTERPRET, resident_chunks=chunks)
    if not _is_half(dtype):
        return _FP32_FEW_OUTPUTS if -(-m // 64) * -(-n // 64) < _FP32_FEW_TILES else _FP32_WGRAD
    allow_torch = allow_torch and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    override = kernel_config.tile("wgrad", m, n)
    if override is not None and (allow_gluon or not override.gluon) and (allow_torch or not override.torch_mm):
        return override
    chunks = _resident_chunks(rows_per_group, _K_GROUPED_RESIDENT.block_k)
    if chunks:
        return dataclasses.replace(_K_GROUPED_RESIDENT, resident_chunks=chunks, num_stages=_RESIDENT_STAGES[chunks])
    if allow_torch and rows_per_group is not None and rows_per_group > 0:
        return _K_GROUPED_TORCH
    if allow_gluon and rows_per_group is not None and 0 < rows_per_group <= _GLUON_MAX_ROWS:
        return _K_GROUPED_GLUON
    return _K_GROUPED_PER_TILE.get((m, n), _K_GROUPED_BF16)


# The router's 16-bit weight gradient dW = dlogits^T @ x (megamoe.autograd.router_wgrad): its [E, D] output has
# few 64 x 64 tiles (64 at qwen3-30b-a3b), each reducing all T rows (0.118 ms at T = 16384 on an H200 with one
# group, 64 programs on 132 SMs; cuBLAS's split-K 0.024). The T rows are cut into S fixed chunks, the per-tile
# kernel's groups, whose fp32 partials are summed in chunk order: S chunks give S times the programs. S is a pure
# function of (T, E, D), never of the GPU: the power of two that gives at least _ROUTER_WGRAD_PROGRAMS programs
# (two per SM of a 132-SM H100 / H200), at most _ROUTER_WGRAD_MAX_CHUNKS (S fp32 [E, D] partials are written
# and read again), and at least _ROUTER_WGRAD_MIN_ROWS rows per chunk (small T: one chunk, no partials).
# First guesses, not measured chunk by chunk.
_ROUTER_WGRAD_TILE = 64
_ROUTER_WGRAD_PROGRAMS = 264
_ROUTER_WGRAD_MAX_CHUNKS = 16
_ROUTER_WGRAD_MIN_ROWS = 1024


def router_wgrad_chunks(num_tokens: int, num_experts: int, hidden: int) -> int:
    """S, the fixed token chunks of the router's 16-bit weight gradient (see the note above): a power of two,
    1 for small T (fewer than 2 * 1024 rows) or many output tiles (deepseek-v3's E 256 x D 7168), 8 at
    qwen3-30b-a3b's E 128 x D 2048 from T = 8192 on. A pure function of (T, E, D): the same on every GPU."""
    tiles = -(-num_experts // _ROUTER_WGRAD_TILE) * -(-hidden // _ROUTER_WGRAD_TILE)
    if tiles <= 0:
        return 1
    chunks = 1
    while chunks * tiles < _ROUTER_WGRAD_PROGRAMS and chunks < _ROUTER_WGRAD_MAX_CHUNKS:
        chunks *= 2
    while chunks > 1 and num_tokens < chunks * _ROUTER_WGRAD_MIN_ROWS:
        chunks //= 2
    return chunks


@functools.lru_cache(maxsize=64)
def router_kernel_config(num_experts: int, hidden: int) -> KernelConfig:
    """Tiles of the router's 16-bit GEMMs (``MoEConfig.router_dtype="model"``): the logits ``x @ W.T`` ("down",
    N = E, K = D) and dx = dlogits @ W ("dgrad", N = D, K = E), one group of all T rows, and dW = dlogits^T @ x
    ("wgrad", an [E, D] output per token chunk, :func:`router_wgrad_chunks`). A pure function of (E, D), never of
    T: the weight gradient gets megamoe's per-tile Triton kernel (one program per output tile and chunk, the
    chunk's rows in order in BLOCK_K chunks), never the table's row-count-dependent choice of torch._grouped_mm
    or the Gluon kernels. BLOCK_K stays the table's 64 (the K order, hence the bits: every tile below gives the
    same bits).

    For E > 64 (BLOCK_N 128; measured at E = 128, ``scripts/bench_hf.py --profile``, Qwen3-MoE at qwen3-30b-a3b,
    T = 16384, H200):
    128 x 128 tiles, 8 warps, 4 stages, pointer loads for the logits and dx (0.104 and 0.103 ms against 0.151 and
    0.136 for TMA-loaded 3-stage tiles), 64 x 64 weight-gradient tiles (0.118 ms in one chunk of all T rows;
    64 x 128, 128 x 64 and 128 x 128 took 0.13-0.14; not yet measured with the token chunks). Smaller E
    (Mixtral's 8) keeps unmeasured first guesses: BLOCK_N fitted to E.

    The fp32 router of bf16 x (megamoe.autograd: bf16 GEMMs of exact bf16 pieces) takes this function's tiles at
    (3 E, D): its logits (N = 3 E; a bf16 weight: the tiles at (E, D)) and weight gradient ([3 E, D] per chunk);
    its dx (K = 6 E, or 3 E for a bf16 weight, which has the "dgrad" entry at 3 E >= 128) otherwise takes the
    table's "dgrad" tile. First guesses at those shapes, not measured there yet."""
    block_n = min(128, max(16, 1 << (max(num_experts, 1) - 1).bit_length()))
    wide = block_n >= 128
    logits = GemmConfig(128, 128, 64, 8, 4) if wide else GemmConfig(128, block_n, 64, 4, 3, tma_b=True, tma_a=True)
    tiles = {("down", num_experts, hidden): logits,
             ("wgrad", num_experts, hidden): GemmConfig(_ROUTER_WGRAD_TILE, _ROUTER_WGRAD_TILE, 64, 4, 3)}
    if wide:  # dx on the logits' tile; below 128 experts it keeps the table's entry
        tiles[("dgrad", hidden, num_experts)] = logits
    return KernelConfig(tiles)


def combine_block(d: int, *, interpret: bool) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D) of the combine / slot-sum kernels; a pure function of D."""
    if interpret:
        return 8, 32
    return 4, 1024 if d >= 1024 else 256
