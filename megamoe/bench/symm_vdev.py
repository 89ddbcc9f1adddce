"""``symm-vdev`` provider: PyTorch symmetric-memory all_to_all_vdev_2d (NVSHMEM) + torch._grouped_mm.

Legend: T tokens on this rank, D hidden, F expert FFN, W EP world size, L local experts, K top-k,
N = T*K rows sent by this rank, M = W*N rows a rank may receive (worst case), E = W*L.

Dispatch: rows sorted by global expert (rank-major ``[dest rank][local expert]``) go through
``torch.ops.symm_mem.all_to_all_vdev_2d``, which lands them **expert-major** (expert e's chunks from all
ranks contiguous) with the split sizes on the device: no host sync. ``torch._grouped_mm`` group ends come
from the returned (splits, offsets); rows outside every chunk (alignment padding, tail) are zeroed, so
they add nothing to weight gradients. Combine: ``all_to_all_vdev_2d_offset`` with the dispatch's
(splits, offsets) sends every chunk back rank-major, in the order it was sent. Autograd: dispatch's
backward is a combine-direction op and vice versa (the pattern of OLMo-core's public wrappers).

Buffers: one symmetric input and one symmetric output buffer of M rows, reused by every op; each op is
preceded by a stream-ordered all-reduce barrier (peers may still be pulling from this rank's input buffer,
and NVSHMEM handle barriers are no-ops in torch 2.11, pytorch#191858), and outputs are copied out at once.
Limits (torch 2.11 kernels): local experts <= 16 for ``_2d``, world <= 16 for ``_2d_offset``.
Not run on CPU; written against the torch 2.11 schemas in shared/reference/triton-symm-mem.md §1.4.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import reference as ref
from .providers import grouped_mm, weighted_sum

__all__ = ["symm_vdev_unavailable", "build_symm_vdev"]

MAX_LOCAL_EXPERTS, MAX_WORLD = 16, 16
_BACKEND_SET = False


def symm_vdev_unavailable(ctx, prob) -> str | None:
    L = prob.local_experts
    if L > MAX_LOCAL_EXPERTS:
        return f"all_to_all_vdev_2d handles <= {MAX_LOCAL_EXPERTS} local experts, here L = {L}"
    if ctx.world_size > MAX_WORLD:
        return f"all_to_all_vdev_2d_offset handles world <= {MAX_WORLD}"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d_offset"):
        return f"torch {torch.__version__} lacks symm_mem.all_to_all_vdev_2d_offset"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if not symm_mem.is_nvshmem_available():
            return "NVSHMEM is not available"
    except Exception as exc:  # noqa: BLE001
        return f"symmetric memory unavailable: {type(exc).__name__}: {exc}"
    return None


class _Comm:
    """Symmetric buffers and the two ops, shared by forward and backward."""

    def __init__(self, prob, ctx):
        import torch.distributed._symmetric_memory as symm_mem
        W, L, D = ctx.world_size, prob.local_experts, prob.cfg.hidden_size
        self.W, self.L, self.D, self.group = W, L, D, ctx.group
        self.N = prob.tokens_per_rank * prob.cfg.top_k
        self.M = W * self.N
        elem = torch.empty(0, dtype=prob.dtype).element_size()
        global _BACKEND_SET
        if not _BACKEND_SET:  # once per process, before the first symmetric allocation
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(2 * self.M * D * elem + (1 << 30)))
            symm_mem.set_backend("NVSHMEM")
            _BACKEND_SET = True
        self.name = ctx.group.group_name
        dev = ctx.device
        self.buf_in = symm_mem.empty(self.M, D, dtype=prob.dtype, device=dev)
        self.buf_out = symm_mem.empty(self.M, D, dtype=prob.dtype, device=dev)
        self.splits = symm_mem.empty(W * L, dtype=torch.int64, device=dev)
        self.so_in = symm_mem.empty(2, W * L, dtype=torch.int64, device=dev)
        self.so_out = symm_mem.empty(2, W * L, dtype=torch.int64, device=dev)
        self.buf_out.zero_()
        for t in (self.buf_in, self.buf_out, self.splits, self.so_in, self.so_out):
            symm_mem.rendezvous(t, self.name)
        self._bar = torch.zeros(1, device=dev)

    def barrier(self) -> None:
        dist.all_reduce(self._bar, group=self.group)  # stream-ordered, no host sync

    def dispatch(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-major rows -> expert-major [M, D] (rows outside chunks zeroed), and (2, W*L) splits/offsets."""
        self.barrier()
        self.buf_in[: x_ND.shape[0]].copy_(x_ND)
        self.splits.copy_(counts_E)
        torch.ops.symm_mem.all_to_all_vdev_2d(self.buf_in, self.buf_out, self.splits, self.so_out, self.name)
        so = self.so_out.clone()
        return torch.where(self.valid_rows(so).unsqueeze(1), self.buf_out, 0), so

    def combine(self, y_MD: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
        """Expert-major chunks located by ``so`` -> rank-major [N, D] in the order they were dispatched."""
        self.barrier()
        self.buf_in.copy_(y_MD)
        self.so_in.copy_(so)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(self.buf_in, self.buf_out, self.so_in, self.so_out, self.name)
        return self.buf_out[: self.N].clone()

    def valid_rows(self, so: torch.Tensor) -> torch.Tensor:
        """bool [M]: rows inside some chunk (+1 at each start, -1 at each end, prefix sum > 0)."""
        delta = torch.zeros(self.M + 1, dtype=torch.int64, device=so.device)
        ones = torch.ones_like(so[0])
        delta.index_add_(0, so[1].clamp(0, self.M), ones)  # integer adds: deterministic
        delta.index_add_(0, (so[1] + so[0]).clamp(0, self.M), -ones)
        return torch.cumsum(delta, 0)[: self.M] > 0

    def group_ends(self, so: torch.Tensor) -> torch.Tensor:
        """int32 [L] end row of each local expert's last chunk (expert-major: index e*W + r)."""
        last = (so[1] + so[0]).view(self.L, self.W)[:, -1]
        return last.to(torch.int32)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x_ND, counts_E, comm: _Comm):
        out_MD, so = comm.dispatch(x_ND, counts_E)
        fctx.comm = comm
        fctx.mark_non_differentiable(so)
        fctx.save_for_backward(so)
        return out_MD, so

    @staticmethod
    def backward(fctx, grad_MD, _grad_so):
        (so,) = fctx.saved_tensors
        return fctx.comm.combine(grad_MD.contiguous(), so), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(fctx, y_MD, so, counts_E, comm: _Comm):
        fctx.comm = comm
        fctx.save_for_backward(counts_E)
        return comm.combine(y_MD, so)

    @staticmethod
    def backward(fctx, grad_ND):
        (counts_E,) = fctx.saved_tensors
        g_MD, _ = fctx.comm.dispatch(grad_ND.contiguous(), counts_E)
        return g_MD, None, None, None


def build_symm_vdev(prob, ctx):
    comm = _Comm(prob, ctx)
    E = prob.cfg.num_experts

    def fn(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD=None, shared_w2_DS=None):
        T, K = topk_ids_TK.shape
        flat_N = topk_ids_TK.reshape(-1)
        order_N = torch.sort(flat_N, stable=True).indices
        counts_E = torch.bincount(flat_N, minlength=E)
        x_MD, so = _Dispatch.apply(x_TD[order_N // K], counts_E, comm)
        offs_L = comm.group_ends(so)
        F_ = w2_LDF.shape[2]
        gu_MG = grouped_mm(x_MD, w13_LGD.transpose(-2, -1), offs_L)
        y_MD = grouped_mm(ref.swiglu(gu_MG[:, :F_], gu_MG[:, F_:]), w2_LDF.transpose(-2, -1), offs_L)
        back_ND = _Combine.apply(y_MD, so, counts_E, comm)
        inverse_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
        return weighted_sum(back_ND[inverse_N].view(T, K, -1), topk_weights_TK,
                            ref.shared_expert(x_TD, shared_w13_HD, shared_w2_DS), x_TD.dtype)
    return fn
