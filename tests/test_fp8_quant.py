"""Block-scaled FP8 quantizers: the plain-PyTorch specification (megamoe.reference) and the Triton kernels
(megamoe.ops.fp8_quant), the kernels run on CPU under the Triton interpreter (tests/interpreter.py) and, marked
``gpu``, on CUDA.

Proves: the exponent rule (property test over random fp32 amaxes including subnormals: ``a * 2**-e <= 448`` and ``a
* 2**-(e-1) > 448`` unless ``e = -126``); the reference round trip is within e4m3's rounding of x; its 128x1 grouped
blocks equal 1x128 blocks of each expert's transposed rows and its 128x128 blocks transpose with their scale grid.
The kernels' e4m3 bytes (compared as uint8) and scales equal the reference's BIT-EXACTLY on a grid of edge cases:
all-zero 1x128 / 128x1 / 128x128 blocks (zero bytes, finite scales, no NaN), amax exactly ``448 * 2**k`` (byte 0x7E,
scale 2**k) and just above (scale 2**(k+1)), never a 0x7F / 0xFF byte for finite input, tiny amaxes (1e-30, 1e-38, a
subnormal: finite scales with finite inverses), e4m3 rounding ties, NaN / Inf blocks (scale NaN, bytes 0, the other
blocks unaffected), experts of 0, 1, 127, 128, 129 and 300 rows with all-zero channels, rows and columns not
multiples of the tile, rows gathered through idx_R, non-contiguous or misaligned input (copied first), one row or
column, prefilled outputs fully overwritten (and unspecified rows left alone); the integer e4m3 rounding and the
exponent-rule helper on every fp32 exponent; bad input raises a clear error (the sm_90a compile checks are in
tests/test_fp8_quant_compile.py). The 128x1 quantizer's K-major output (``kmajor=True``) is the reference's bytes in
the reference's block-padded layout (zeros past each expert's rows, written into poisoned memory), on every case of
the row-order grid. On CUDA every case runs and the failing ones are listed together.

Run: python -m pytest tests/test_fp8_quant.py -q (interpreted cases fork from one TRITON_INTERPRET=1 host).
"""

import contextlib
import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from interpreter import interpreted
from megamoe import reference as ref
from megamoe.kernels.fp8_quant import e4m3_bytes, pow2_scale
from megamoe.ops import fp8_quant as ops
from poison import poisoned_allocations

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COUNTS = (0, 1, 127, 128, 129, 0, 300)  # rows per expert of the grouped buffer
U8 = torch.uint8
NAN_BYTES = (0x7F, 0xFF)


def _u8(q):
    return q.view(U8)


def _bits(s):
    return s.view(torch.int32)


def _assert_same(got, want, what):
    (qg, sg), (qw, sw) = got, want
    assert qg.dtype == ref.E4M3 and sg.dtype == torch.float32, what
    assert qg.shape == qw.shape and sg.shape == sw.shape, what
    bad = (_u8(qg) != _u8(qw)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
    bad = (_bits(sg) != _bits(sw)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} scales differ, first at {bad[0].tolist()}"


@contextlib.contextmanager
def _case(failures, what):
    """One case. Without a ``failures`` list its first failure ends the test; with one, a failure is recorded there
    (``what: message``) and the next case runs, so that one run shows every failing case."""
    if failures is None:
        yield
        return
    try:
        yield
    except (Exception, pytest.fail.Exception) as err:  # noqa: BLE001 (any failure: recorded, the next case runs)
        failures.append(f"{what}: {type(err).__name__}: {err}".replace("\n", " "))


# --------------------------------------------------------------------------- the exponent rule (reference)

def _rule(a: float) -> int:
    bits = torch.tensor([a], dtype=torch.float32).view(torch.int32)
    return int(ref.pow2_exponent(bits)[0])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.floats(0, 3.4028234663852886e38, width=32, allow_subnormal=True),
                 st.integers(0, 0x7F7FFFFF).map(lambda b: torch.tensor([b], dtype=torch.int32)
                                                .view(torch.float32).item())))
def test_exponent_rule_property(a):
    e = _rule(a)
    assert -126 <= e <= 121
    assert a * 2.0 ** -e <= 448.0  # exact in float64
    if e != -126:
        assert a * 2.0 ** -(e - 1) > 448.0


