"""Which e4m3 byte tiles come out wrong on this GPU when Triton moves them between layouts after the cast.

megamoe.kernels.fp8_quant reads its input through the offsets it stores the output with, so the bytes are cast in
the layout that stores them. This script runs the layout it avoids: a 1x128 quantizer that reads x through any
strides (a column-major x makes Triton cast in a column-major layout and move the bytes to the row-major store
through shared memory, a ``ttg.convert_layout`` of the i8 tile), with the hardware cast (``cvt.rn.satfinite``) and
with the integer rounding path, and prints how many bytes differ from megamoe.reference.quantize_1x128 and in which
columns; then megamoe.ops.quantize_1x128 on the same inputs (0 expected). Whether the integer path is clean tells
a GEMM epilogue whether HW_CAST=False is a way around a byte relayout it cannot avoid.

Run on a GPU: python scripts/fp8_layout_probe.py
"""

import torch
import triton
import triton.language as tl

from megamoe import reference as ref
from megamoe.kernels.fp8_quant import SCALE_BLOCK, as_fp32, quantize_block_rows
from megamoe.ops import fp8_quant as ops


@triton.jit
def strided_1x128_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_xr, stride_xc, BLOCK_R: tl.constexpr,
                         HW_CAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1)
    cols = b * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    mask_r = rows < R
    mask = mask_r[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    q, s = quantize_block_rows(as_fp32(x), HW_CAST)
    tl.store(q_ptr + r64[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(s_ptr + r64 * tl.cdiv(C, SCALE_BLOCK) + b, s, mask=mask_r)


def strided_1x128(x, hw_cast):
    R, C = x.shape
    q = torch.empty(R, C, dtype=torch.uint8, device=x.device)
    s = torch.empty(R, triton.cdiv(C, 128), dtype=torch.float32, device=x.device)
    strided_1x128_kernel[(triton.cdiv(R, 32), triton.cdiv(C, 128))](x, q, s, R, C, x.stride(0), x.stride(1),
                                                                    BLOCK_R=32, HW_CAST=hw_cast, num_warps=4)
    return q, s


def report(name, got, want):
    bad = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).nonzero()
    cols = sorted(set(bad[:, 1].tolist()))
    scales = int((got[1].view(torch.int32) != want[1].view(torch.int32)).sum())
    print(f"{name:58s} bytes differing: {bad.shape[0]:8d}  scales: {scales}  columns: {cols[:12]}"
          f"{' ...' if len(cols) > 12 else ''}")


def main():
    g = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for R, C in ((70, 300), (4096, 7168)):
            base = (torch.randn(R, C, generator=g) * 3).to(dtype).cuda()
            for view_name, x in (("column-major", base.t()), ("row-major", base.t().contiguous())):
                want = ref.quantize_1x128(x)
                for hw in (True, False):
                    report(f"strided kernel {dtype} {tuple(x.shape)} {view_name} HW_CAST={hw}",
                           strided_1x128(x, hw), want)
                report(f"ops.quantize_1x128 {dtype} {tuple(x.shape)} {view_name}", ops.quantize_1x128(x), want)


if __name__ == "__main__":
    main()
