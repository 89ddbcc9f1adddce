"""Host-side choice of torch._grouped_mm for the plain m-grouped GEMMs (CPU; no GPU needed).

Proves: the tile table asks for it exactly for the measured case (down / dgrad dx, bf16, N <= 2048) and an
explicit override still wins; the operand conditions refuse what the kernel cannot take with the Triton
kernel's bits (other dtypes, gathered / scaled rows, a preallocated output, misaligned or strided rows, N or K
not a multiple of 8, empty A); MEGAMOE_TORCH_MM=0 and CPU tensors turn it off. The equality of its rows with
the Triton kernel's is a GPU measurement (tests/test_torch_grouped_mm_gpu.py, the layer's bit-invariance test).
"""

import torch

from megamoe.ops import GemmConfig, m_grouped_config, tile_config
from megamoe.ops.torch_grouped_mm import operands_fit, torch_grouped_mm_eligible

BF = torch.bfloat16


def test_table_picks_torch_for_the_measured_plain_gemms():
    for kind, n, k in [("down", 2048, 768), ("dgrad", 2048, 1536), ("down", 256, 192), ("dgrad", 64, 64)]:
        assert m_grouped_config(kind, n, k, BF, interpret=False).torch_mm, (kind, n, k)
    for kind, n, k in [("down", 7168, 2048), ("dgrad", 7168, 4096), ("gate_up", 768, 2048),
                       ("dgrad_swiglu", 768, 2048)]:
        assert not m_grouped_config(kind, n, k, BF, interpret=False).torch_mm, (kind, n, k)
    assert not m_grouped_config("down", 2048, 768, torch.float16, interpret=False).torch_mm
    assert not m_grouped_config("down", 2048, 768, torch.float32, interpret=False).torch_mm
    assert not m_grouped_config("down", 2048, 768, BF, interpret=True).torch_mm
    # the tiles stay the Triton kernel's (its fallback when the operands do not fit)
    cfg = m_grouped_config("down", 2048, 768, BF, interpret=False)
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 256, 64)


def test_override_wins():
    saved = dict(tile_config._OVERRIDES)
    try:
        tile_config._OVERRIDES[("down", 2048, 768)] = GemmConfig(128, 128, 64, 8, 4)
        assert not m_grouped_config("down", 2048, 768, BF, interpret=False).torch_mm
    finally:
        tile_config._OVERRIDES.clear()
        tile_config._OVERRIDES.update(saved)


def test_operand_conditions():
    a = torch.empty(300, 768, dtype=BF)
    w2 = torch.empty(4, 2048, 768, dtype=BF)  # nt: (E, N, K)
    w13 = torch.empty(4, 768, 2048, dtype=BF)  # nn: (E, K, N)
    assert operands_fit(a, w2, True, BF)
    assert operands_fit(a, w13, False, BF)
    assert not operands_fit(a, w13, True, BF)  # K mismatch read as nt
    assert not operands_fit(a, w2, True, torch.float32)
    assert not operands_fit(a.half(), w2.half(), True, torch.float16)
    assert not operands_fit(a[:0], w2, True, BF)
    assert not operands_fit(torch.empty(300, 776, dtype=BF)[:, :768], w2, True, BF)  # strided rows
    assert operands_fit(torch.empty(300, 776, dtype=BF)[:, :768].contiguous(), w2, True, BF)
    assert not operands_fit(torch.empty(300, 770, dtype=BF)[:, 2:], w2, True, BF)  # misaligned base
    assert not operands_fit(a, w2.transpose(1, 2).contiguous().transpose(1, 2), True, BF)  # B not contiguous
    assert not operands_fit(torch.empty(300, 764, dtype=BF), torch.empty(4, 2048, 764, dtype=BF), True, BF)  # K % 8
    assert not operands_fit(a, torch.empty(4, 2044, 768, dtype=BF), True, BF)  # N % 8


def test_refused_off_gpu_and_when_turned_off(monkeypatch):
    a, w2 = torch.empty(300, 768, dtype=BF), torch.empty(4, 2048, 768, dtype=BF)
    kw = dict(gathered=False, scaled=False, has_out=False)
    assert not torch_grouped_mm_eligible(a, w2, True, BF, **kw)  # CPU tensors
    for bad in ("gathered", "scaled", "has_out"):
        assert not torch_grouped_mm_eligible(a, w2, True, BF, **(kw | {bad: True}))
    monkeypatch.setenv("MEGAMOE_TORCH_MM", "0")
    from megamoe.ops.torch_grouped_mm import torch_grouped_mm_enabled
    assert not torch_grouped_mm_enabled()
