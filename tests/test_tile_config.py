"""The tile table and the host-side choice of the operand load path (pure host logic, runs on CPU).

Proves: configs are a pure function of (kind, N, K, dtype) (weight gradients: also of a host-side rows-per-expert
estimate, which moves only the kernel structure, never block_k) and of the KernelConfig passed in (never of the
environment); block sizes are validated; the TMA descriptor is used only where it is safe (bf16/fp16, 16-byte
aligned rows, and for "nn" weights only when BLOCK_K divides K, so a tile never reaches into the next expert's K
rows) and pointer loads are the fallback everywhere else (fp32, misaligned rows, odd K).
"""

import pytest
import torch

from megamoe.config import KernelConfig
from megamoe.ops import GemmConfig, k_grouped_config, m_grouped_config, tile_config
from megamoe.ops.grouped_gemm import weight_descriptor

BF16 = torch.bfloat16


def test_table_is_pure_function_of_shape(monkeypatch):
    for name in ("MEGAMOE_TILES", "MEGAMOE_TORCH_WGRAD", "MEGAMOE_GLUON"):  # former switches: no effect
        monkeypatch.setenv(name, "nonsense")
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
    for many in (None, 0, 300, 4096):
        cfg = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=many, allow_torch=False)
        assert cfg.resident_chunks == 0 and cfg.block_k == 64 and not cfg.gluon and not cfg.torch_mm
    # more rows than the resident window, bf16: torch._grouped_mm (tests/test_torch_wgrad.py has the rest)
    for many in (155, 160, 256, 300, 4096):
        assert k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=many).torch_mm
    # without it, ~160-256 rows per expert: the persistent Gluon kernel (P on chip up to 5 chunks = 1.25 x 256
    # rows); its launcher falls back to the Triton entry (allow_gluon=False) where the device or operands do not
    # allow it
    for mid in (160, 256):
        cfg = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=mid, allow_torch=False)
        assert cfg.gluon and cfg.resident_chunks == 5 and cfg.block_k == 64
        fallback = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=mid, allow_gluon=False,
                                    allow_torch=False)
        assert not fallback.gluon and fallback.resident_chunks == 0 and fallback.block_k == 64
    assert not k_grouped_config(4096, 7168, BF16, interpret=True, rows_per_group=256).gluon
    assert not k_grouped_config(4096, 7168, torch.float32, interpret=False, rows_per_group=256).gluon
    assert k_grouped_config(4096, 7168, torch.float32, interpret=False, rows_per_group=128).resident_chunks == 0
    assert k_grouped_config(64, 64, torch.float32, interpret=True, rows_per_group=10).resident_chunks == 1
    # fp32 GEMMs (the router's): the weight gradient gets half-height tiles when it has few outputs (Qwen3's
    # [E 128, D 2048]) so that it spans the SMs, and 32 x 32 otherwise; logits ("down") and dx ("dgrad") their
    # own tiles; BLOCK_K (the reduction order, hence the bits) is the fp32 table's everywhere
    for (m, n), want in {(128, 2048): (32, 64), (256, 7168): (32, 32), (1536, 2048): (32, 32)}.items():
        cfg = k_grouped_config(m, n, torch.float32, interpret=False, rows_per_group=16384)
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (*want, tile_config._FP32.block_k), (m, n, cfg)
    for kind, want in {"down": (64, 128, 2), "dgrad": (128, 64, 2), "gate_up": (64, 64, 1),
                       "dgrad_swiglu": (64, 64, 1)}.items():
        cfg = m_grouped_config(kind, 128, 2048, torch.float32, interpret=False)
        assert (cfg.block_m, cfg.block_n, cfg.programs_per_sm, cfg.block_k) == (*want, 32), (kind, cfg)
    with pytest.raises(ValueError, match="resident_chunks"):
        GemmConfig(128, 128, 64, 8, 2, resident_chunks=5)
    with pytest.raises(ValueError, match="unknown kind"):
        m_grouped_config("nope", 1, 1, BF16, interpret=False)
    with pytest.raises(ValueError, match="powers of two"):
        GemmConfig(96, 128, 64, 8, 3)


