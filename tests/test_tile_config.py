"""The tile table and the host-side choice of the operand load path (pure host logic, runs on CPU).

Proves: configs are a pure function of (kind, N, K, dtype) (weight gradients: also of a host-side
rows-per-expert estimate, which moves only the kernel structure, never block_k); block sizes are
validated; the TMA descriptor is used only where it is safe (bf16/fp16, 16-byte aligned rows, and for
"nn" weights only when BLOCK_K divides K, so a tile never reaches into the next expert's K rows) and
pointer loads are the fallback everywhere else (fp32, misaligned rows, odd K).
"""

import pytest
import torch

from megamoe.ops import GemmConfig, k_grouped_config, m_grouped_config
from megamoe.ops.grouped_gemm import _weight_descriptor

BF16 = torch.bfloat16


def test_table_is_pure_function_of_shape():
    for kind in ("gate_up", "down", "dgrad_swiglu", "dgrad"):
        a = m_grouped_config(kind, 2048, 7168, BF16, interpret=False)
        assert a == m_grouped_config(kind, 2048, 7168, BF16, interpret=False)
        assert m_grouped_config(kind, 2048, 7168, torch.float32, interpret=False).tma_b is False
        assert m_grouped_config(kind, 2048, 7168, BF16, interpret=True).tma_b is False
    assert k_grouped_config(4096, 7168, BF16, interpret=False) == k_grouped_config(4096, 7168, BF16, interpret=False)
    # weight gradients: few rows per expert -> the resident kernel, sized for 1.25x the estimate; many
    # rows, no estimate, or fp32 -> the per-tile kernel; block_k (the only bit-relevant field) never moves
    few = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=128)
    assert few.resident_chunks == 3 and few.block_k == 64 and few.num_stages == 3
    assert k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=40).resident_chunks == 1
    for many in (None, 0, 400, 4096):
        cfg = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=many)
        assert cfg.resident_chunks == 0 and cfg.block_k == 64 and not cfg.gluon
    # ~160-384 rows per expert: the persistent Gluon kernel (P on chip up to 5 chunks); its launcher falls
    # back to the Triton entry (allow_gluon=False) where the device or operands do not allow it
    for mid in (160, 256, 384):
        cfg = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=mid)
        assert cfg.gluon and cfg.resident_chunks == 5 and cfg.block_k == 64
        fallback = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=mid, allow_gluon=False)
        assert not fallback.gluon and fallback.resident_chunks == 0 and fallback.block_k == 64
    assert not k_grouped_config(4096, 7168, BF16, interpret=True, rows_per_group=256).gluon
    assert not k_grouped_config(4096, 7168, torch.float32, interpret=False, rows_per_group=256).gluon
    assert k_grouped_config(4096, 7168, torch.float32, interpret=False, rows_per_group=128).resident_chunks == 0
    assert k_grouped_config(64, 64, torch.float32, interpret=True, rows_per_group=10).resident_chunks == 1
    with pytest.raises(ValueError, match="resident_chunks"):
        GemmConfig(128, 128, 64, 8, 2, resident_chunks=5)
    with pytest.raises(ValueError, match="unknown kind"):
        m_grouped_config("nope", 1, 1, BF16, interpret=False)
    with pytest.raises(ValueError, match="powers of two"):
        GemmConfig(96, 128, 64, 8, 3)


def test_weight_descriptor_choice():
    tma = GemmConfig(128, 128, 64, 8, 3, tma_b=True)
    E, F, D = 3, 192, 256
    w13 = torch.zeros(E, 2 * F, D, dtype=BF16)  # "nt": B[e] stored (N, K) = (2F, D)
    mode, desc, rows = _weight_descriptor(tma, w13, (2 * F * D, D, 1), D, fp32_dot=False)
    assert mode == 1 and rows == 2 * F and list(desc.shape) == [E * 2 * F, D]
    assert list(desc.block_shape) == [128, 64]
    # "nn": B[e] stored (K, N); K = 2F = 384 is a multiple of BLOCK_K 64 -> TMA, tiles (BLOCK_K, BLOCK_N)
    mode, desc, rows = _weight_descriptor(tma, w13, (2 * F * D, 1, D), 2 * F, fp32_dot=False)
    assert mode == 2 and list(desc.shape) == [E * 2 * F, D] and list(desc.block_shape) == [64, 128]
    # "nn" with K not a multiple of BLOCK_K: a tile would read the next expert's rows -> pointer loads
    odd = torch.zeros(E, 200, D, dtype=BF16)
    assert _weight_descriptor(tma, odd, (200 * D, 1, D), 200, fp32_dot=False)[0] == 0
    # fp32 dots, fp32 weights, rows that are not 16-byte multiples, or a config without tma_b -> pointer loads
    assert _weight_descriptor(tma, w13, (2 * F * D, D, 1), D, fp32_dot=True)[0] == 0
    assert _weight_descriptor(tma, w13.float(), (2 * F * D, D, 1), D, fp32_dot=False)[0] == 0
    narrow = torch.zeros(E, 2 * F, 36, dtype=BF16)  # 72-byte rows
    assert _weight_descriptor(tma, narrow, (2 * F * 36, 36, 1), 36, fp32_dot=False)[0] == 0
    assert _weight_descriptor(GemmConfig(128, 128, 64, 8, 3), w13, (2 * F * D, D, 1), D, fp32_dot=False)[0] == 0
