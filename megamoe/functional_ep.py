"""Functional entry of the fused expert-parallel MoE (experts sharded over an NVLink EP group).

Legend: T tokens of this rank, D hidden, F expert FFN, G = 2F, W EP world size, L = E / W local experts,
E = W * L global experts, K top-k, S shared FFN, H = 2S, C receive capacity (rows per round).

Protocol, buffer sizes in bytes and guarantees: docs/ep.md. Layering: this module validates and resolves
the workspace, megamoe.autograd.MoEExpertsFunction runs the stages of both passes with the NVLink dispatcher
(megamoe.ops.ep_dispatch), megamoe.ops.ep_comm launches the exchange's kernels.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .config import EPOptions, KernelConfig
from .validation import check_expert_inputs, check_fp8

__all__ = ["moe_experts_ep", "moe_experts_ep_workspace"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch.compile runs the exchange eagerly (a graph break; fullgraph=True names this reason): it keeps state across
# the pass (workspaces, a dispatcher per call) that is not a custom op (docs/hf.md, torch.compile)
_NOT_COMPILED = dict(reason="megamoe: expert parallelism (moe_experts_ep) runs eagerly under torch.compile")


@torch.compiler.disable(**_NOT_COMPILED)
def moe_experts_ep(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   w13_LGD: torch.Tensor, w2_LDF: torch.Tensor, shared_w13_HD: torch.Tensor | None = None,
                   shared_w2_DS: torch.Tensor | None = None, *, group, capacity_rows: int | None = None,
                   timeout_s: float = 10.0, save_preact: bool = True, save_dispatched: bool = True,
                   options: EPOptions | None = None, kernel_config: KernelConfig | None = None,
                   fp8: bool = False) -> torch.Tensor:
    """Routed + shared SwiGLU experts and combine with the routed experts sharded over ``group``.

    Rank r of ``group`` owns global experts [r*L, (r+1)*L). Each rank passes its own tokens; the global
    batch is the concatenation of the ranks' tokens in rank order (global token index = sum of T of
    lower ranks + local index, computed on the device from an exchanged count table).

    Args:
        x_TD: (T, D) this rank's tokens, bf16 / fp16 / fp32, any T >= 0 (ranks may differ), any strides.
        topk_ids_TK: (T, K) int32/int64 global expert ids in [0, W*L).
        topk_weights_TK: (T, K) float routing weights (used in fp32).
        w13_LGD: (L, 2F, D) this rank's experts, x's dtype (rows [0, F) gate, [F, 2F) up).
        w2_LDF: (L, D, F) this rank's experts, x's dtype.
        shared_w13_HD / shared_w2_DS: optional replicated shared expert, (2S, D) / (D, S).
        group: the EP process group (every rank of it must call with the same layer sequence).
        capacity_rows: receive-buffer rows per round C (default: ``distributed.default_capacity_rows``,
            which covers the worst case in one round for W <= 2). More rows are processed in further
            rounds, launched ahead and exiting at once when unused.
        timeout_s: bound of every cross-rank wait, and of the GEMM's wait for the pull beside it (> 0).
        save_preact: keep the gate/up pre-activations of the received rows (round 0) from forward to
            backward, C x 2F elements of x's dtype per call (537 MB = 512 MiB for deepseek-v3 at the default
            C = 65536 of W >= 2 and 4096 tokens), so the backward does not recompute them; False recomputes
            them (the least memory). Same bits either way.
        save_dispatched: keep the x rows this rank received in the forward's round-0 dispatch for the
            backward, C x D elements of x's dtype per call (deepseek-v3 at the default C = 65536 of W >= 2
            and 4096 tokens: 940 MB = 0.875 GiB), so the backward's round 0 pulls only the output-gradient
            rows and weights; False pulls x again. Measured at W = 1: the pull kernel -0.45 ms per call
            (deepseek-v3, 8192 tokens); over NVLink (W > 1) it should save about half the backward's round-0
            dispatch traffic (not measured yet). With one launched round (W <= 2 at the default C) the
            backward then allocates no x buffer of its own, so its transient peak does not grow; with
            several launched rounds, each pass allocates a C x D x buffer for rounds after the first. Both
            kept buffers are held per layer call until its backward, so they add up across a model's MoE
            layers; when memory is short, turn this off first (it saves far less time than
            ``save_preact``: +9 to +11 ms per call at W = 1 without the pre-activations). Same bits either
            way. Neither is kept when no backward can follow (grad mode off, or no input requires grad).
        options: variants of the exchange (:class:`megamoe.config.EPOptions`; None: all off, the default
            path). The same bits either way.
        kernel_config: tile overrides of the expert GEMMs (:class:`megamoe.config.KernelConfig`; None: the
            checked-in table).
        fp8: the routed experts' GEMMs in block-scaled FP8 (as :func:`megamoe.functional.moe_experts`'s ``fp8``;
            docs/fp8.md). The rows travel over NVLink in x's dtype and are quantized by the rank that computes
            on them; the result rows go back by the push kernel (``EPOptions.pull_programs`` and the epilogue push
            are not used with fp8). With several rounds (W >= 4 at the default capacity) ``capacity_rows`` must be
            a multiple of 128 (the default is), so that an expert split across rounds is cut on its 128-row
            weight-gradient blocks.

    Returns:
        out_TD: (T, D) in x's dtype, this rank's tokens. Differentiable w.r.t. x, topk_weights, the
        local experts and the shared expert (per-rank partial gradient for the latter).

    Raises:
        TypeError / ValueError naming the argument (types, shapes, dtypes, devices, ids on CPU,
        capacity, timeout, T above the workspace's max_tokens). A wait that expires (dead or
        diverging peer) or a device-found bad id is reported as megamoe.distributed.EPTimeoutError
        naming this rank, the stage and the peer: at the next call on this rank (lazy, no sync), or at
        once through ``megamoe.distributed.get_workspace(...).check()``.

    Determinism: bitwise reproducible; output, input gradient and routed-expert weight gradients bitwise
        equal to the single-GPU fused path on the global batch (an expert of more than ``capacity_rows`` rows,
        split across rounds, sums fp32 partials: equal up to fp32 rounding in 16-bit, bitwise in fp8).
    Sync: none after the first call (which creates the workspace: a collective, token capacity max(largest T,
        4096); a larger T later grows it collectively, see megamoe.distributed.get_workspace); CUDA-graph
        capturable afterwards.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("moe_experts_ep: torch.distributed is not initialised (group)")
    from .distributed import get_workspace

    W = dist.get_world_size(group)
    _validate(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS, W, fp8)
    if not x_TD.is_cuda:
        raise ValueError("moe_experts_ep: the fused EP path needs CUDA tensors (symmetric memory); use "
                         "megamoe.reference_ep on CPU")
    ws = get_workspace(group, num_tokens=x_TD.shape[0], hidden=x_TD.shape[1], top_k=topk_ids_TK.shape[1],
                       num_experts=W * w13_LGD.shape[0], dtype=x_TD.dtype, device=x_TD.device)
    return moe_experts_ep_workspace(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD,
                                    shared_w2_DS, workspace=ws, capacity_rows=capacity_rows, timeout_s=timeout_s,
                                    save_preact=save_preact, save_dispatched=save_dispatched, options=options,
                                    kernel_config=kernel_config, fp8=fp8, validated=True)