def test_kernel_config_entries_win_over_the_table():
    """A (kind, a, b) entry wins at its shape, a kind's entry at every other shape of the kind; no entry: the
    table. The table's own Gluon entry is not an explicit one (the launcher may then fall back below one unit
    per SM)."""
    cfg = GemmConfig(128, 128, 64, 8, 5, resident_chunks=5, gluon=True)
    kc = KernelConfig({("wgrad", 1536, 2048): cfg})
    assert kc.tile("wgrad", 1536, 2048) is cfg and kc.tile("wgrad", 2048, 1536) is None
    assert KernelConfig().tile("wgrad", 1536, 2048) is None
    assert k_grouped_config(1536, 2048, BF16, interpret=False, kernel_config=kc) is cfg  # the entry wins
    assert k_grouped_config(1536, 2048, BF16, interpret=False, kernel_config=kc, allow_gluon=False) != cfg
    table = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=200, allow_torch=False, kernel_config=kc)
    assert table.gluon and kc.tile("wgrad", 4096, 7168) is None
    both = KernelConfig({"down": GemmConfig(128, 128, 64, 8, 3), ("down", 2048, 768): GemmConfig(128, 64, 64, 4, 3)})
    assert m_grouped_config("down", 2048, 768, BF16, interpret=False, kernel_config=both).block_n == 64
    assert m_grouped_config("down", 7168, 2048, BF16, interpret=False, kernel_config=both).block_n == 128
    assert hash(both) == hash(KernelConfig(both.tiles)) and both == KernelConfig(both.tiles)


@pytest.mark.parametrize("tiles, err, match", [
    ({"nope": GemmConfig(128, 128, 64, 8, 3)}, ValueError, "tile key 'nope'"),
    ({("down", 0, 768): GemmConfig(128, 128, 64, 8, 3)}, ValueError, "positive ints"),
    ({("down", 2048): GemmConfig(128, 128, 64, 8, 3)}, ValueError, "tile key"),
    ({"down": (128, 128, 64, 8, 3)}, TypeError, "must be a GemmConfig"),
    ({"down": GemmConfig(128, 128, 64, 8, 3, torch_mm=True)}, ValueError, "weight-gradient"),
    ({"gate_up": GemmConfig(128, 128, 64, 8, 3, gluon=True)}, ValueError, "weight-gradient"),
    ((("down", GemmConfig(128, 128, 64, 8, 3)), ("down", GemmConfig(128, 256, 64, 8, 3))), ValueError, "twice"),
    ((("down",),), TypeError, "must map"),
])
def test_kernel_config_rejects_bad_entries(tiles, err, match):
    with pytest.raises(err, match=match):
        KernelConfig(tiles)


