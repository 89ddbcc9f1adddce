"""Flags, bounded spins and the status word: the device-side helpers shared by the expert-parallel protocol
(megamoe.kernels.ep_comm) and the GEMM tiles that wait for a pull (megamoe.kernels.ep_tiles); ``@triton.jit``
code only.

A flag is an int32 word; its producer stores the data, then releases the flag (``atomic_xchg`` / a release
store). A consumer waits with a bounded spin of acquire reads (``atomic_add(flag, 0, sem="acquire")``): at
system scope for a peer's flag (NVLink), at GPU scope for one written on this GPU. The status word (word 1 of
an EP workspace's flags; word 0 is the epoch) records the first failure, ``stage << 24 | peer << 16 | epoch &
0xffff``, by compare-and-swap; a wait that finds it set returns at once, so a dead peer never hangs the stream
(``megamoe.distributed.EPWorkspace.check`` reads it; its STAGE_NAMES name the stages).
"""

import triton
import triton.language as tl

# stage codes of the status word (megamoe.distributed.STAGE_NAMES): the exchange's waits (ep_comm) write 1-4
STAGE_PLAN, STAGE_COMBINE, STAGE_BAD_ID, STAGE_OVERFLOW = 1, 2, 3, 4
STAGE_PULL: tl.constexpr = tl.constexpr(5)  # a GEMM tile waiting for the pull beside it (ep_tiles)


@triton.jit
def status_code(stage, peer, epoch):
    return (stage << 24) | ((peer & 0xFF) << 16) | (epoch & 0xFFFF)


@triton.jit
def spin(flag_ptr, target, status_ptr, max_iters, timeout_ns, USE_TIMER: tl.constexpr, SCOPE: tl.constexpr):
    """Bounded acquire spin (at ``SCOPE``) until ``*flag_ptr >= target``; stops early when the status word is
    set (an earlier wait failed). Returns True when it expired with the status word still clear."""
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    st = tl.load(status_ptr, volatile=True)
    it = 0
    if USE_TIMER:
        t0 = tl.extra.cuda.globaltimer()
    go = (v < target) & (st == 0)
    while go:
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        st = tl.load(status_ptr, volatile=True)
        it += 1
        if USE_TIMER:
            late = (tl.extra.cuda.globaltimer() - t0) > timeout_ns
        else:
            late = it > max_iters
        go = (v < target) & (st == 0) & (late == 0)
    return (v < target) & (st == 0)


@triton.jit
def wait_at_least(flag_ptr, target, status_ptr, code, max_iters, timeout_ns, USE_TIMER: tl.constexpr):
    """Bounded acquire spin at system scope until ``*flag_ptr >= target``; on expiry record ``code`` in the
    status word. Returns immediately when the status word is already set (an earlier wait failed)."""
    if spin(flag_ptr, target, status_ptr, max_iters, timeout_ns, USE_TIMER, "sys"):
        tl.atomic_cas(status_ptr, 0, code, sem="relaxed", scope="gpu")


@triton.jit
def wait_flag_gpu(flag_ptr, target, flags_ptr, rank, stage, max_iters, timeout_ns, USE_TIMER: tl.constexpr):
    """Bounded acquire spin (GPU scope: the writer runs on this GPU) until ``*flag_ptr >= target``. On expiry
    the status word ``flags_ptr[1]`` gets ``stage`` with this rank and the current epoch ``flags_ptr[0]``
    (first error wins); a status already set returns at once. The result of the caller's work is then
    garbage, and ``EPWorkspace.check`` raises."""
    if tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") < target:  # the flag mostly is already set
        if spin(flag_ptr, target, flags_ptr + 1, max_iters, timeout_ns, USE_TIMER, "gpu"):
            code = status_code(stage, rank, tl.load(flags_ptr))
            tl.atomic_cas(flags_ptr + 1, 0, code, sem="relaxed", scope="gpu")


@triton.jit
def fence_proxy_async_global():
    """``fence.proxy.async.global`` in every thread (GPU only: inline PTX): orders this thread's global memory
    accesses through the generic proxy before it with the async proxy's (TMA) after it, and the other way
    round (PTX ISA, memory consistency model, "proxies")."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)
