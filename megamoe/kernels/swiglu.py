"""SwiGLU backward as a row-wise pass after the dgrad GEMM (``@triton.jit`` only; launcher in megamoe.ops).

Legend: R rows of an expert-grouped row buffer (rows past ``row_offsets[E]`` hold no work and are neither
read nor written), F expert FFN size, G = 2F ([gate | up] columns), P = ceil(F / DOT_N) row-dot partials.

``_swiglu_bwd_kernel``: for every valid row r and column block p of DOT_N columns, with ``acc = dY @ W2[e]``
(fp32, written by the m-grouped GEMM) and the saved pre-activations ``[g | u]``:
  * ``h = cast(silu(g) * u)`` recomputed exactly as the forward's SwiGLU epilogue computed it;
  * ``part[r, p] = sum over the block's columns of acc * h`` (fp32; the routing-weight gradient is the
    sum over p, reduced later in fixed order);
  * ``dh = cast(acc * s)``, ``dgu = cast([dh * u * silu'(g) | dh * silu(g)])``, ``hs = cast(h * s)``
    (s = the row's routing weight, 1 without a scale).
SiLU: silu(x) = x * sg, silu'(x) = sg * (1 + x * (1 - sg)), sg = 1 / (1 + exp(-x)) (PyTorch's backward
formula; Shazeer, arXiv 2002.05202 for SwiGLU). Grid: (row blocks, column blocks). Each element is
computed by one program from its own row only, in a fixed order: bitwise deterministic, batch invariant,
no atomics, and the partials do not depend on the GEMM's tile shape (the sums are this kernel's).
"""

import triton
import triton.language as tl


@triton.jit
def _swiglu_bwd_kernel(
    acc_ptr, gu_ptr, scale_ptr, row_offsets_ptr,  # inputs: acc [R, F] fp32, gu [R, 2F], scale [R], offsets [E+1]
    dgu_ptr, hs_ptr, dot_ptr,                     # outputs: dgu [R, 2F], hs [R, F], dot [R, P] fp32
    F, num_p, num_experts, stride_acc, stride_gu, stride_dgu, stride_hs,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_R: tl.constexpr, DOT_N: tl.constexpr,
):
    num_valid = tl.load(row_offsets_ptr + num_experts)  # rows past the last expert's end hold no work
    row0 = tl.program_id(0) * BLOCK_R
    if row0 < num_valid:
        out_ty = dgu_ptr.dtype.element_ty
        offs_r = row0 + tl.arange(0, BLOCK_R)
        offs_n = tl.program_id(1) * DOT_N + tl.arange(0, DOT_N)
        mask_r = offs_r < num_valid
        mask_n = offs_n < F
        mask = mask_r[:, None] & mask_n[None, :]
        rows = offs_r.to(tl.int64)[:, None]
        acc = tl.load(acc_ptr + rows * stride_acc + offs_n[None, :], mask=mask, other=0.0)
        g_ptrs = gu_ptr + rows * stride_gu + offs_n[None, :]
        gate = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(g_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        h = (gate * sig * up).to(out_ty).to(tl.float32)  # bitwise the forward's h
        if HAS_DOT:
            part = tl.sum(acc * h, axis=1)  # masked columns are 0 * 0
            tl.store(dot_ptr + offs_r.to(tl.int64) * num_p + tl.program_id(1), part, mask=mask_r)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            acc = acc * scale[:, None]
            h = h * scale[:, None]
        tl.store(hs_ptr + rows * stride_hs + offs_n[None, :], h.to(out_ty), mask=mask)
        dh = acc.to(out_ty).to(tl.float32)
        c_ptrs = dgu_ptr + rows * stride_dgu + offs_n[None, :]
        tl.store(c_ptrs + F, (dh * (gate * sig)).to(out_ty), mask=mask)
        d_gate = (dh * up) * sig * (1.0 + gate * (1.0 - sig))
        tl.store(c_ptrs, d_gate.to(out_ty), mask=mask)