@torch.compiler.disable(**_NOT_COMPILED)
def moe_experts_ep_workspace(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD=None,
                             shared_w2_DS=None, *, workspace, capacity_rows: int | None = None,
                             timeout_s: float = 10.0, save_preact: bool = True, save_dispatched: bool = True,
                             options: EPOptions | None = None, kernel_config: KernelConfig | None = None,
                             fp8: bool = False, validated: bool = False) -> torch.Tensor:
    """:func:`moe_experts_ep` on an explicit :class:`megamoe.distributed.EPWorkspace` (also a CPU
    workspace of shared-memory buffers under TRITON_INTERPRET=1, for tests). Same contract."""
    from .autograd import MoEExpertsFunction
    from .distributed import default_capacity_rows, max_received_rows, max_rounds
    from .ops.ep_dispatch import NVLinkDispatcher

    ws = workspace
    s = ws.spec
    if not validated:
        _validate(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS, s.world, fp8)
    T, D = x_TD.shape
    if (D, topk_ids_TK.shape[1], w13_LGD.shape[0] * s.world, x_TD.dtype) != (s.hidden, s.top_k, s.num_experts, s.dtype):
        raise ValueError(f"moe_experts_ep: workspace is for D={s.hidden}, K={s.top_k}, E={s.num_experts}, {s.dtype}; "
                         f"got D={D}, K={topk_ids_TK.shape[1]}, E={w13_LGD.shape[0] * s.world}, {x_TD.dtype}")
    if T > s.max_tokens:
        raise ValueError(f"moe_experts_ep: x_TD has T={T} tokens, above the workspace's max_tokens={s.max_tokens} "
                         "(megamoe.distributed.reserve_workspace before the first call)")
    if capacity_rows is None:
        capacity_rows = default_capacity_rows(s)
    if not isinstance(capacity_rows, int) or isinstance(capacity_rows, bool) or capacity_rows <= 0:
        raise ValueError(f"moe_experts_ep: capacity_rows must be a positive int, got {capacity_rows!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"moe_experts_ep: timeout_s must be > 0, got {timeout_s!r}")
    for name, flag in (("save_preact", save_preact), ("save_dispatched", save_dispatched)):
        if not isinstance(flag, bool):
            raise TypeError(f"moe_experts_ep: {name} must be a bool, got {flag!r}")
    for name, value, cls in (("options", options, EPOptions), ("kernel_config", kernel_config, KernelConfig)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"moe_experts_ep: {name} must be a megamoe.config.{cls.__name__} or None, got "
                            f"{type(value).__name__}")
    ws.timeout_s = float(timeout_s)
    ws.check_lazy()
    rounds = max_rounds(s, capacity_rows)
    recipe = None
    if fp8:
        if rounds > 1 and capacity_rows % 128:
            raise ValueError(f"moe_experts_ep: fp8 with several rounds needs capacity_rows to be a multiple of 128 "
                             f"(an expert split across rounds is cut every capacity_rows rows, on its 128-row "
                             f"weight-gradient blocks), got capacity_rows={capacity_rows}, which needs {rounds} "
                             f"rounds for the worst routing: pass e.g. "
                             f"capacity_rows={(capacity_rows + 127) // 128 * 128} (one round from "
                             f"{max_received_rows(s)} rows)")
        from .autograd_fp8 import Fp8Experts

        recipe = Fp8Experts()
        # the FP8 GEMMs read complete rows and return their result rows (pushed by the push kernel)
        options = dataclasses.replace(options or EPOptions(), pull_programs=0, push_kernel=True)
    c = torch.Tensor.contiguous
    shared = (None, None) if shared_w13_HD is None else (c(shared_w13_HD), c(shared_w2_DS))
    # keeping rows or pre-activations only pays when a backward will run
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (x_TD, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS))
    dispatcher = NVLinkDispatcher(ws, capacity_rows=capacity_rows, rounds=rounds, timeout_s=float(timeout_s),
                                  save_preact=save_preact and grad, save_dispatched=save_dispatched and grad,
                                  options=options or EPOptions(), kernel_config=kernel_config or KernelConfig(),
                                  gemm_buffers=not fp8)
    out = MoEExpertsFunction.apply(c(x_TD), c(topk_ids_TK), c(topk_weights_TK), c(w13_LGD), c(w2_LDF), *shared,
                                   dispatcher, recipe)
    if not out.is_cuda:
        ws.check()  # CPU simulation: errors surface at once
    return out


def _validate(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS, W: int,
              fp8: bool = False) -> None:
    for name, t in (("x_TD", x_TD), ("w13_LGD", w13_LGD)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moe_experts_ep: {name} must be a torch.Tensor, got {type(t).__name__}")
    if w13_LGD.dim() != 3:
        raise ValueError(f"moe_experts_ep: w13_LGD must be (L, 2F, D), got shape {tuple(w13_LGD.shape)}")
    check_expert_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS,
                        num_experts=W * w13_LGD.shape[0])
    if x_TD.dtype not in _DTYPES:
        raise TypeError(f"moe_experts_ep: x_TD dtype {x_TD.dtype} not supported (bf16, fp16, fp32)")
    if not isinstance(fp8, bool):
        raise TypeError(f"moe_experts_ep: fp8 must be a bool, got {fp8!r}")
    if fp8:
        check_fp8("moe_experts_ep", x_TD.shape[1], w2_LDF.shape[2], x_TD.dtype, x_TD.device)