def test_exponent_rule_boundaries():
    for k in range(-120, 120):
        at = 448.0 * 2.0 ** k
        above = torch.nextafter(torch.tensor(at, dtype=torch.float32), torch.tensor(math.inf)).item()
        assert _rule(at) == max(k, -126) and _rule(above) == max(k + 1, -126), k
    assert _rule(0.0) == -126 and _rule(1e-45) == -126 and _rule(1e-38) == -126


# --------------------------------------------------------------------------- edge-case inputs (any device)

def _next_up(v: float, dtype) -> float:
    """A value of ``dtype`` just above v (the next one for fp32, within two steps for bf16 / fp16)."""
    if dtype == torch.float32:
        return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()
    up = torch.tensor(v * (1 + torch.finfo(dtype).eps), dtype=dtype).item()
    assert up > v
    return up


def _e4m3_ties():
    """Every finite e4m3 value and the midpoints between neighbours (round-to-nearest-even ties), |v| <= 448."""
    v = torch.arange(256, dtype=torch.int32).to(U8).view(ref.E4M3).float()
    v = torch.sort(v[torch.isfinite(v)]).values
    return torch.cat([v, (v[1:] + v[:-1]) / 2])


def grid_1x128(R, C, dtype, seed=0):
    """(R >= 12, C >= 257) rows of random magnitudes, with the edge blocks of the module doc in rows 0-11.
    Returns x and the (row, block) pairs that are non-finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=g) * torch.exp2(torch.randint(-12, 12, (R, 1), generator=g).float())
    x[0, :128] = 0  # zero block
    x[1] = 0  # zero row
    for b, k in enumerate((0, 3, -5)):  # amax exactly 448 * 2**k, and just above
        x[2, 128 * b:128 * b + 128] *= 0.5 * 448 * 2.0 ** k / x[2, 128 * b:128 * b + 128].abs().max()
        x[2, 128 * b + 7] = -448 * 2.0 ** k
        x[3, 128 * b:128 * b + 128] = x[2, 128 * b:128 * b + 128]
        x[3, 128 * b + 7] = _next_up(448 * 2.0 ** k, dtype)
    x[4, :128] *= 1e-30 / x[4, :128].abs().max()
    x[4, 128:256] *= 1e-38 / x[4, 128:256].abs().max()
    x[4, 256:] = torch.where(x[4, 256:] > 0, 1e-40, -1e-40)  # fp32 subnormals (bf16 keeps them, fp16 flushes)
    x[5, 130] = math.nan
    x[6, 3], x[6, 256] = math.inf, -math.inf
    x[7, :2], x[7, 250:252] = torch.tensor([math.nan, math.inf]), torch.tensor([-math.inf, math.nan])
    ties = _e4m3_ties()
    n = min(ties.numel(), C)
    x[8, :n] = ties[:n] * 2.0 ** -3
    x[9, :n] = ties.flip(0)[:n]
    x[10] = -0.0
    x[11, 128:256] = torch.finfo(dtype).max / 4  # large, finite
    nonfinite = [(5, 1), (6, 0), (6, 2), (7, 0), (7, 1)]
    return x.to(dtype), nonfinite


def check_1x128_properties(x, q, s, nonfinite):
    """The recipe's promises on a 1x128 result (x: the input, any float dtype)."""
    R, C = x.shape
    B = s.shape[1]
    qb = _u8(q)
    bad = torch.zeros(R, B, dtype=torch.bool)
    for r, b in nonfinite:
        bad[r, b] = True
    bad = bad.to(s.device)
    assert torch.isnan(s[bad]).all() and torch.isfinite(s[~bad]).all()
    assert torch.isfinite(1 / s[~bad]).all() and (_bits(s[~bad]) & 0x7FFFFF == 0).all()  # powers of two
    bad_cols = bad.repeat_interleave(128, dim=1)[:, :C]
    assert (qb[bad_cols] == 0).all(), "non-finite blocks: bytes 0"
    assert not ((qb == 0x7F) | (qb == 0xFF)).any(), "a NaN byte"
    assert (qb[0, :128] == 0).all() and (qb[1] == 0).all() and (s[1] == 2.0 ** -126).all()
    for b, k in enumerate((0, 3, -5)):
        assert s[2, b] == 2.0 ** k and qb[2, 128 * b + 7] == 0xFE, (b, k)  # -448 * 2**k: byte -448
        assert s[3, b] == 2.0 ** (k + 1), (b, k)
    assert (s[4] > 0).all() and (qb[10] & 0x7F == 0).all()


