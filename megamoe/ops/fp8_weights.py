"""The FP8 routed experts' weights, quantized to 128x128 blocks once per weight version and reused.

Legend: E experts, N x K one expert's weight (w13: N = 2F, K = D; w2: N = D, K = F), NB = ceil(N / 128),
KB = ceil(K / 128).

A weight changes once per optimizer step but is read by every micro-batch's forward (and, transposed, by its
input-gradient GEMM): quantizing it once per step instead of once per layer call saves a pass over the weights
per micro-batch. :class:`Fp8WeightCache` keeps, per weight tensor (weakly: an entry goes with its tensor),
the blocks ``(q_ENK e4m3, s_E_NB_KB fp32)`` of :func:`megamoe.ops.fp8_quant.quantize_128x128` and the key they
were made for: ``(data_ptr, _version, shape, dtype, device, optimizer steps so far)``. An in-place change of
the tensor through autograd's view of it (``add_``, ``copy_`` under ``no_grad``, the for-each optimizers) bumps
its version counter, a ``.data`` swap changes the data pointer, and every ``optimizer.step()`` of any
``torch.optim`` optimizer counts in the key (a step post-hook, registered on the first lookup): the fused
optimizers (``AdamW(fused=True)``) write without bumping the version counter. Tensors made under
``torch.inference_mode()`` have no version counter: they are quantized at every call.

Writers that neither bump the version counter nor run through ``torch.optim``: in-place writes to ``p.data`` (an
EMA, a hand-written update) and other frameworks' optimizers; after them call :meth:`Fp8WeightCache.clear` on
:data:`WEIGHT_CACHE`, or run the layer inside :func:`uncached`.

Writers that keep the version counter: FSDP2 copies its all-gathered parameters into the unsharded parameter
under ``torch.autograd._unsafe_preserve_version_counter``, and the caching allocator may hand the same address
back, so after an optimizer step a key could match blocks of the previous step's values. Inside
:func:`uncached` the cache is neither read nor written; ``megamoe.MoE`` enters it by itself when it or its
experts are wrapped by FSDP2 (``fully_shard``); wrap the call yourself when another module that encloses the
layer is the one sharded.

CUDA graphs: while the current stream is being captured, the weights are always quantized (recorded into the
graph) and the cache is neither read nor written, so a replay after an optimizer step quantizes the updated
weights, never replays stale blocks.

Memory: one byte per weight element plus one fp32 per 128x128 block, per cached weight (twice that once a
backward has asked for the K-major copy, :meth:`Fp8WeightCache.kmajor`), held until the weight
tensor is freed or :meth:`Fp8WeightCache.clear` is called. Sync: none (host metadata only).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Fp8WeightCache", "WEIGHT_CACHE", "quantized_weight", "uncached"]

_LOCAL = threading.local()  # per thread: the forward that quantizes runs on the caller's thread
_STEPS = [0, None]  # optimizer steps seen by the post-hook, and the hook's handle once registered


def _count_step(optimizer, args, kwargs) -> None:
    _STEPS[0] += 1


def _optimizer_steps() -> int:
    """torch.optim optimizer steps so far (a global step post-hook, registered on the first call)."""
    if _STEPS[1] is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEPS[1] = register_optimizer_step_post_hook(_count_step)
    return _STEPS[0]


@contextlib.contextmanager
def uncached():
    """Within the block (this thread), weights are quantized at every call, the cache neither read nor written:
    for weights whose values may change without a version-counter bump (FSDP2's unsharded parameters)."""
    old = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = old


def _default_quantize(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from . import fp8_quant  # looked up at call time (tests count its launches through the module attribute)

    return fp8_quant.quantize_128x128(w_ENK)


def _swap_order(t: torch.Tensor) -> torch.Tensor:
    """The same values, the last two dimensions' memory order swapped (a transposed copy, viewed back)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _kmajor_blocks(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) with each expert's two dimensions stored in the other order: one tiled copy kernel on CUDA
    (megamoe.ops.fp8_quant.kmajor_128x128, ~2.9 TB/s moved on an H100, where torch's strided copy of the bytes moved
    ~0.3 TB/s), torch's copy elsewhere (the same bytes)."""
    if q.is_cuda:
        from . import fp8_quant

        return fp8_quant.kmajor_128x128(q, s)
    return _swap_order(q), _swap_order(s)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class Fp8WeightCache:
    """128x128 FP8 blocks of weight tensors, one entry per tensor, valid for one version of its values.

    ``quantize``: ``w_ENK -> (q_ENK, s_E_NB_KB)`` (default: megamoe.ops.fp8_quant.quantize_128x128).
    ``hits`` / ``misses`` count the lookups (for tests and the curious)."""

    def __init__(self, quantize: Callable | None = None):
        self._quantize = quantize or _default_quantize
        self._entries = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise
        self._kmajor = WeakIdKeyDictionary()  # blocks' q -> their K-major copy (goes with the blocks)
        self.hits = self.misses = 0

    @staticmethod
    def _key(w: torch.Tensor) -> tuple | None:
        if getattr(_LOCAL, "off", False) or w.is_inference() or _capturing(w):
            return None
        return (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device, _optimizer_steps())

    def get(self, w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_ENK, s_E_NB_KB) of ``w_ENK``'s current values: cached, or quantized now (and cached)."""
        key = self._key(w_ENK)
        if key is not None:
            entry = self._entries.get(w_ENK)
            if entry is not None and entry[0] == key:
                self.hits += 1
                return entry[1], entry[2]
        self.misses += 1
        q, s = self._quantize(w_ENK.detach())
        if key is not None:
            self._entries[w_ENK] = (key, q, s)
        return q, s

    def kmajor(self, blocks: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks`` (q_ENK, s_E_NB_KB) with each expert's two dimensions stored in the other order: the same
        values (a byte copy, no requantization), for the input-gradient GEMMs, which read w[e] transposed (as
        (K, N)): the FP8 tensor cores take K-major operands only, and a tile of the forward's layout would go
        through registers, unpipelined. Made once per blocks and kept as long as they are (not while a CUDA graph
        is captured, nor inside :func:`uncached` on the calling thread); the same bits as the forward's layout."""
        q, s = blocks
        if getattr(_LOCAL, "off", False) or _capturing(q):
            return _kmajor_blocks(q, s)
        hit = self._kmajor.get(q)
        if hit is None or hit[0] is not s:
            hit = (s, *_kmajor_blocks(q, s))
            self._kmajor[q] = hit
        return hit[1], hit[2]

    def clear(self) -> None:
        """Drop every cached entry (their memory is freed once no layer call still holds them)."""
        self._entries.clear()
        self._kmajor.clear()

    def __len__(self) -> int:
        return len(self._entries)


#: the process-wide cache the fused FP8 path uses
WEIGHT_CACHE = Fp8WeightCache()


def quantized_weight(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Fp8WeightCache.get` on :data:`WEIGHT_CACHE`."""
    return WEIGHT_CACHE.get(w_ENK)
