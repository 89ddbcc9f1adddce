"""The EP pull and push kernels compiled for sm_90a on the CPU: with aligned pools (``EPWorkspace.aligned``) the
row copies are 16-byte vector loads and stores; without the alignment promise the compiler reads rows from a
peer two bytes at a time (an address loaded from the pointer table carries no alignment), which is what this
guards against. Speed itself is measured on the GPU (docs/perf.md). Also: the schedule kernel,
with its bounded waits and the round-table loop, builds for sm_90a."""

import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")


def _ptx(kernel, sig: dict, const: dict, divisible: tuple, text: bool = False, num_warps: int = 4):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    assert set(sig) == set(names), set(names) ^ set(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    c = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, enable_fp_fusion=True))
    if text:
        return c.asm["ptx"]
    return Counter(re.findall(r"(ld\.global[\.\w:]*|st\.global[\.\w:]*)", c.asm["ptx"]))


_DISPATCH_SIG = {"ptrs_ptr": "*i64", "sched_ptr": "*i32", "rowtab_ptr": "*i32", "roff_ptr": "*i32", "xr_ptr": "*bf16",
                 "gr_ptr": "*bf16", "wr_ptr": "*fp32", "ready_ptr": "*i32", "round_idx": "i32", "C": "i32", "D": "i32",
                 "K": "i32", "L": "i32", "SORTED_OFF": "i64", "WEIGHTS_OFF": "i64", "ROWS_OFF": "i64",
                 "CH1_ELEMS": "i64"}
_DISPATCH_DIV = ("ptrs_ptr", "sched_ptr", "rowtab_ptr", "roff_ptr", "xr_ptr", "gr_ptr", "wr_ptr", "ready_ptr", "C",
                 "D", "SORTED_OFF", "WEIGHTS_OFF", "ROWS_OFF", "CH1_ELEMS")


@pytest.mark.parametrize("bwd,pull_x", [(False, True), (True, True), (True, False)])  # (True, False): x rows kept
@pytest.mark.parametrize("aligned", [False, True])
def test_pull_rows_in_16_byte_vectors_when_aligned(bwd, pull_x, aligned):
    from megamoe.kernels.ep_comm import ep_dispatch_kernel

    const = dict(W=2, E=256, E_PAD=256, L_PAD=256, BM=32, BD=256, BWD=bwd, ALIGNED=aligned, PULL_X=pull_x,
                 READY=False, PDL=False)
    ops = _ptx(ep_dispatch_kernel, _DISPATCH_SIG, const, _DISPATCH_DIV)
    copies = int(pull_x) + int(bwd)  # x rows (unless kept) and the backward's output-gradient rows
    assert ops["st.global.v4.b32"] == 8 * copies, ops  # 32 x 256 bf16 per step over 128 threads
    if aligned:
        assert ops["ld.global.v4.b32"] == 8 * copies and ops["ld.global.b16"] == 0, ops
    else:
        assert ops["ld.global.b16"] == 64 * copies, ops  # what the alignment promise removes


@pytest.mark.parametrize("bwd", [False, True])
def test_pull_beside_a_gemm_flags_its_blocks_and_lets_the_gemm_launch(bwd):
    """READY + PDL (EPOptions.pull_programs): the same 16-byte row copies, one release store of a block's flag
    at GPU scope after a CTA barrier, ``griddepcontrol.launch_dependents`` (the GEMM beside it may launch);
    without them neither appears."""
    from megamoe.kernels.ep_comm import ep_dispatch_kernel
    from megamoe.ops.ep_comm import _BD_BESIDE, _NW_BESIDE

    const = dict(W=2, E=256, E_PAD=256, L_PAD=256, BM=32, BD=256, BWD=bwd, ALIGNED=True, PULL_X=True,
                 READY=False, PDL=False)
    beside = {**const, "READY": True, "PDL": True, "BD": _BD_BESIDE}  # its launch: 32 x 1024 with 16 warps
    ptx = _ptx(ep_dispatch_kernel, _DISPATCH_SIG, beside, _DISPATCH_DIV, text=True, num_warps=_NW_BESIDE)
    plain = _ptx(ep_dispatch_kernel, _DISPATCH_SIG, const, _DISPATCH_DIV, text=True)
    copies = 1 + int(bwd)  # 32 x 1024 bf16 per step over 512 threads: 8 vectors each, as the full grid's
    assert ptx.count("st.global.v4.b32") == 8 * copies and ptx.count("ld.global.v4.b32") == 8 * copies
    assert len(re.findall(r"atom\.global\.(release\.gpu|gpu\.release)\.exch", ptx)) == 1, "one flag store per block"
    assert "griddepcontrol.launch_dependents" in ptx
    assert "griddepcontrol" not in plain and "exch" not in plain


@pytest.mark.parametrize("aligned", [False, True])
def test_push_rows_in_16_byte_vectors_when_aligned(aligned):
    from megamoe.kernels.ep_comm import ep_push_kernel

    sig = {"ptrs_ptr": "*i64", "sched_ptr": "*i32", "rowtab_ptr": "*i32", "y_ptr": "*bf16", "dot_ptr": "*fp32",
           "round_idx": "i32", "C": "i32", "D": "i32", "K": "i32", "L": "i32", "P": "i32", "SLOTS_OFF": "i64",
           "DOTS_OFF": "i64"}
    const = dict(E=256, BM=32, BD=256, HAS_DOT=False, P_POW2=2, HAS_ROWS=True, ALIGNED=aligned)
    ops = _ptx(ep_push_kernel, sig, const, ("ptrs_ptr", "sched_ptr", "rowtab_ptr", "y_ptr", "dot_ptr", "C", "D",
                                            "SLOTS_OFF", "DOTS_OFF"))
    assert ops["ld.global.v4.b32"] == 8, ops
    if aligned:
        assert ops["st.global.v4.b32"] == 8 and ops["st.global.b16"] == 0, ops
    else:
        assert ops["st.global.b16"] == 64, ops


@pytest.mark.parametrize("use_timer", [False, True])
def test_schedule_kernel_builds_for_sm90(use_timer):
    """The schedule kernel's loops (bounded waits, the round table's cuts and fill) compile for Hopper: the
    interpreter tests run the same code but not this compiler. Waits are acquire loads at system scope."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megamoe.kernels.ep_comm import ep_schedule_kernel

    names = list(ep_schedule_kernel.arg_names)
    sig = {"ptrs_ptr": "*i64", "flags_ptr": "*i32", "sched_ptr": "*i32", "rank": "i32", "L": "i32", "C": "i32",
           "rounds": "i32", "max_iters": "i32", "timeout_ns": "i64", "PLAN_OFF": "i64"}
    const = dict(READY=16, W=8, E=256, W_PAD=8, E_PAD=256, L_PAD=64, USE_TIMER=use_timer, FILL=64)
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    assert set(sig) == set(names), set(names) ^ set(sig)
    c = triton.compile(ASTSource(ep_schedule_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, enable_fp_fusion=True))
    ptx = c.asm["ptx"]
    assert "ld.global.sys.acquire.b32" in ptx, "the flag waits must be acquire loads at system scope"
    assert ("globaltimer" in ptx) == use_timer