def grid_128x128(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 300, 260, generator=g)
    w[0, :128, :128] = 0
    w[0, 128:256, 128:256] *= 224 / w[0, 128:256, 128:256].abs().max()
    w[0, 130, 140] = 448.0
    w[1, 256:, 256:] = _next_up(448.0, dtype)  # a partial block, just above 448
    w[1, :128, 128:256] *= 1e-38 / w[1, :128, 128:256].abs().max()
    w[2, 5, 5] = math.nan
    w[2, 200, 259] = -math.inf
    return w.to(dtype)


def check_128x128_properties(q, s):
    qb = _u8(q)
    assert not ((qb == 0x7F) | (qb == 0xFF)).any()
    assert (qb[0, :128, :128] == 0).all() and s[0, 0, 0] == 2.0 ** -126 and s[0, 1, 1] == 1.0
    assert s[1, 2, 2] == 2.0 and torch.isfinite(1 / s[1, 0, 1])
    assert torch.isnan(s[2, 0, 0]) and torch.isnan(s[2, 1, 2]) and (qb[2, :128, :128] == 0).all()
    s_ok = s.clone()
    s_ok[2, 0, 0] = s_ok[2, 1, 2] = 1.0
    assert torch.isfinite(s_ok).all()


def grouped_case(seed=2, gather=False, counts=COUNTS, C=100):
    """An expert-grouped buffer with experts of ``counts`` rows (8 rows past the experts), all-zero channels
    (3 everywhere; 5 in the 128-row expert), a NaN, an Inf and an amax of exactly 448 in some block-columns."""
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    R = int(off[-1]) + 8
    x = torch.randn(R, C, generator=g) * torch.exp2(torch.randint(-5, 6, (1, C), generator=g).float())
    x *= torch.exp2(torch.randint(-6, 7, (R, 1), generator=g).float())  # rows' range beyond e4m3's
    x[:, 3] = 0
    e128 = counts.index(128)
    x[off[e128]:off[e128 + 1], 5] = 0
    e300 = counts.index(300)
    x[int(off[e300]) + 130, 7] = math.nan  # the 300-row expert's second block, column 7
    x[int(off[e300]) + 260, 9] = math.inf  # its third block, column 9
    x[int(off[e300]): int(off[e300]) + 128, 11:16:4] = 1.0
    x[int(off[e300]), 11], x[int(off[e300]) + 127, 15] = 448.0, 452.0  # amax 448, and above (any input dtype)
    x[int(off[e128]):int(off[e128 + 1]), 13] = 1e-40
    if not gather:
        return x, off, None
    idx = torch.randperm(R, generator=g).to(torch.int32)
    src = torch.empty_like(x)
    src[idx.long()] = x  # x's rows are src[idx]
    return src, off, idx


def check_grouped_properties(q, s, off):
    nb = int(ref.block_offsets_for(off)[-1])
    qb, s = _u8(q[:int(off[-1])]), s[:nb]
    assert not ((qb == 0x7F) | (qb == 0xFF)).any()
    assert (qb[:, 3] == 0).all() and (s[:, 3] == 2.0 ** -126).all()
    assert torch.isnan(s).sum() == 2 and torch.isfinite(1 / s[torch.isfinite(s)]).all()
    b300 = int(ref.block_offsets_for(off)[COUNTS.index(300)])  # (grouped_case's default counts)
    assert s[b300, 11] == 1.0 and s[b300, 15] == 2.0 and qb[int(off[COUNTS.index(300)]), 11] == 0x7E


# --------------------------------------------------------------------------- reference self-checks

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_1x128_grid_and_round_trip(dtype):
    x, nonfinite = grid_1x128(40, 300, dtype)
    q, s = ref.quantize_1x128(x)
    check_1x128_properties(x, q, s, nonfinite)
    ok = torch.isfinite(x).all(dim=1)
    xf = x[ok].float()
    d = ref.dequantize_1x128(q[ok], s[ok])
    s_el = s[ok].repeat_interleave(128, dim=1)[:, :300]
    # e4m3 keeps 3 fraction bits (relative rounding <= 2**-4) and its subnormal step is 2**-9 (times the scale)
    assert ((d - xf).abs() <= torch.maximum(xf.abs() * 2.0 ** -4, s_el * 2.0 ** -10)).all()
    assert torch.isnan(ref.dequantize_1x128(q, s)[~ok]).any(dim=1).all()


