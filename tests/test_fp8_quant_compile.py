"""The FP8 quantizer kernels (megamoe.kernels.fp8_quant) compiled for sm_90a on the CPU (no launch), in the
specializations their launches make.

Proves: the hardware e4m3 cast is used (``cvt.rn.satfinite.e4m3x2.f32``) where HW_CAST says so; no e4m3 byte tile
changes register layout between its cast and its store (a ``ttg.convert_layout`` of an i8 tile after
``tt.fp_to_fp`` stored wrong bytes on the GPU: kernels.fp8_quant's docstring); the K-major 128x1 variant moves
int32 words, has no 8-bit tensor at all and casts in inline PTX.

Run: python -m pytest tests/test_fp8_quant_compile.py -q
"""

import re

import pytest
import triton


def _compile_sm90(kernel, ints: dict, types: dict, const: dict, num_warps: int = 4):
    """kernel compiled for sm_90a as a launch with these integer arguments specializes it (1 -> constexpr,
    multiples of 16 and pointers -> divisible by 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    sig = {**types, **dict.fromkeys(const, "constexpr")}
    const = dict(const)
    divisible = {n for n, t in types.items() if t.startswith("*")}
    for n, v in ints.items():
        sig[n] = "constexpr" if v == 1 else "i32"
        if v == 1:
            const[n] = 1
        elif v % 16 == 0:
            divisible.add(n)
    assert set(sig) == set(names), set(names) ^ set(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=True))


BYTE_RELAYOUT = re.compile(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xi8, #[^>]*> -> ")


def test_kernels_compile_for_sm90():
    from megamoe.kernels import fp8_quant as k

    for hw in (True, False):
        for count, idx in ((False, False), (True, False), (False, True)):  # all rows, a device count, a gather
            c = _compile_sm90(k.quantize_1x128_kernel, dict(R=300, C=7168), X1_PTRS,
                              {"BLOCK_R": 32, "HW_CAST": hw, "HAS_COUNT": count, "HAS_IDX": idx})
            assert ("cvt.rn.satfinite.e4m3x2.f32" in c.asm["ptx"]) == hw


X1_PTRS = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "n_ptr": "*i32", "idx_ptr": "*i32"}
W_PTRS = {"w_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32"}
G_PTRS = {"x_ptr": "*bf16", "idx_ptr": "*i32", "offsets_ptr": "*i32", "block_offsets_ptr": "*i32", "q_ptr": "*u8",
          "s_ptr": "*fp32", "q1_ptr": "*u8", "s1_ptr": "*fp32"}


@pytest.mark.parametrize("width", (7168, 130, 1))
def test_byte_tiles_are_stored_from_the_layout_they_are_cast_in(width):
    """The specializations a launch makes (widths multiples of 16, not, and 1; the input's and output's pointers
    both 16-byte aligned, as the launchers ensure): the e4m3 bytes never change layout between the cast and the
    store (a ``ttg.convert_layout`` of the i8 tile, through shared memory, after ``tt.fp_to_fp``: a column-major
    load gave one, and on the GPU it stored wrong bytes)."""
    from megamoe.kernels import fp8_quant as k

    compiled = [_compile_sm90(k.quantize_1x128_kernel, dict(R=300, C=width), X1_PTRS,
                              {"BLOCK_R": 32, "HW_CAST": True, "HAS_COUNT": count, "HAS_IDX": idx})
                for count, idx in ((False, False), (True, False), (False, True))]
    compiled.append(_compile_sm90(k.quantize_128x128_kernel, dict(N=300, K=width), W_PTRS, {"HW_CAST": True},
                                  num_warps=8))
    for gather in (False, True) if width > 1 else (False,):  # one column is gathered by the launcher
        compiled.append(_compile_sm90(k.quantize_128x1_grouped_kernel, dict(C=width, num_experts=7, ld_q=128 * 9),
                                      G_PTRS, {"GATHER": gather, "E_POW2": 8, "BLOCK_C": 64, "KMAJOR": False,
                                               "ROWS_1X128": False, "HW_CAST": True}))
    for c in compiled:
        assert "tt.fp_to_fp" in c.asm["ttgir"] and not BYTE_RELAYOUT.search(c.asm["ttgir"]), c.name
    for gather in (False, True) if width > 1 else (False,):  # K-major: the cast in inline PTX, int32 words moved
        c = _compile_sm90(k.quantize_128x1_grouped_kernel, dict(C=width, num_experts=7, ld_q=128 * 9),
                          {**G_PTRS, "q_ptr": "*i32"}, {"GATHER": gather, "E_POW2": 8, "BLOCK_C": 64, "KMAJOR": True,
                                                       "ROWS_1X128": False, "HW_CAST": True})
        ttgir = c.asm["ttgir"]
        assert "tt.fp_to_fp" not in ttgir and not re.search(r"tensor<[0-9x]+xi8", ttgir), c.name
        assert "cvt.rn.satfinite.e4m3x2.f32" in c.asm["ptx"], c.name
        # and with the rows also quantized 1x128 from the same loads (128 columns a program, as launched): the row
        # bytes from the same inline-PTX cast, stored from the layout they are made in
        c = _compile_sm90(k.quantize_128x1_grouped_kernel, dict(C=width, num_experts=7, ld_q=128 * 9),
                          {**G_PTRS, "q_ptr": "*i32"}, {"GATHER": gather, "E_POW2": 8, "BLOCK_C": 128, "KMAJOR": True,
                                                       "ROWS_1X128": True, "HW_CAST": True}, num_warps=2)
        ttgir = c.asm["ttgir"]
        assert "tt.fp_to_fp" not in ttgir and not BYTE_RELAYOUT.search(ttgir), c.name
        assert "cvt.rn.satfinite.e4m3x2.f32" in c.asm["ptx"], c.name
