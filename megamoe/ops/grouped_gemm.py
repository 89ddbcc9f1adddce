"""Host launchers of the grouped GEMMs (validate, allocate, pick config and grid, launch; no autograd).

Legend: R rows of an expert-grouped row buffer (static upper bound; expert e owns rows
``offsets_E1[e]:offsets_E1[e+1]``, rows past ``offsets_E1[E]`` are neither read for work nor written),
T rows of a token matrix that rows are gathered from, E experts (groups), D hidden size, F expert FFN
size, G = 2F ([gate | up]), M / N / K generic GEMM sizes, P = ceil(F / min(BLOCK_N, 128)) row-dot
partials.

GEMM grammar (DeepGEMM style): "m-grouped" = rows grouped by expert, one weight matrix per group
(forward and dgrad); "k-grouped" = the reduction runs over each group's rows (weight gradients).
"nt": ``C = A @ B[e].T`` with B[e] stored [N, K] (nn.Linear layout); "nn": ``C = A @ B[e]`` with B[e]
stored [K, N].

For the EP engineer: every launcher works on any expert-grouped buffer (for example rows received from peers) given
device offsets; rows may be gathered from a token matrix through ``gather_idx_R`` (int32, one token index per row)
instead of being copied first; the plain-epilogue GEMMs store rows through a
:class:`~megamoe.ops.ep_tiles.RowPush`, and the first GEMM of a round can run beside its pull
(:class:`~megamoe.ops.ep_tiles.RowPull`). Nothing here reads device values on the host: no sync, CUDA-graph
capturable. Determinism: no float atomics (with a :class:`RowPull` an int32 tile counter decides which program
computes a tile, never what it computes); tile configs are a pure function of (kind, N, K, dtype)
(megamoe.ops.tile_config), so results are bitwise reproducible and each row's result is independent of the other
rows (batch invariance).
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels.grouped_gemm import k_grouped_gemm_kernel, k_grouped_resident_kernel, m_grouped_gemm_kernel
from . import tile_config
from ._common import check_device, is_interpreted, persistent_programs, pow2, sm_count
from .ep_tiles import RowPull, RowPush, pull_launch, push_launch, row_push_deltas
from .routing import cached_tile_offsets
from .tile_config import DEFAULT_KERNELS, KernelConfig, k_grouped_config, m_grouped_config
from .torch_grouped_mm import torch_wgrad, torch_wgrad_device, torch_wgrad_eligible, wgrad_shape_fits
from .wgrad_gluon import (
    GLUON_AVAILABLE,
    gluon_device_ok,
    gluon_wgrad_eligible,
    launch_gluon_wgrad,
    launch_gluon_wgrad_ws,
    ws_operands_fit,
)

__all__ = ["gate_up_swiglu", "down_proj", "grouped_mm_nt", "grouped_mm_nn", "swiglu_dgrad", "k_grouped_mm", "RowPush",
           "RowPull", "row_push_deltas"]

_PLAIN, _SWIGLU, _SWIGLU_BWD = 0, 1, 2
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _check_2d(name: str, t: torch.Tensor, where: str, cols: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{where}: {name} must have {cols} columns, got shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"{where}: {name} dtype {t.dtype} not supported (bf16, fp16, fp32)")
    if t.shape[0] and t.stride(1) != 1:
        raise ValueError(f"{where}: {name} must have a contiguous last dimension, strides {t.stride()}")


def _check_weight(name: str, w: torch.Tensor, where: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{where}: {name} must be a 3-D tensor [E, ., .], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dtype not in _SUPPORTED:
        raise TypeError(f"{where}: {name} dtype {w.dtype} not supported (bf16, fp16, fp32)")
    if not w.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous")


def _check_index(name: str, idx: torch.Tensor | None, where: str) -> None:
    if idx is not None and (idx.dim() != 1 or idx.dtype != torch.int32):
        raise TypeError(f"{where}: {name} must be a 1-D int32 tensor, got {idx.dtype} {tuple(idx.shape)}")


def _check_offsets(offsets_E1: torch.Tensor, num_groups: int, where: str) -> None:
    if offsets_E1.dtype != torch.int32 or offsets_E1.shape != (num_groups + 1,):
        raise ValueError(f"{where}: offsets_E1 must be int32 of shape ({num_groups + 1},), got "
                         f"{offsets_E1.dtype} {tuple(offsets_E1.shape)}")


def _alloc(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device, name: str, where: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"{where}: {name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _launch_m_grouped(*, where, kind, epilogue, a, a_idx, b, stride_b, num_rows, N, K, offsets_E1, c, aux=None,
                      dot=None, scale=None, gu=None, tile_offsets_E1=None, push: RowPush | None = None,
                      tile_cache: dict | None = None, pull: RowPull | None = None,
                      kernel_config: KernelConfig = DEFAULT_KERNELS):
    """Launch the persistent m-grouped kernel. stride_b = (stride_e, stride_n, stride_k) of B, in elements.
    push (plain epilogue only): store rows through ``push`` (c is then its dest). tile_cache: see
    :func:`gate_up_swiglu`. pull: A's rows (and row scales) still arriving (:class:`RowPull`; rows not
    gathered): its pull is launched here, then this GEMM beside it. kernel_config: tile overrides.
    The kernel: ``m_grouped_gemm_kernel``, or with push / pull its expert-parallel form (ops.ep_tiles)."""
    E = b.shape[0]
    kernel, ep_args = _m_grouped_kernel(where, epilogue, a_idx, push, pull)
    interpret = is_interpreted(kernel)
    cfg = m_grouped_config(kind, N, K, b.dtype, interpret=interpret, gathered=a_idx is not None,
                           kernel_config=kernel_config)
    if pull is not None:
        pull.check(where, num_rows, c.device)
    if num_rows == 0 or N == 0:
        if pull is not None:
            pull.launch()
        return cfg
    if tile_offsets_E1 is None:
        tile_offsets_E1 = cached_tile_offsets(offsets_E1, cfg.block_m, tile_cache)
    if pull is not None:
        pull.launch()  # the GEMM below must be the next kernel on the stream (programmatic dependent launch)
    bound = (triton.cdiv(num_rows, cfg.block_m) + E) * triton.cdiv(N, cfg.block_n)
    grid = (persistent_programs(c.device, kernel, bound, cfg.programs_per_sm),)
    fp32_dot = interpret or a.dtype == torch.float32 or b.dtype == torch.float32
    tma_b, b_desc, b_rows = weight_descriptor(cfg, b, stride_b, K, fp32_dot)
    # with pull and TMA for A, the kernel adds a proxy fence after its waits (the pull writes through the generic proxy)
    tma_a = (cfg.tma_a and tma_b != 0 and a_idx is None and a.stride(1) == 1 and a.data_ptr() % 16 == 0
             and (a.stride(0) * a.element_size()) % 16 == 0)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [cfg.block_m, cfg.block_k]) if tma_a else a
    dummy = c
    args = dict(a_ptr=a, a_desc=a_desc, b_ptr=b, b_desc=b_desc, row_offsets_ptr=offsets_E1,
                tile_offsets_ptr=tile_offsets_E1, scale_ptr=scale if scale is not None else dummy, c_ptr=c,
                num_rows=num_rows, N=N, num_experts=E, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
                stride_be=stride_b[0], stride_bn=stride_b[1], stride_bk=stride_b[2], HAS_SCALE=scale is not None,
                FP32_DOT=fp32_dot, EVEN_K=K % cfg.block_k == 0, EVEN_N=N % cfg.block_n == 0, E_POW2=pow2(E),
                TMA_A=tma_a, TMA_B=tma_b, B_ROWS=b_rows, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k)
    if pull is None:  # gathered rows: from the token matrix through a_idx
        args.update(a_idx_ptr=a_idx if a_idx is not None else offsets_E1, HAS_GATHER=a_idx is not None)
    if push is None:  # the epilogue's outputs (push: the plain one, into the owners' slots)
        args.update(gu_ptr=gu if gu is not None else dummy, aux_ptr=aux if aux is not None else dummy,
                    dot_ptr=dot if dot is not None else dummy, stride_cm=c.stride(0),
                    stride_gm=gu.stride(0) if gu is not None else 0, stride_xm=aux.stride(0) if aux is not None else 0,
                    EPILOGUE=epilogue, SAVE_AUX=aux is not None, HAS_DOT=dot is not None,
                    DOT_N=dot_cols(cfg) if epilogue == _SWIGLU_BWD else cfg.block_n)
    kernel[grid](**args, **ep_args, num_warps=cfg.num_warps, enable_fp_fusion=True, num_stages=cfg.num_stages)
    return cfg


def _m_grouped_kernel(where: str, epilogue: int, a_idx, push: RowPush | None, pull: RowPull | None) -> tuple:
    """(kernel, its expert-parallel arguments): the local m-grouped kernel, or the push / pull kernel of
    megamoe.ops.ep_tiles."""
    if push is not None and pull is not None:
        raise ValueError(f"{where}: a GEMM takes either push or pull, not both")
    if push is not None:
        if epilogue != _PLAIN:
            raise ValueError(f"{where}: push needs the plain epilogue")
        return push_launch(push)
    if pull is not None:
        if a_idx is not None:
            raise ValueError(f"{where}: pull needs rows that are not gathered")
        return pull_launch(pull)
    return m_grouped_gemm_kernel, {}


def dot_cols(cfg) -> int:
    """Columns per row-dot partial of the SwiGLU-backward epilogue: block_n up to 128, else 128 (a 256-wide
    tile writes two partials), so 128- and 256-wide tiles add the same partials in the same order."""
    if cfg.block_n > 256:
        raise ValueError(f"dgrad_swiglu: block_n must be <= 256, got {cfg}")
    return min(cfg.block_n, 128)


def weight_descriptor(cfg, b: torch.Tensor, stride_b, K: int, fp32_dot: bool):
    """(TMA_B, B argument, rows per expert of the 2-D view) for the m-grouped kernel.

    TMA_B 1: B[e] stored (N, K) ("nt"), descriptor over the (E * b.shape[1], K) view, tiles (BLOCK_N, BLOCK_K);
    TMA_B 2: B[e] stored (K, N) ("nn"), descriptor over (E * K, N), tiles (BLOCK_K, BLOCK_N), only when
    BLOCK_K divides K (a tile must not reach into the next expert's rows). Otherwise 0: pointer loads.
    Out-of-range tiles are zero-filled by the hardware at the view's edges; rows of a neighbouring
    expert read by an N-tail tile only reach output columns that are masked at the store.
    """
    if not cfg.tma_b or fp32_dot or b.dtype not in (torch.bfloat16, torch.float16) or b.data_ptr() % 16:
        return 0, b, 1
    E, r, c = b.shape
    if (c * b.element_size()) % 16:
        return 0, b, 1
    if stride_b[2] == 1:  # nt
        return 1, TensorDescriptor(b, [E * r, c], [c, 1], [cfg.block_n, cfg.block_k]), r
    if stride_b[1] == 1 and K % cfg.block_k == 0:  # nn
        return 2, TensorDescriptor(b, [E * r, c], [c, 1], [cfg.block_k, cfg.block_n]), r
    return 0, b, 1


def _rows_of(a: torch.Tensor, gather_idx_R: torch.Tensor | None) -> int:
    return a.shape[0] if gather_idx_R is None else gather_idx_R.shape[0]


def _check_plain_operands(where: str, a, b_name: str, b, k_dim: int, offsets_E1, gather_idx_R, **more):
    """Checks shared by the plain-epilogue m-grouped launchers (``grouped_mm_nt`` / ``grouped_mm_nn``):
    A rows with K = b.shape[k_dim] columns, a 3-D contiguous B, an int32 gather index, the group offsets,
    one device. Returns (device, R)."""
    _check_2d("a", a, where)
    _check_weight(b_name, b, where)
    _check_index("gather_idx_R", gather_idx_R, where)
    K = b.shape[k_dim]
    if a.shape[1] != K:
        raise ValueError(f"{where}: a has {a.shape[1]} columns, B[e] needs K={K}")
    _check_offsets(offsets_E1, b.shape[0], where)
    dev = check_device(m_grouped_gemm_kernel, where, a=a, **{b_name: b}, offsets_E1=offsets_E1,
                       gather_idx_R=gather_idx_R, **more)
    return dev, _rows_of(a, gather_idx_R)


def gate_up_swiglu(a: torch.Tensor, w13_EGD: torch.Tensor, offsets_E1: torch.Tensor, *,
                   gather_idx_R: torch.Tensor | None = None, save_preact: bool = True,
                   out: torch.Tensor | None = None, preact_out: torch.Tensor | None = None,
                   tile_offsets_E1: torch.Tensor | None = None, tile_cache: dict | None = None,
                   pull: RowPull | None = None, kernel_config: KernelConfig = DEFAULT_KERNELS):
    """Gate/up projection with SwiGLU fused into the epilogue (m-grouped "nt").

    ``gu[r] = A[row(r)] @ w13[e].T`` rounded to A's dtype, ``h[r] = cast(silu(gate) * up)`` in fp32.

    Args:
        a: (R, D) expert-grouped rows, or (T, D) token rows when ``gather_idx_R`` is given. bf16/fp16/fp32.
        w13_EGD: (E, 2F, D) contiguous, same dtype: rows [0, F) gate, [F, 2F) up.
        offsets_E1: (E+1,) int32 device group offsets into the R rows.
        gather_idx_R: optional (R,) int32: row r reads ``a[gather_idx_R[r]]`` (no permuted copy).
        save_preact: also return the pre-activations [gate | up] (R, 2F), what the backward needs.
        out / preact_out: optional preallocated outputs (contiguous, right shape and dtype).
        tile_offsets_E1: optional cached ``tile_offsets_for(offsets_E1, BLOCK_M)``.
        tile_cache: optional dict shared by the GEMMs of one set of group offsets (this and the other
            m-grouped launchers take it too): each m-tile offset table is computed once per (offsets tensor,
            BLOCK_M) and reused, one small kernel launch fewer per further GEMM. Valid only while the values of
            ``offsets_E1`` do not change (use a new dict after rewriting them).
        pull: optional :class:`RowPull`: a's rows are still being written by the pull it launches; this GEMM
            runs beside it, each tile waiting (bounded) for its rows. Rows not gathered. The same bits.
        kernel_config: tile overrides (:class:`megamoe.config.KernelConfig`; default: the table). The other
            m-grouped launchers and :func:`k_grouped_mm` take it too.

    Returns:
        h_RF: (R, F) in a's dtype.  gu_RG: (R, 2F) or None.

    Sync: none. Determinism: bitwise reproducible, batch invariant.
    """
    where = "gate_up_swiglu"
    _check_2d("a", a, where)
    _check_weight("w13_EGD", w13_EGD, where)
    _check_index("gather_idx_R", gather_idx_R, where)
    E, G, D = w13_EGD.shape
    if G % 2 or a.shape[1] != D or a.dtype != w13_EGD.dtype:
        raise ValueError(f"{where}: need a (., D) and w13 (E, 2F, D) of one dtype, got a {tuple(a.shape)} {a.dtype}, "
                         f"w13 {tuple(w13_EGD.shape)} {w13_EGD.dtype}")
    _check_offsets(offsets_E1, E, where)
    dev = check_device(m_grouped_gemm_kernel, where, a=a, w13_EGD=w13_EGD, offsets_E1=offsets_E1,
                       gather_idx_R=gather_idx_R)
    F = G // 2
    R = _rows_of(a, gather_idx_R)
    h = _alloc(out, (R, F), a.dtype, dev, "out", where)
    gu = _alloc(preact_out, (R, G), a.dtype, dev, "preact_out", where) if save_preact else None
    _launch_m_grouped(where=where, kind="gate_up", epilogue=_SWIGLU, a=a, a_idx=gather_idx_R, b=w13_EGD,
                      stride_b=(G * D, D, 1), num_rows=R, N=F, K=D, offsets_E1=offsets_E1, c=h, aux=gu,
                      tile_offsets_E1=tile_offsets_E1, tile_cache=tile_cache, pull=pull, kernel_config=kernel_config)
    return h, gu


def grouped_mm_nt(a: torch.Tensor, b_ENK: torch.Tensor, offsets_E1: torch.Tensor, *,
                  gather_idx_R: torch.Tensor | None = None, row_scale_R: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, kind: str = "down",
                  tile_offsets_E1: torch.Tensor | None = None, push: RowPush | None = None,
                  tile_cache: dict | None = None, kernel_config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor | None:
    """m-grouped ``C[r] = cast(A[row(r)] @ B[e].T [* row_scale[r]])``, B[e] stored (N, K).

    a: (R, K) grouped rows or (T, K) with gather_idx_R (R,) int32. b_ENK: (E, N, K) contiguous.
    row_scale_R: optional (R,) fp32, applied to the fp32 accumulator before the one cast.
    Returns c_RN (R, N) in out_dtype (default a's dtype). fp32 operands use IEEE fp32 dots (the router's fp32 GEMMs
    of bf16 x come here as bf16 pieces, megamoe.autograd).
    push: a :class:`RowPush`: the rows are stored where it says (the same values; no (R, N) output, ``out``
    must be None) and None is returned.
    """
    where = "grouped_mm_nt"
    dev, R = _check_plain_operands(where, a, "b_ENK", b_ENK, 2, offsets_E1, gather_idx_R, row_scale_R=row_scale_R)
    E, N, K = b_ENK.shape
    if row_scale_R is not None and (row_scale_R.shape != (R,) or row_scale_R.dtype != torch.float32):
        raise ValueError(f"{where}: row_scale_R must be fp32 of shape ({R},), got {row_scale_R.dtype} "
                         f"{tuple(row_scale_R.shape)}")
    c = _plain_out(where, out, push, R, N, out_dtype or a.dtype, dev)
    _launch_m_grouped(where=where, kind=kind, epilogue=_PLAIN, a=a, a_idx=gather_idx_R, b=b_ENK,
                      stride_b=(N * K, K, 1), num_rows=R, N=N, K=K, offsets_E1=offsets_E1, c=c,
                      scale=row_scale_R, tile_offsets_E1=tile_offsets_E1, push=push, tile_cache=tile_cache,
                      kernel_config=kernel_config)
    return None if push is not None else c


def _plain_out(where: str, out, push: RowPush | None, R: int, N: int, dtype: torch.dtype, dev) -> torch.Tensor:
    """The (R, N) output of a plain m-grouped GEMM, or with ``push`` its checked ``dest`` (the kernel then
    writes through the push table)."""
    if push is None:
        return _alloc(out, (R, N), dtype, dev, "out", where)
    if out is not None:
        raise ValueError(f"{where}: give either out or push, not both")
    push.check(where, R, N, dtype, dev)
    return push.dest


def down_proj(h_RF: torch.Tensor, w2_EDF: torch.Tensor, offsets_E1: torch.Tensor,
              row_scale_R: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
              tile_offsets_E1: torch.Tensor | None = None, push: RowPush | None = None,
              tile_cache: dict | None = None, kernel_config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor | None:
    """Down projection ``y[r] = cast(h[r] @ w2[e].T [* row_scale[r]])``: (R, F) x (E, D, F) -> (R, D).

    Each (token, slot) row is written exactly once; with row_scale_R (fp32 routing weights) the scaling
    happens on the fp32 accumulator. ``push``: rows stored through a :class:`RowPush` (returns None).
    Sync: none. Determinism: bitwise, batch invariant (the same bits with or without push).
    """
    return grouped_mm_nt(h_RF, w2_EDF, offsets_E1, row_scale_R=row_scale_R, out=out, kind="down",
                         tile_offsets_E1=tile_offsets_E1, push=push, tile_cache=tile_cache,
                         kernel_config=kernel_config)


def grouped_mm_nn(a: torch.Tensor, b_EKN: torch.Tensor, offsets_E1: torch.Tensor, *,
                  gather_idx_R: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None, tile_offsets_E1: torch.Tensor | None = None,
                  push: RowPush | None = None, tile_cache: dict | None = None,
                  kernel_config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor | None:
    """m-grouped dgrad ``C[r] = cast(A[row(r)] @ B[e])``, B[e] stored (K, N): e.g. dx = dGU @ W13[e].

    a: (R, K) or (T, K) with gather_idx_R. b_EKN: (E, K, N) contiguous. Returns (R, N), or with ``push``
    (a :class:`RowPush`) stores the same rows through it and returns None.
    """
    where = "grouped_mm_nn"
    dev, R = _check_plain_operands(where, a, "b_EKN", b_EKN, 1, offsets_E1, gather_idx_R)
    E, K, N = b_EKN.shape
    c = _plain_out(where, out, push, R, N, out_dtype or a.dtype, dev)
    _launch_m_grouped(where=where, kind="dgrad", epilogue=_PLAIN, a=a, a_idx=gather_idx_R, b=b_EKN,
                      stride_b=(K * N, 1, N), num_rows=R, N=N, K=K, offsets_E1=offsets_E1, c=c,
                      tile_offsets_E1=tile_offsets_E1, push=push, tile_cache=tile_cache, kernel_config=kernel_config)
    return None if push is not None else c


def swiglu_dgrad(dy: torch.Tensor, w2_EDF: torch.Tensor, offsets_E1: torch.Tensor, gu_RG: torch.Tensor, *,
                 gather_idx_R: torch.Tensor | None = None, row_scale_R: torch.Tensor | None = None,
                 row_dot: bool = True, tile_offsets_E1: torch.Tensor | None = None, tile_cache: dict | None = None,
                 pull: RowPull | None = None, kernel_config: KernelConfig = DEFAULT_KERNELS):
    """Down-projection dgrad with the SwiGLU backward fused (m-grouped "nn").

    With ``acc = dY[row(r)] @ w2[e]`` (fp32) and h recomputed from the saved ``gu_RG`` exactly as
    :func:`gate_up_swiglu` computed it:
      * ``row_dot_RP[r, p] = sum over the p-th BLOCK_N columns of acc * h`` (fp32): summed over p, this is
        ``<dY[row(r)], y[r]>``, the gradient of a routing weight that multiplied y[r];
      * ``dh = cast(acc * s)``, ``dgu_RG = cast([dh * up * silu'(gate) | dh * silu(gate)])``;
      * ``hs_RF = cast(h * s)`` (the operand of the w2 weight gradient ``dY^T @ (s * h)``),
    where s = row_scale_R[r] (1 when None).

    Args:
        dy: (R, D) rows, or (T, D) with gather_idx_R (R,) int32 (the unscaled output gradient per token).
        w2_EDF: (E, D, F). gu_RG: (R, 2F) saved pre-activations. row_scale_R: optional (R,) fp32.
        pull: optional :class:`RowPull` (as in :func:`gate_up_swiglu`): dy's rows and row_scale_R are still
            being written by its pull (TMA reads of dy follow a proxy fence after the waits; the same bits).
    Returns:
        dgu_RG (R, 2F), hs_RF (R, F) in dy's dtype, row_dot_RP (R, P) fp32 or None.
    Sync: none. Determinism: bitwise; no float atomics (row_dot partials are reduced later in fixed order).
    """
    where = "swiglu_dgrad"
    _check_2d("dy", dy, where)
    _check_weight("w2_EDF", w2_EDF, where)
    _check_index("gather_idx_R", gather_idx_R, where)
    E, D, F = w2_EDF.shape
    if dy.shape[1] != D:
        raise ValueError(f"{where}: dy has {dy.shape[1]} columns, w2 needs D={D}")
    _check_offsets(offsets_E1, E, where)
    R = _rows_of(dy, gather_idx_R)
    _check_2d("gu_RG", gu_RG, where, cols=2 * F)
    if gu_RG.shape[0] != R:
        raise ValueError(f"{where}: gu_RG must have {R} rows, got {gu_RG.shape[0]}")
    if row_scale_R is not None and (row_scale_R.shape != (R,) or row_scale_R.dtype != torch.float32):
        raise ValueError(f"{where}: row_scale_R must be fp32 of shape ({R},)")
    dev = check_device(m_grouped_gemm_kernel, where, dy=dy, w2_EDF=w2_EDF, offsets_E1=offsets_E1, gu_RG=gu_RG,
                       gather_idx_R=gather_idx_R, row_scale_R=row_scale_R)
    cfg = m_grouped_config("dgrad_swiglu", F, D, w2_EDF.dtype, interpret=is_interpreted(m_grouped_gemm_kernel),
                           gathered=gather_idx_R is not None, kernel_config=kernel_config)
    num_p = triton.cdiv(F, dot_cols(cfg))
    dgu = torch.empty((R, 2 * F), dtype=dy.dtype, device=dev)
    hs = torch.empty((R, F), dtype=dy.dtype, device=dev)
    part = torch.empty((R, num_p), dtype=torch.float32, device=dev) if row_dot else None
    _launch_m_grouped(where=where, kind="dgrad_swiglu", epilogue=_SWIGLU_BWD, a=dy, a_idx=gather_idx_R, b=w2_EDF,
                      stride_b=(D * F, 1, F), num_rows=R, N=F, K=D, offsets_E1=offsets_E1, c=dgu, aux=hs,
                      dot=part, scale=row_scale_R, gu=gu_RG, tile_offsets_E1=tile_offsets_E1, tile_cache=tile_cache,
                      pull=pull, kernel_config=kernel_config)
    return dgu, hs, part


def k_grouped_wants_rows_in_order(m: int, n: int, dtype: torch.dtype, device: torch.device,
                                  rows_per_group: float, kernel_config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """True when :func:`k_grouped_mm` would run ``torch._grouped_mm`` (or, in its window, the warp-specialized
    Gluon kernel, which also reads contiguous rows only) for an (E, m, n) weight gradient of
    ``dtype`` with ~rows_per_group rows per expert, had it contiguous rows (the table's ``torch_mm``, or a
    ``torch_mm`` "wgrad" entry of ``kernel_config``, on a Hopper GPU, bf16): a caller whose rows are gathered
    by token should then copy them into row order first (megamoe.autograd). A host-side function of shapes:
    no sync."""
    if (not wgrad_shape_fits(m, n, dtype) or is_interpreted(k_grouped_gemm_kernel)
            or not torch_wgrad_device(device)):
        return False
    return k_grouped_config(m, n, dtype, interpret=False, rows_per_group=rows_per_group,
                            kernel_config=kernel_config).torch_mm


def _ws_takes(cfg, p, q, E, M, N, out_dtype, out, gathered, *, fill_sms: bool = True) -> bool:
    """The warp-specialized weight gradient with ``cfg`` can run here: Gluon on a Hopper device, the operands
    of ``ws_operands_fit`` for the (E, M, N) output ``out`` (or the one
    about to be allocated) and, with ``fill_sms`` (the table's choice; an explicit config runs on fewer), at
    least one (expert, m-tile) unit per SM: a single large group, e.g. a shared expert's, keeps torch's kernel,
    which spreads it over every SM."""
    if not (GLUON_AVAILABLE and gluon_device_ok(p)):
        return False
    if fill_sms and E * triton.cdiv(M, cfg.block_m) < sm_count(p.device.index or 0):
        return False
    c_meta = out if out is not None else torch.empty((E, M, N), dtype=out_dtype, device="meta")
    return ws_operands_fit(cfg, p, q, c_meta, gathered)


def _check_k_grouped(where: str, p, q, offsets_E1, p_idx_R, q_idx_R) -> tuple:
    """Checks of :func:`k_grouped_mm`'s operands; returns (device, R rows, E groups)."""
    _check_2d("p", p, where)
    _check_2d("q", q, where)
    _check_index("p_idx_R", p_idx_R, where)
    _check_index("q_idx_R", q_idx_R, where)
    R = _rows_of(p, p_idx_R)
    if _rows_of(q, q_idx_R) != R:
        raise ValueError(f"{where}: p and q describe {R} and {_rows_of(q, q_idx_R)} rows")
    if offsets_E1.dtype != torch.int32 or offsets_E1.dim() != 1 or offsets_E1.numel() < 2:
        raise ValueError(f"{where}: offsets_E1 must be a 1-D int32 tensor of E+1 >= 2 entries")
    dev = check_device(k_grouped_gemm_kernel, where, p=p, q=q, offsets_E1=offsets_E1, p_idx_R=p_idx_R,
                       q_idx_R=q_idx_R)
    return dev, R, offsets_E1.numel() - 1


def _wgrad_in_place_of_torch(where, p, q, offsets_E1, out_dtype, out, dev, rows_per_group, gathered, interpret,
                             from_table) -> torch.Tensor | None:
    """The table chose ``torch_mm`` (rows present): within its row window (``from_table``: not an explicit
    entry) megamoe's warp-specialized Gluon kernel, else ``torch._grouped_mm`` where it takes the operands
    (megamoe.ops.torch_grouped_mm); both the same bits. None: neither runs here."""
    E, M, N = offsets_E1.numel() - 1, p.shape[1], q.shape[1]
    ws_cfg = tile_config.ws_wgrad_config(rows_per_group) if from_table else None
    if ws_cfg is not None and not interpret and _ws_takes(ws_cfg, p, q, E, M, N, out_dtype, out, gathered):
        c = _alloc(out, (E, M, N), out_dtype, dev, "out", where)
        launch_gluon_wgrad_ws(ws_cfg, p, q, offsets_E1, c)  # megamoe's own kernel there: the same bits
        return c
    if torch_wgrad_eligible(p, q, out_dtype, has_out=out is not None, gathered=gathered):
        return torch_wgrad(p, q, offsets_E1)  # torch._grouped_mm (megamoe.ops.torch_grouped_mm): the same bits
    return None


def k_grouped_mm(p: torch.Tensor, q: torch.Tensor, offsets_E1: torch.Tensor, *,
                 p_idx_R: torch.Tensor | None = None, q_idx_R: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                 rows_per_group: float | None = None,
                 kernel_config: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """k-grouped weight gradient ``C[e] = cast(sum_{r in group e} P[prow(r)]^T Q[qrow(r)])``: [E, M, N].

    Args:
        p: (R, M) rows, or a token matrix with p_idx_R (R,) int32 (prow(r) = p_idx_R[r]).
        q: (R, N) rows, or a token matrix with q_idx_R (R,) int32.
        offsets_E1: (E+1,) int32 group offsets into the R rows; E = offsets_E1.numel() - 1.
        rows_per_group: host-side estimate of the rows per group (default R / E) that picks the kernel
            (few rows: the P rows stay on chip while a program walks the n-tiles); never changes bits.
        kernel_config: tile overrides (:class:`megamoe.config.KernelConfig`); an explicit "wgrad" entry
            with ``torch_mm`` runs torch's kernel wherever the operands allow, any other explicit entry
            megamoe's kernels.
    Returns:
        (E, M, N) in out_dtype (default p's dtype).
    Determinism: each output element reduces its expert's rows from the expert's first row, in row order,
    in BLOCK_K chunks, fp32, one cast; no atomics, no split-K: bitwise reproducible, independent of the
    other groups and of the kernel variant (Triton per-tile, Triton resident, or on Hopper the persistent
    Gluon kernel of :mod:`megamoe.ops.wgrad_gluon` or its warp-specialized form, or ``torch._grouped_mm``
    (:mod:`megamoe.ops.torch_grouped_mm`). For contiguous bf16 rows of more than ~154 per expert the table
    picks the warp-specialized kernel up to ~384 rows (with one (expert, m-tile) unit per SM at least) and
    torch's kernel above. The launcher falls back to the Triton kernels wherever the Gluon or torch kernel
    cannot take the operands. An expert with no rows gets exact zeros. Sync: none.
    """
    where = "k_grouped_mm"
    dev, R, E = _check_k_grouped(where, p, q, offsets_E1, p_idx_R, q_idx_R)
    M, N = p.shape[1], q.shape[1]
    if rows_per_group is None:
        rows_per_group = R / E
    interpret = is_interpreted(k_grouped_gemm_kernel)
    dtype = torch.float32 if torch.float32 in (p.dtype, q.dtype) else p.dtype
    cfg = k_grouped_config(M, N, dtype, interpret=interpret, rows_per_group=rows_per_group, kernel_config=kernel_config)
    gathered = p_idx_R is not None or q_idx_R is not None
    explicit = kernel_config.tile("wgrad", M, N)  # asked for explicitly (A/B runs, sweeps, tests)
    if cfg.torch_mm and R > 0 and E * M * N > 0:
        c = _wgrad_in_place_of_torch(where, p, q, offsets_E1, out_dtype or p.dtype, out, dev, rows_per_group,
                                     gathered, interpret, explicit is None)
        if c is not None:
            return c
    if cfg.torch_mm:  # operands it cannot take: the table's own kernel for the shape (the same bits)
        cfg = k_grouped_config(M, N, dtype, interpret=interpret, rows_per_group=rows_per_group, allow_torch=False,
                               kernel_config=kernel_config)
    c = _alloc(out, (E, M, N), out_dtype or p.dtype, dev, "out", where)
    if c.numel() == 0:
        return c
    if R == 0:
        return c.zero_()
    if cfg.gluon and cfg.warp_specialized:  # the warp-specialized kernel, contiguous rows only
        if not interpret and _ws_takes(cfg, p, q, E, M, N, c.dtype, c, gathered, fill_sms=False):
            launch_gluon_wgrad_ws(cfg, p, q, offsets_E1, c)
            return c
        cfg = k_grouped_config(M, N, dtype, interpret=interpret, rows_per_group=rows_per_group, allow_gluon=False,
                               allow_torch=False, kernel_config=kernel_config)
    if cfg.gluon:
        if not interpret and gluon_wgrad_eligible(cfg, p, q, c, fill_sms=explicit is not cfg):
            launch_gluon_wgrad(cfg, p, p_idx_R, q, q_idx_R, offsets_E1, c)
            return c
        # the Triton kernels' own table entry (same chunk order, so the same bits)
        cfg = k_grouped_config(M, N, dtype, interpret=interpret, rows_per_group=rows_per_group, allow_gluon=False,
                               allow_torch=False, kernel_config=kernel_config)
    _launch_k_grouped(cfg, p, p_idx_R, q, q_idx_R, offsets_E1, c, dtype, interpret)
    return c


def _launch_k_grouped(cfg, p, p_idx_R, q, q_idx_R, offsets_E1, c, dtype, interpret) -> None:
    """Launch megamoe's Triton weight-gradient kernel with ``cfg`` into ``c`` (E, M, N): the resident kernel
    (one program per (expert, m-tile)) when cfg.resident_chunks, else the per-tile kernel."""
    E, M, N = c.shape
    kernel = k_grouped_gemm_kernel
    extra = {}
    if cfg.resident_chunks:
        kernel = k_grouped_resident_kernel
        grid = (E * triton.cdiv(M, cfg.block_m),)
        extra = dict(CHUNKS=cfg.resident_chunks)
    else:
        grid = (E * triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    kernel[grid](
        p, p_idx_R if p_idx_R is not None else offsets_E1, q, q_idx_R if q_idx_R is not None else offsets_E1,
        offsets_E1, c, M, N, p.stride(0), p.stride(1), q.stride(0), q.stride(1), c.stride(0), c.stride(1),
        P_GATHER=p_idx_R is not None, Q_GATHER=q_idx_R is not None,
        FP32_DOT=interpret or dtype == torch.float32, INTERPRET=interpret,
        EVEN_M=M % cfg.block_m == 0, EVEN_N=N % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, enable_fp_fusion=True, num_stages=cfg.num_stages, **extra,
    )