def test_reference_128x128_transposes_with_its_scale_grid():
    w = grid_128x128(torch.float32)
    q, s = ref.quantize_128x128(w)
    check_128x128_properties(q, s)
    qt, st_ = ref.quantize_128x128(w.transpose(1, 2))
    assert torch.equal(_u8(qt), _u8(q).transpose(1, 2)) and torch.equal(_bits(st_), _bits(s).transpose(1, 2))


def test_reference_grouped_blocks_are_transposed_1x128_blocks():
    x, off, _ = grouped_case()
    q, s = ref.quantize_128x1_grouped(x, off)
    check_grouped_properties(q, s, off)
    bo = ref.block_offsets_for(off)
    for e in range(len(off) - 1):
        lo, hi = int(off[e]), int(off[e + 1])
        qt, st_ = ref.quantize_1x128(x[lo:hi].t())  # blocks of 128 of the expert's rows
        assert torch.equal(_u8(q[lo:hi]), _u8(qt).t()), e
        assert torch.equal(_bits(s[int(bo[e]):int(bo[e + 1])]), _bits(st_).t()), e
    assert s.shape == (triton.cdiv(x.shape[0], 128) + len(off) - 1, x.shape[1])


# --------------------------------------------------------------------------- kernels vs reference (any device)

def _views_1x128(x, R):
    """Partial blocks, tiny, empty, non-contiguous (copied first: column-major, strided); then single rows and
    columns, a contiguous view 2 bytes past an alignment, rows whose stride and width differ in divisibility."""
    flat = x.flatten()
    return (x[:, :257], x[:17, :5], x[:0], x.t().contiguous()[:, :R], x.t(), x[::2, 1::3], x[:, :1], x[:1],
            x.t()[:, :1], x.t()[:1], flat[1:1 + (R - 1) * 128].view(R - 1, 128), x[:, :130], x[:, :256])


def kernel_1x128_cases(device, R=70, C=300, failures=None, all_views=False):
    """all_views: the strided views for every dtype (else for bf16 only, the first six)."""
    for dtype in DTYPES:
        x, nonfinite = grid_1x128(R, C, dtype)
        x = x.to(device)
        with _case(failures, f"1x128 {dtype} {(R, C)}"):
            got = ops.quantize_1x128(x)
            _assert_same(got, ref.quantize_1x128(x), f"1x128 {dtype}")
            check_1x128_properties(x, *got, nonfinite)
            clean = x.clone()
            for r, b in nonfinite:
                clean[r, 128 * b:128 * b + 128] = 0
            qc, sc = ops.quantize_1x128(clean)
            fin = torch.isfinite(got[1])
            fin_cols = fin.repeat_interleave(128, dim=1)[:, :C]
            assert torch.equal(_bits(sc)[fin], _bits(got[1])[fin]), "a non-finite block changed another block"
            assert torch.equal(_u8(qc)[fin_cols], _u8(got[0])[fin_cols]), "a non-finite block changed another block"
        if dtype != torch.bfloat16 and not all_views:
            continue
        for xv in _views_1x128(x, R)[:None if all_views else 6]:
            what = f"1x128 {dtype} {tuple(xv.shape)} strides {xv.stride()}"
            with _case(failures, what):
                _assert_same(ops.quantize_1x128(xv), ref.quantize_1x128(xv), what)


def kernel_128x128_cases(device, failures=None, all_views=False):
    for dtype in DTYPES:
        w = grid_128x128(dtype).to(device)
        with _case(failures, f"128x128 {dtype}"):
            got = ops.quantize_128x128(w)
            _assert_same(got, ref.quantize_128x128(w), f"128x128 {dtype}")
            check_128x128_properties(*got)
        if dtype != torch.bfloat16 and not all_views:
            continue
        views = (w[1], w[:, :100, :3], w.transpose(1, 2), w[:0], w[:, :, :1], w.transpose(1, 2)[:, :, :1],
                 w[1].t()[::3], w.flatten()[3:3 + 2 * 260 * 160].view(2, 260, 160), w[:, :, :256])
        for wv in views[:None if all_views else 4]:
            what = f"128x128 {dtype} {tuple(wv.shape)} strides {wv.stride()}"
            with _case(failures, what):
                _assert_same(ops.quantize_128x128(wv), ref.quantize_128x128(wv), what)


