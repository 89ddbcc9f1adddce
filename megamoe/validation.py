"""Input checks shared by every backend: clear errors instead of hangs or wrong answers.

Legend: T tokens, D hidden, F expert FFN, G = 2F, E experts (L local experts under EP), K top-k,
S shared FFN, H = 2S.

All checks are on shapes, dtypes and devices (host metadata) except :func:`check_expert_ids`, which
reads values: eagerly on CPU (raises ValueError), and on CUDA through ``torch._assert_async`` so that
no host sync happens (a failing id becomes a device-side assertion naming megamoe).
"""

from __future__ import annotations

import os

import torch

__all__ = ["interpreter_active", "check_expert_inputs", "check_expert_ids", "check_fp8"]

FP8_BLOCK = 128  # the FP8 recipe's scale block: D and F must be multiples of it
FP8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # master weights and activations of the FP8 recipe

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, Triton's own variable; the
    one place megamoe reads it): the fused backend then also runs on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _need(cond: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(f"megamoe: {msg}")


def check_expert_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts). CPU: ValueError. CUDA: sync-free device assertion. While torch.compile
    traces, nothing here: megamoe's custom ops (megamoe.custom_ops) check their ids when they run."""
    if topk_ids_TK.numel() == 0 or torch.compiler.is_compiling():
        return
    ok = ((topk_ids_TK >= 0) & (topk_ids_TK < num_experts)).all()
    msg = f"megamoe: topk_ids_TK has expert ids out of range [0, {num_experts})"
    if topk_ids_TK.is_cuda:
        torch._assert_async(ok, msg)
    elif not bool(ok):
        bad = topk_ids_TK[(topk_ids_TK < 0) | (topk_ids_TK >= num_experts)]
        raise ValueError(f"{msg}: found {bad[:8].tolist()}")


