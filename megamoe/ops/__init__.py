"""Host launchers of the fused MoE path: validate, allocate, pick the tile config and grid, launch.

No autograd here (see megamoe.autograd) and no ``@triton.jit`` code (see megamoe.kernels). Every
launcher is sync-free and CUDA-graph capturable; CPU tensors work when TRITON_INTERPRET=1 was set
before triton was imported.

Public pieces (the EP path calls these on rows received from peers):
  routing:      build_routing_plan (the one plan builder: single-GPU plan, or an EP owner's plan into its
                pool through PoolPlan), RoutingPlan, PoolPlan, tile_offsets_for, single_group_offsets,
                chunk_offsets (fixed row chunks as groups)
  forward:      gate_up_swiglu, down_proj, grouped_mm_nt, combine_fwd
  backward:     swiglu_dgrad (m-grouped dgrad + SwiGLU backward + routing-weight row dots),
                grouped_mm_nn (m-grouped dgrad), k_grouped_mm (weight gradients), slot_sum_bwd, chunk_sum
                (fp32 partials summed in chunk order), split_bf16x3 (an fp32 matrix as three exact bf16 pieces: the
                router's fp32 GEMMs on bf16 tensor cores),
                k_grouped_wants_rows_in_order (whether a weight gradient wants its gathered rows copied)
  EP stores:    RowPush, row_push_deltas (plain-epilogue GEMMs storing rows straight into (token, slot) rows
                of several ranks' buffers)
  configs:      GemmConfig, KernelConfig (megamoe.config), m_grouped_config, k_grouped_config,
                router_kernel_config (the router's 16-bit GEMMs), router_wgrad_chunks (their weight gradient's
                token chunks)
"""

from .bf16_split import split_bf16x3
from .combine import chunk_sum, combine_fwd, slot_sum_bwd
from .ep_tiles import RowPush, row_push_deltas
from .grouped_gemm import (
                           down_proj,
                           gate_up_swiglu,
                           grouped_mm_nn,
                           grouped_mm_nt,
                           k_grouped_mm,
                           k_grouped_wants_rows_in_order,
                           swiglu_dgrad,
)
from .routing import (
                      PoolPlan,
                      RoutingPlan,
                      build_routing_plan,
                      chunk_offsets,
                      single_group_offsets,
                      tile_offsets_for,
)
from .tile_config import (
                          GemmConfig,
                          KernelConfig,
                          k_grouped_config,
                          m_grouped_config,
                          router_kernel_config,
                          router_wgrad_chunks,
)

__all__ = [
    "RoutingPlan", "PoolPlan", "build_routing_plan", "tile_offsets_for", "single_group_offsets", "chunk_offsets",
    "gate_up_swiglu", "down_proj", "grouped_mm_nt", "grouped_mm_nn", "swiglu_dgrad", "k_grouped_mm",
    "k_grouped_wants_rows_in_order", "RowPush", "row_push_deltas",
    "combine_fwd", "slot_sum_bwd", "chunk_sum", "GemmConfig", "KernelConfig", "m_grouped_config", "k_grouped_config",
    "router_kernel_config", "router_wgrad_chunks", "split_bf16x3",
]