def _grouped_specified(got, want, off, what):
    n, nb = int(off[-1]), int(ref.block_offsets_for(off)[-1])
    _assert_same((got[0][:n], got[1][:nb]), (want[0][:n], want[1][:nb]), what)


def _kmajor_specified(x, off, idx, what):
    """The block-padded transposed bytes (kmajor=True) are the reference's bytes in the reference's padded layout
    (zeros past each expert's rows, written into poisoned memory), the scales the row-order call's."""
    with poisoned_allocations():
        q, s = ops.quantize_128x1_grouped(x, off, idx, kmajor=True)
    qw, sw = ref.quantize_128x1_grouped(x, off, idx)
    nb, used = sw.shape[0], int(ref.block_offsets_for(off)[-1])
    assert q.shape == (128 * nb, x.shape[1]) and q.stride() == (1, 128 * nb) and q.t().is_contiguous(), what
    padded = ref.pad_128x1_blocks(qw, off, nb)
    _assert_same((q[:128 * used], s[:used]), (padded[:128 * used], sw[:used]), f"{what} kmajor")


def kernel_grouped_cases(device, failures=None, all_views=False):
    for dtype in DTYPES:
        for gather in (False, True):
            with _case(failures, f"128x1 {dtype} gather={gather}"):
                x, off, idx = grouped_case(gather=gather)
                x, off = x.to(dtype).to(device), off.to(device)
                idx = idx.to(device) if gather else None
                got = ops.quantize_128x1_grouped(x, off, idx)
                want = ref.quantize_128x1_grouped(x, off, idx)
                _grouped_specified(got, want, off, f"128x1 {dtype} gather={gather}")
                check_grouped_properties(*got, off)
                table = ref.block_offsets_for(off).to(torch.int32)
                _grouped_specified(ops.quantize_128x1_grouped(x, off, idx, block_offsets=table), want, off, "table")
                _kmajor_specified(x, off, idx, f"128x1 {dtype} gather={gather}")
    with _case(failures, "128x1 no rows"):
        off = torch.zeros(3, dtype=torch.int32, device=device)  # two experts, no rows
        q, s = ops.quantize_128x1_grouped(torch.randn(8, 5, device=device), off)
        assert q.shape == (8, 5) and s.shape == (3, 5)
        q, s = ops.quantize_128x1_grouped(torch.randn(8, 5, device=device), off, kmajor=True)
        assert q.shape == (128 * 3, 5) and s.shape == (3, 5)
    for gather in (False, True) if all_views else (False,):
        x, off, idx = grouped_case(C=130, gather=gather)
        x, off, idx = x.to(device), off.to(device), idx.to(device) if gather else None
        views = (x.t().contiguous().t(), x[:, :1], x[:, 2:130:2], x[:, :128])  # column-major, strided: copied first
        for xv in views[:None if all_views else 1]:
            what = f"128x1 gather={gather} {tuple(xv.shape)} strides {xv.stride()}"
            with _case(failures, what):
                _grouped_specified(ops.quantize_128x1_grouped(xv, off, idx), ref.quantize_128x1_grouped(xv, off, idx),
                                   off, what)
                _kmajor_specified(xv, off, idx, what)


def poisoned_output_cases(device):
    x, _ = grid_1x128(70, 300, torch.bfloat16)
    x = x.to(device)
    q = torch.full((70, 300), 0x7F, dtype=U8, device=device).view(ref.E4M3)
    s = torch.full((70, 3), math.nan, device=device)
    assert ops.quantize_1x128(x, out=q, scale_out=s)[0] is q
    _assert_same((q, s), ref.quantize_1x128(x), "1x128 into poisoned buffers")
    w = grid_128x128(torch.float32).to(device)
    q = torch.full(w.shape, 0x7F, dtype=U8, device=device).view(ref.E4M3)
    s = torch.full((3, 3, 3), -1.0, device=device)
    ops.quantize_128x128(w, out=q, scale_out=s)
    _assert_same((q, s), ref.quantize_128x128(w), "128x128 into poisoned buffers")
    x, off, idx = grouped_case(gather=True)
    x, off, idx = x.to(device), off.to(device), idx.to(device)
    R, n, nb = idx.shape[0], int(off[-1]), int(ref.block_offsets_for(off)[-1])
    q = torch.full((R, 100), 0x7F, dtype=U8, device=device).view(ref.E4M3)
    s = torch.full((triton.cdiv(R, 128) + len(off) - 1, 100), 12345.0, device=device)
    ops.quantize_128x1_grouped(x, off, idx, out=q, scale_out=s)
    _grouped_specified((q, s), ref.quantize_128x1_grouped(x, off, idx), off, "128x1 into poisoned buffers")
    assert (_u8(q[n:]) == 0x7F).all() and (s[nb:] == 12345.0).all(), "unspecified rows were written"
    # a receive round's rows: only the first n (a count on the device), the rest of the buffer left alone
    x, _ = grid_1x128(70, 300, torch.bfloat16)
    x = x.to(device)
    for n in (0, 1, 31, 32, 45, 70, 1000):
        q = torch.full((70, 300), 0x7F, dtype=U8, device=device).view(ref.E4M3)
        s = torch.full((70, 3), math.nan, device=device)
        ops.quantize_1x128(x, out=q, scale_out=s, valid_rows_1=torch.tensor([n], dtype=torch.int32, device=device))
        m = min(n, 70)
        _assert_same((q[:m], s[:m]), ref.quantize_1x128(x[:m]), f"1x128 of the first {n} rows")
        assert (_u8(q[m:]) == 0x7F).all() and s[m:].isnan().all(), f"rows past the first {n} were written"


