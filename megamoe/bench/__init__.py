"""megamoe.bench: the benchmark harness (``python -m megamoe.bench``; see benchmarks/README.md).

Legend (all modules of this package): T tokens per rank, D hidden, F expert FFN, G = 2F, E routed experts,
L = E / W local experts, K top-k, N = T*K (token, slot) rows, S shared FFN, H = 2S, W EP world size,
M = W*T tokens of the global batch, C checked tokens.

Modules: ``routing_models`` (uniform / zipf / trace routing), ``problem`` (seeded inputs and weights),
``providers`` / ``providers_ep`` / ``symm_vdev`` (implementations compared), ``check`` (correctness
against megamoe.reference at the benchmarked shape), ``timing`` (protocol), ``ceilings`` (measured
hardware rates), ``report`` (FLOP/byte formulas, table, CSV/JSON/PNG), ``runner`` (the driver).
"""