def test_weight_descriptor_choice():
    tma = GemmConfig(128, 128, 64, 8, 3, tma_b=True)
    E, F, D = 3, 192, 256
    w13 = torch.zeros(E, 2 * F, D, dtype=BF16)  # "nt": B[e] stored (N, K) = (2F, D)
    mode, desc, rows = weight_descriptor(tma, w13, (2 * F * D, D, 1), D, fp32_dot=False)
    assert mode == 1 and rows == 2 * F and list(desc.shape) == [E * 2 * F, D]
    assert list(desc.block_shape) == [128, 64]
    # "nn": B[e] stored (K, N); K = 2F = 384 is a multiple of BLOCK_K 64 -> TMA, tiles (BLOCK_K, BLOCK_N)
    mode, desc, rows = weight_descriptor(tma, w13, (2 * F * D, 1, D), 2 * F, fp32_dot=False)
    assert mode == 2 and list(desc.shape) == [E * 2 * F, D] and list(desc.block_shape) == [64, 128]
    # "nn" with K not a multiple of BLOCK_K: a tile would read the next expert's rows -> pointer loads
    odd = torch.zeros(E, 200, D, dtype=BF16)
    assert weight_descriptor(tma, odd, (200 * D, 1, D), 200, fp32_dot=False)[0] == 0
    # fp32 dots, fp32 weights, rows that are not 16-byte multiples, or a config without tma_b -> pointer loads
    assert weight_descriptor(tma, w13, (2 * F * D, D, 1), D, fp32_dot=True)[0] == 0
    assert weight_descriptor(tma, w13.float(), (2 * F * D, D, 1), D, fp32_dot=False)[0] == 0
    narrow = torch.zeros(E, 2 * F, 36, dtype=BF16)  # 72-byte rows
    assert weight_descriptor(tma, narrow, (2 * F * 36, 36, 1), 36, fp32_dot=False)[0] == 0
    assert weight_descriptor(GemmConfig(128, 128, 64, 8, 3), w13, (2 * F * D, D, 1), D, fp32_dot=False)[0] == 0


def test_gluon_operand_conditions():
    """What may reach the Gluon weight-gradient kernel (ops.wgrad_gluon.operands_fit, pure host logic): 16-bit
    P and Q of one dtype, 16-bit or fp32 C (fp32 only with 128-wide tiles), contiguous C, M and N multiples
    of 16, row strides multiples of 16 elements, 16-byte aligned bases, and enough (expert, m-tile) units."""
    from megamoe.ops.wgrad_gluon import gluon_wgrad_eligible, operands_fit

    cfg = GemmConfig(128, 128, 64, 8, 5, resident_chunks=5, gluon=True)
    wide = GemmConfig(128, 256, 64, 8, 3, resident_chunks=4, gluon=True)
    E, M, N, R = 4, 256, 384, 100
    p, q = torch.zeros(R, M, dtype=BF16), torch.zeros(R, N, dtype=BF16)
    c = torch.empty(E, M, N, dtype=BF16)
    assert operands_fit(cfg, p, q, c, min_units=8)            # 4 experts x 2 m-tiles = 8 units
    assert not operands_fit(cfg, p, q, c, min_units=9)        # fewer units than asked for (SMs)
    assert operands_fit(cfg, p, q, c.float(), min_units=1)    # fp32 output with 128-wide tiles
    assert not operands_fit(wide, p, q, c.float(), min_units=1)  # ... not with 128x256 (its epilogue spills)
    assert not operands_fit(cfg, p.float(), q.float(), c, min_units=1)
    assert not operands_fit(cfg, p, q.half(), c, min_units=1)
    assert not operands_fit(cfg, p, q, c.transpose(1, 2).contiguous().transpose(1, 2), min_units=1)
    odd = torch.zeros(R, 200, dtype=BF16)                      # N = 200: not a multiple of 16
    assert not operands_fit(cfg, p, odd, torch.empty(E, M, 200, dtype=BF16), min_units=1)
    padded = torch.zeros(R, N + 8, dtype=BF16)[:, :N]          # row stride 392: not a multiple of 16
    assert not operands_fit(cfg, p, padded, c, min_units=1)
    shifted = torch.zeros(R * N + 8, dtype=BF16)[8:].view(R, N)  # base 16 bytes past an aligned one: fine
    assert operands_fit(cfg, p, shifted, c, min_units=1)
    shifted4 = torch.zeros(R * N + 4, dtype=BF16)[4:].view(R, N)  # 8 bytes past: cp.async needs 16
    assert not operands_fit(cfg, p, shifted4, c, min_units=1)
    # CPU tensors never take the Gluon path (the Triton kernels run, under the interpreter)
    assert not gluon_wgrad_eligible(cfg, p, q, c)