@triton.jit
def _helpers_kernel(y_ptr, bytes_ptr, a_ptr, inv_ptr, s_ptr, n, HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(bytes_ptr + o, e4m3_bytes(tl.load(y_ptr + o, mask=m, other=0.0), HW_CAST), mask=m)
    inv, s, _ = pow2_scale(tl.load(a_ptr + o, mask=m, other=0))
    tl.store(inv_ptr + o, inv, mask=m)
    tl.store(s_ptr + o, s, mask=m)


def helper_cases(device, hw_cast):
    """e4m3_bytes on every fp32 exponent up to 448 (mantissas at the rounding boundaries and random) and every
    e4m3 tie; pow2_scale on every fp32 exponent (with mantissas around 0x600000), Inf and NaN."""
    g = torch.Generator().manual_seed(3)
    exps = torch.arange(0, 136, dtype=torch.int32)[:, None] << 23
    mants = torch.tensor([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF, 0x100000, 0x17FFFF, 0x180000, 0x180001,
                          0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], dtype=torch.int32)
    mants = torch.cat([mants, torch.randint(0, 0x800000, (50,), generator=g, dtype=torch.int32)])
    bits = (exps | mants[None, :]).flatten()
    y = bits.view(torch.float32)
    y = torch.cat([y, -y, _e4m3_ties(), -_e4m3_ties(), torch.tensor([-0.0])])
    y = y[y.abs() <= 448]
    a_bits = torch.cat([(torch.arange(0, 255, dtype=torch.int32)[:, None] << 23 | mants[None, :14]).flatten(),
                        torch.tensor([0x7F800000, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int32)])
    n = max(y.numel(), a_bits.numel())
    y = torch.cat([y, torch.zeros(n - y.numel())]).to(device)
    a_bits = torch.cat([a_bits, torch.zeros(n - a_bits.numel(), dtype=torch.int32)]).to(device)
    out = torch.empty(n, dtype=U8, device=device)
    inv, s = torch.empty(n, device=device), torch.empty(n, device=device)
    _helpers_kernel[(triton.cdiv(n, 1024),)](y, out, a_bits, inv, s, n, HW_CAST=hw_cast, BLOCK=1024)
    want = y.to(ref.E4M3).view(U8)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, f"e4m3 bytes differ at {y[bad[:4]].tolist()}: {out[bad[:4]]} vs {want[bad[:4]]}"
    e = ref.pow2_exponent(a_bits)
    fin = a_bits < 0x7F800000
    assert torch.equal(_bits(inv), (127 - e) << 23)
    assert torch.equal(_bits(s)[fin], ((127 + e) << 23)[fin]) and torch.isnan(s[~fin]).all()


def bad_input_cases(device):
    x = torch.randn(4, 256, device=device)
    off = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="dtype"):
        ops.quantize_1x128(x.double())
    with pytest.raises(ValueError, match="2-D"):
        ops.quantize_1x128(x[None])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        ops.quantize_1x128(x, out=torch.empty(4, 255, dtype=ref.E4M3, device=device))
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.quantize_1x128(x, out=torch.empty(4 * 256 + 1, dtype=U8, device=device)[1:].view(ref.E4M3).view(4, 256))
    with pytest.raises(ValueError, match="valid_rows_1"):
        ops.quantize_1x128(x, valid_rows_1=torch.tensor([2], device=device))  # int64
    with pytest.raises(ValueError, match="scale_out must be a contiguous"):
        ops.quantize_128x128(x, scale_out=torch.empty(1, 1, device=device))
    with pytest.raises(ValueError, match="offsets_E1 must be a contiguous int32"):
        ops.quantize_128x1_grouped(x, off.long())
    with pytest.raises(ValueError, match="idx_R must be a contiguous int32"):
        ops.quantize_128x1_grouped(x, off, torch.arange(4, device=device))
    with pytest.raises(ValueError, match="block_offsets"):
        ops.quantize_128x1_grouped(x, off, block_offsets=off[:1])
    with pytest.raises(ValueError, match="num_rows"):
        ops.quantize_128x1_grouped(x, off, num_rows=5)
    with pytest.raises(ValueError, match="out is not taken with kmajor"):
        ops.quantize_128x1_grouped(x, off, kmajor=True, out=torch.empty(4, 256, device=device).to(ref.E4M3))


# --------------------------------------------------------------------------- interpreter (CPU, CI)

@interpreted
def test_interpret_1x128_bitexact():
    kernel_1x128_cases("cpu")


@interpreted
def test_interpret_128x128_bitexact():
    kernel_128x128_cases("cpu")


@interpreted
def test_interpret_128x1_grouped_bitexact():
    kernel_grouped_cases("cpu")


@interpreted
def test_interpret_poisoned_outputs_overwritten():
    poisoned_output_cases("cpu")


@interpreted
def test_interpret_e4m3_rounding_and_exponent_helpers():
    helper_cases("cpu", hw_cast=False)


@interpreted
def test_interpret_bad_input():
    bad_input_cases("cpu")


def test_cpu_tensors_need_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(ops.quantize_1x128_kernel, InterpretedFunction):
        pytest.skip("this process runs the interpreter")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.quantize_1x128(torch.randn(2, 128))


# --------------------------------------------------------------------------- CUDA (the hardware e4m3 cast)

@pytest.mark.gpu
def test_gpu_bitexact():
    """Every case runs; the failures are listed together at the end."""
    failures = []
    kernel_1x128_cases("cuda", failures=failures, all_views=True)
    kernel_1x128_cases("cuda", R=4099, C=7168, failures=failures, all_views=True)
    kernel_128x128_cases("cuda", failures=failures, all_views=True)
    kernel_grouped_cases("cuda", failures=failures, all_views=True)
    for name, run in (("poisoned outputs", poisoned_output_cases), ("bad input", bad_input_cases)):
        with _case(failures, name):
            run("cuda")
    for hw in (True, False):
        with _case(failures, f"helpers hw_cast={hw}"):
            helper_cases("cuda", hw)
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures)


