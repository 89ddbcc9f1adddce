"""Device code of the fused MoE path: ``@triton.jit`` kernels only (no allocation, no host logic).

Host launchers that validate, allocate, pick tile configs and grids live in :mod:`megamoe.ops`.
Modules: :mod:`.tiles` (tile helpers the GEMMs share), :mod:`.grouped_gemm` (m-grouped forward / dgrad GEMMs
with fused SwiGLU epilogues, k-grouped weight-gradient GEMMs), :mod:`.ep_tiles` (the m-grouped GEMM's tile body
beside a pull / storing into the owners' slots), :mod:`.combine` (fixed-order slot reductions),
:mod:`.bf16_split` (an fp32 matrix as three exact bf16 pieces) and :mod:`.wgrad_gluon` (``@gluon.jit``: the
persistent Hopper weight-gradient kernel, imported only by :mod:`megamoe.ops.wgrad_gluon`, which keeps the package
importable where Gluon is not) and :mod:`.wgrad_ws_gluon` (its warp-specialized form).
"""
