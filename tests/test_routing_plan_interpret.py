"""The one routing-plan builder's two ways to an EP owner's plan, on CPU under TRITON_INTERPRET=1.

Proves: ``build_routing_plan(ids, E, pool=...)`` writes into an owner's pool exactly the single-GPU plan's
expert-sorted rows (``row_src_N``) and counts, with T in the header, through the per-expert scan kernel and
through the device sort (forced with ``SCAN_MAX = -1``) alike, for int32 and int64 ids, T = 0, K = 1, an
empty expert, all rows on one expert and ties; an id outside [0, E) sets the bad-id status either way.

Run: python -m pytest tests/test_routing_plan_interpret.py -q
(the kernels must be created with TRITON_INTERPRET=1 before triton is imported, so a process that has not
set it runs this file again in a subprocess that has.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_routing_plan_under_interpreter():
        root = Path(__file__).resolve().parents[1]
        path = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"interpreter run failed:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"

else:
    from megamoe.ops import routing
    from megamoe.ops.routing import PoolPlan, build_routing_plan

    def _case(name):
        g = torch.Generator().manual_seed(7)
        T, K, E = {"empty": (0, 2, 4), "k1": (9, 1, 3)}.get(name, (23, 3, 6))
        ids_TK = torch.randint(0, E, (T, K), generator=g)
        if name == "hot":  # expert 1 in every token's first slot (ties), expert 2 empty
            ids_TK[:, 0] = 1
            ids_TK[ids_TK == 2] = 0
        if name == "one_expert":
            ids_TK.fill_(E - 1)
        return ids_TK, E

    def _pool(T_cap, K, E):
        return PoolPlan(torch.full((4 + E,), -5, dtype=torch.int32), torch.full((T_cap * K,), -7, dtype=torch.int32),
                        torch.zeros(8, dtype=torch.int32), rank=0)

    @pytest.mark.parametrize("way", ["scan", "sort"])
    @pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
    @pytest.mark.parametrize("name", ["empty", "k1", "uniform", "hot", "one_expert"])
    def test_pool_plan_equals_single_gpu_plan(name, dtype, way, monkeypatch):
        if way == "sort":
            monkeypatch.setattr(routing, "SCAN_MAX", -1)
        ids_TK, E = _case(name)
        T, K = ids_TK.shape
        pool = _pool(T + 2, K, E)
        assert build_routing_plan(ids_TK.to(dtype), E, pool=pool) is None
        plan = build_routing_plan(ids_TK.to(dtype), E)
        N = T * K
        assert torch.equal(pool.sorted_rows[:N], plan.row_src_N)
        assert (pool.sorted_rows[N:] == -7).all(), "wrote past the plan's rows"
        assert pool.header_H[0] == T and torch.equal(pool.header_H[4:], plan.counts_E)
        assert pool.flags[1] == 0

    @pytest.mark.parametrize("way", ["scan", "sort"])
    def test_pool_plan_flags_an_id_out_of_range(way, monkeypatch):
        if way == "sort":
            monkeypatch.setattr(routing, "SCAN_MAX", -1)
        ids_TK, E = _case("uniform")
        ids_TK[5, 1] = E
        pool = _pool(ids_TK.shape[0], ids_TK.shape[1], E)
        build_routing_plan(ids_TK, E, pool=pool)
        assert (int(pool.flags[1]) >> 24) & 0xFF == 3  # stage 3: routing plan, expert id out of range