@pytest.mark.gpu
def test_gpu_large_grouped_and_weights_bitexact():
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 700, (64,), generator=g)
    counts[:5] = torch.tensor([0, 1, 127, 128, 129])
    off = torch.tensor([0, *counts.cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(4096, 2048, generator=g).to(torch.bfloat16).cuda()
    idx = torch.randint(0, 4096, (int(off[-1]),), generator=g, dtype=torch.int32).cuda()
    off = off.cuda()
    _grouped_specified(ops.quantize_128x1_grouped(x, off, idx), ref.quantize_128x1_grouped(x, off, idx), off,
                       "128x1 large")
    _kmajor_specified(x, off, idx, "128x1 large")  # the inline-PTX cast on every byte position of a word
    w = torch.randn(8, 4096, 7168, generator=g).to(torch.bfloat16).cuda()
    _assert_same(ops.quantize_128x128(w), ref.quantize_128x128(w), "128x128 large")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    x, off, idx = grouped_case(gather=True)
    x, off, idx = x.cuda(), off.cuda(), idx.cuda()
    xr = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    outs = [ops.quantize_1x128(xr), ops.quantize_128x1_grouped(x, off, idx)]  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ops.quantize_1x128(xr), ops.quantize_128x1_grouped(x, off, idx)]
    xr.mul_(3)
    x.mul_(-2)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(outs[0], ref.quantize_1x128(xr), "graph 1x128")
    _grouped_specified(outs[1], ref.quantize_128x1_grouped(x, off, idx), off, "graph 128x1")