def check_expert_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD=None,
                        shared_w2_DS=None, *, num_experts: int | None = None, check_ids: bool = True) -> None:
    """Validate the arguments of ``moe_experts``-style entries.

    ``num_experts`` is the global E that ids index (defaults to ``w13_EGD.shape[0]``; under EP pass
    W * L). Raises TypeError for wrong types/dtypes and ValueError for wrong shapes, devices or ids
    (:func:`check_expert_ids`, unless ``check_ids`` is False: the caller guarantees them).
    """
    for name, t in (("x_TD", x_TD), ("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK),
                    ("w13_EGD", w13_EGD), ("w2_EDF", w2_EDF)):
        _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    _need(x_TD.dim() == 2, f"x_TD must be 2-D [T, D], got shape {tuple(x_TD.shape)}")
    _need(x_TD.dtype in _FLOAT_DTYPES, f"x_TD must be floating point, got {x_TD.dtype}", TypeError)
    T, D = x_TD.shape
    _need(w13_EGD.dim() == 3 and w2_EDF.dim() == 3,
          f"w13_EGD [E, 2F, D] and w2_EDF [E, D, F] must be 3-D, got {tuple(w13_EGD.shape)} and {tuple(w2_EDF.shape)}")
    E, G, D13 = w13_EGD.shape
    E2, D2, F = w2_EDF.shape
    _need(E == E2 and D13 == D and D2 == D and G == 2 * F,
          f"weight shapes disagree: x_TD {tuple(x_TD.shape)}, w13_EGD {tuple(w13_EGD.shape)} (want [E, 2F, D]), "
          f"w2_EDF {tuple(w2_EDF.shape)} (want [E, D, F])")
    _need(w13_EGD.dtype == x_TD.dtype and w2_EDF.dtype == x_TD.dtype,
          f"dtype mismatch: x_TD {x_TD.dtype}, w13_EGD {w13_EGD.dtype}, w2_EDF {w2_EDF.dtype}", TypeError)
    _need(topk_ids_TK.dim() == 2 and topk_ids_TK.shape[0] == T,
          f"topk_ids_TK must be [T={T}, K], got {tuple(topk_ids_TK.shape)}")
    _need(topk_ids_TK.dtype in (torch.int32, torch.int64), f"topk_ids_TK must be int32/int64, got {topk_ids_TK.dtype}",
          TypeError)
    _need(topk_weights_TK.shape == topk_ids_TK.shape,
          f"topk_weights_TK {tuple(topk_weights_TK.shape)} must match topk_ids_TK {tuple(topk_ids_TK.shape)}")
    _need(topk_weights_TK.dtype in _FLOAT_DTYPES, f"topk_weights_TK must be floating, got {topk_weights_TK.dtype}",
          TypeError)
    E_glob = E if num_experts is None else num_experts
    K = topk_ids_TK.shape[1]
    _need(1 <= K <= min(16, E_glob), f"top-k K={K} must be in [1, min(16, E={E_glob})]")
    tensors = [x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF]
    if shared_w13_HD is not None or shared_w2_DS is not None:
        for name, t in (("shared_w13_HD", shared_w13_HD), ("shared_w2_DS", shared_w2_DS)):
            _need(t is None or (isinstance(t, torch.Tensor) and t.dim() == 2),
                  f"{name} must be a 2-D torch.Tensor or None", TypeError)
    if (shared_w13_HD is None) != (shared_w2_DS is None):
        raise ValueError("megamoe: pass both shared_w13_HD and shared_w2_DS (the shared expert), or neither")
    if shared_w13_HD is not None:
        H, Ds = shared_w13_HD.shape
        Ds2, S = shared_w2_DS.shape
        _need(Ds == D and Ds2 == D and H == 2 * S,
              f"shared expert shapes {tuple(shared_w13_HD.shape)} / {tuple(shared_w2_DS.shape)} "
              f"must be [2S, D={D}] / [D={D}, S]")
        _need(shared_w13_HD.dtype == x_TD.dtype and shared_w2_DS.dtype == x_TD.dtype,
              "shared expert weights must have x's dtype", TypeError)
        tensors += [shared_w13_HD, shared_w2_DS]
    devs = {t.device for t in tensors}
    _need(len(devs) == 1, f"all tensors must be on one device, got {sorted(map(str, devs))}")
    if check_ids:
        check_expert_ids(topk_ids_TK, E_glob)


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def check_same_across_ranks(group, what: str, values: dict, device=None, group_name: str = "the EP group",
                            hint: str = "") -> None:
    """Raise ValueError on every rank when the ranks of ``group`` passed different ``values``.

    ``values`` maps names to ints or torch dtypes (e.g. hidden size, top-k, experts, dtype). One
    all-gather and one device-to-host copy: call it where a collective already happens (workspace
    creation, the host-synchronous reference), not in a hot path. The error names every disagreeing
    field with each rank's value (rank = rank within ``group``), so a mismatched config never turns into a
    hang or corrupt memory. ``device`` must suit the group's backend (a CUDA device for NCCL). ``hint`` is
    appended to the message (what to pass instead).
    """
    import torch.distributed as dist

    names = list(values)
    enc = [_DTYPE_CODES.get(values[n], -1) if isinstance(values[n], torch.dtype) else int(values[n]) for n in names]
    mine = torch.tensor(enc, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    diff = [i for i in range(len(names)) if bool((table[:, i] != table[0, i]).any())]
    if diff:
        decode = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}
        parts = []
        for i in diff:
            show = (lambda v: decode.get(v, v)) if isinstance(values[names[i]], torch.dtype) else (lambda v: v)
            parts.append(f"{names[i]}: " + ", ".join(f"rank {r}={show(int(table[r, i]))}" for r in range(len(table))))
        raise ValueError(f"megamoe ({what}): ranks of {group_name} disagree on " + "; ".join(parts) + hint)


def check_fp8(where: str, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device | None) -> None:
    """The FP8 recipe's constraints (docs/fp8.md), with errors naming them: the hidden size D and the expert FFN
    size F multiples of 128 (the scale blocks), activations and weights (the master copy) in bf16, fp16 or fp32
    (fp64 has no fused path), and on CUDA a GPU with FP8 tensor cores (compute capability 8.9 or newer).
    ValueError (TypeError for the dtype)."""
    bad = [f"{name}={v}" for name, v in (("hidden size D", hidden), ("expert FFN size F", ffn)) if v % FP8_BLOCK]
    if bad:
        raise ValueError(f"{where}: fp8 needs the hidden size and the expert FFN size to be multiples of "
                         f"{FP8_BLOCK} (its scale blocks), got {', '.join(bad)}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{where}: fp8 runs with bf16, fp16 or fp32 activations and weights (the master copy; the "
                        f"GEMM operands are e4m3), got {dtype}")
    if device is not None and torch.device(device).type == "cuda":
        cap = torch.cuda.get_device_capability(torch.device(device))
        if cap < (8, 9):
            name = torch.cuda.get_device_name(torch.device(device))
            raise ValueError(f"{where}: fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer, "
                             f"e.g. Hopper), got {name} with {cap[0]}.{cap[1]}")