def test_k_grouped_mm_gluon_fallback_gives_the_triton_sums():
    """When the table picks the Gluon kernel but it cannot run (here: CPU tensors under the interpreter),
    k_grouped_mm runs the Triton kernels with their own table entry (allow_gluon=False): the same result as
    the Triton path, never a Triton launch with the Gluon config's stages / chunks. The table's choice is
    simulated by patching k_grouped_config in the launcher module (the interpreter never picks Gluon)."""
    import os
    import subprocess
    import sys

    code = """
import torch
from megamoe.ops import GemmConfig, grouped_gemm, k_grouped_mm
g = torch.Generator().manual_seed(0)
counts = [0, 3, 17, 40, 1]
off = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
p, q = torch.randn(sum(counts), 32, generator=g), torch.randn(sum(counts), 48, generator=g)
base = k_grouped_mm(p, q, off)
real = grouped_gemm.k_grouped_config
calls = []
def table(*a, allow_gluon=True, **k):
    calls.append(allow_gluon)
    return GemmConfig(128, 128, 64, 8, 5, resident_chunks=5, gluon=True) if allow_gluon else real(*a, **k)
grouped_gemm.k_grouped_config = table
got = k_grouped_mm(p, q, off)
assert calls == [True, False], calls
assert torch.equal(got, base), (got - base).abs().max()
ref = torch.stack([p[a:b].double().T @ q[a:b].double() for a, b in zip(off[:-1].tolist(), off[1:].tolist())])
torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_parsed_tiles_replace_a_kind_at_every_shape():
    from megamoe.ops import tile_config
    kc = KernelConfig(tile_config.parse_tiles(" dgrad_swiglu:128,256,64,8,3,tma_b=1 ; wgrad:128,256,64,8,2 "))
    want = GemmConfig(128, 256, 64, 8, 3, tma_b=True)
    for n, k in ((768, 2048), (2048, 7168)):
        assert m_grouped_config("dgrad_swiglu", n, k, BF16, interpret=False, kernel_config=kc) == want
    wgrad = k_grouped_config(4096, 7168, BF16, interpret=False, rows_per_group=128, kernel_config=kc)
    assert wgrad == GemmConfig(128, 256, 64, 8, 2)
    assert kc.tile("wgrad", 4096, 7168) is wgrad  # the launcher sees it as asked for
    # other kinds, fp32 and the interpreter keep the table
    assert m_grouped_config("down", 2048, 768, BF16, interpret=False, kernel_config=kc) == \
        tile_config._M_GROUPED_BF16["down"]
    assert m_grouped_config("dgrad_swiglu", 768, 2048, torch.float32, interpret=False, kernel_config=kc) == \
        tile_config._FP32
    assert m_grouped_config("dgrad_swiglu", 768, 2048, BF16, interpret=True, kernel_config=kc) == \
        tile_config._INTERPRET
    # a (kind, N, K) entry wins over the kind's
    kc2 = KernelConfig({**dict(kc.tiles), ("dgrad_swiglu", 768, 2048): GemmConfig(128, 128, 64, 8, 2)})
    assert m_grouped_config("dgrad_swiglu", 768, 2048, BF16, interpret=False, kernel_config=kc2) == \
        GemmConfig(128, 128, 64, 8, 2)
    assert m_grouped_config("dgrad_swiglu", 2048, 7168, BF16, interpret=False) == \
        tile_config._M_GROUPED_BF16["dgrad_swiglu"]


@pytest.mark.parametrize("text, match", [
    ("nope:128,128,64,8,3", "kind one of"),
    ("down", "kind one of"),
    ("down:128,128,64,8", "five integers"),
    ("down:128,128,64,8,x", "five integers"),
    ("down:128,128,64,8,3,tma_b=2", "five integers"),
    ("down:128,128,64,8,3,colour=1", "five integers"),
    ("down:128,128,32,8,3", "BLOCK_K must stay 64 for down"),      # would change the bits
    ("wgrad:128,128,128,8,3", "BLOCK_K must stay 64 for wgrad"),
    ("down:128,96,64,8,3", "powers of two"),
    ("down:128,128,64,8,3;down:128,256,64,8,3", "given twice"),
])
def test_parse_tiles_rejects_bad_entries(text, match):
    from megamoe.ops import tile_config
    with pytest.raises(ValueError, match=match):
        tile_config.parse_tiles(text)


def test_dgrad_swiglu_entry_depends_on_gathered_rows():
    """dgrad + SwiGLU: TMA for A and B when dY's rows are contiguous, pointer loads when they are gathered
    (measured, tile_config); an explicit KernelConfig entry wins in both; other kinds ignore it."""
    rows = m_grouped_config("dgrad_swiglu", 768, 2048, BF16, interpret=False)
    gathered = m_grouped_config("dgrad_swiglu", 768, 2048, BF16, interpret=False, gathered=True)
    assert rows.tma_a and rows.tma_b and not gathered.tma_a and not gathered.tma_b
    assert rows.block_k == gathered.block_k and rows.block_n == gathered.block_n  # same bits, same row-dot count
    for kind in ("gate_up", "down", "dgrad"):
        assert m_grouped_config(kind, 768, 2048, BF16, interpret=False, gathered=True) == \
            m_grouped_config(kind, 768, 2048, BF16, interpret=False)
    kc = KernelConfig({"dgrad_swiglu": GemmConfig(128, 256, 64, 8, 3, tma_b=True)})
    assert m_grouped_config("dgrad_swiglu", 768, 2048, BF16, interpret=False, gathered=True,
                            kernel_config=kc).block_n == 256


def test_reserve_sms_shrinks_persistent_grids_in_this_thread_only(monkeypatch):
    """ops._common.reserve_sms (the EP path's shared expert beside the exchange): persistent grids inside the
    block leave n SMs free, at least one program remains, the largest of nested reservations holds, the
    reservation ends with the block (also on an exception) and does not reach other threads (the autograd
    engine's backward thread); a bad n raises."""
    import threading

    from megamoe.ops import _common

    monkeypatch.setattr(_common, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    kernel = object()  # not an interpreted kernel: the grid follows the SM budget

    def grid(bound=10_000, per_sm=1):
        return _common.persistent_programs(dev, kernel, bound, per_sm)

    assert grid() == 132 and grid(per_sm=2) == 264 and grid(bound=7) == 7
    seen = []
    with _common.reserve_sms(16):
        assert grid() == 116 and grid(per_sm=2) == 232 and _common.sm_budget(dev) == 116
        with _common.reserve_sms(8):
            assert grid() == 116
        with _common.reserve_sms(40):
            assert grid() == 92
        assert grid() == 116
        t = threading.Thread(target=lambda: seen.append(grid()))
        t.start()
        t.join()
    assert seen == [132] and grid() == 132
    with _common.reserve_sms(500):
        assert grid() == 1
    with pytest.raises(RuntimeError), _common.reserve_sms(16):
        raise RuntimeError("inside")
    assert grid() == 132
    for bad in (-1, 1.5, True, "16"):
        with pytest.raises(ValueError, match="reserve_sms"), _common.reserve_sms(bad):
            pass


def test_ws_wgrad_window():
    """The warp-specialized weight gradient replaces torch's kernel only where it was measured level or faster
    (contiguous rows, ~256 per expert; window up to 384), never at ~1024 rows (qwen3, where torch's dW2 was
    faster) or without an estimate; it keeps block_k 64, the reduction order of every other wgrad kernel."""
    from megamoe.ops import tile_config

    cfg = tile_config.ws_wgrad_config(256)
    assert cfg is not None and cfg.gluon and cfg.warp_specialized and cfg.block_k == 64
    assert tile_config.ws_wgrad_config(384) is cfg
    assert tile_config.ws_wgrad_config(1024) is None and tile_config.ws_wgrad_config(None) is None
    assert tile_config.ws_wgrad_config(0) is None
