"""Helpers for the expert-parallel tests: multi-process launchers, payloads, a Python model of the schedule.

Legend: W ranks, T tokens of a rank, K top-k, D hidden, E global experts, L = E / W, C capacity rows.

* :func:`spawn_ranks` runs ``fn(rank, world, *args)`` in W spawned processes and returns their results
  (a failure in any rank is re-raised with that rank's traceback). ``cuda=True`` also initialises NCCL
  on GPU ``rank`` with a free port.
* :func:`payload_rows` makes token rows that encode (source rank, token) in columns 0 and 1, so a
  misrouted row names itself.
* :func:`model_schedule` is the plain-Python statement of the receive order the kernels must produce.
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, args, q, port, cuda):
    try:
        if cuda:
            import torch.distributed as dist
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank))
        res = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(res, buf)  # plain bytes: tensors must not travel as shared-memory handles
        q.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if cuda:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def spawn_ranks(fn, world: int, *args, cuda: bool = False, timeout: float = 300.0, env: dict | None = None):
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return [result of rank r]."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, args, q, port, cuda)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, res = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(res), weights_only=False)
            else:
                errors.append(f"rank {rank}: {res}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def payload_rows(rank: int, T: int, D: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """[T, D] rows: column 0 = source rank, column 1 = token index, the rest N(0, 1) from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, D, generator=g)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32)
    return x.to(dtype)


def model_schedule(ids_per_rank: list[torch.Tensor], rank: int, L: int) -> list[tuple[int, int, int, int]]:
    """Receive rows of ``rank`` in protocol order: [(local expert, source rank, token, slot)], sorted by
    (local expert, global token, slot)."""
    rows = []
    for s, ids in enumerate(ids_per_rank):
        T, K = ids.shape
        for t in range(T):
            for k in range(K):
                e = int(ids[t, k])
                if e // L == rank:
                    rows.append((e % L, s, t, k))
    rows.sort()
    return rows


def routing(kind: str, T: int, K: int, E: int, seed: int, rank: int = 0) -> torch.Tensor:
    """int64 [T, K] distinct expert ids per token: 'uniform', 'zipf' (exponent 1.2), 'hot' (expert 0 in
    every token), 'ties' (all tokens pick experts 0..K-1). For "all tokens on rank 0's experts", call
    'uniform' with E = L (rank 0's range)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, dtype=torch.float64)))
        return torch.topk(p.log()[None, :] + gumbel, K, dim=1).indices
    if kind == "hot":
        rest = torch.stack([torch.randperm(E - 1, generator=g)[:K - 1] + 1 for _ in range(T)]) if K > 1 else None
        hot = torch.zeros(T, 1, dtype=torch.int64)
        return hot if rest is None else torch.cat([hot, rest], 1)
    if kind == "ties":
        return torch.arange(K, dtype=torch.int64).repeat(T, 1)
    raise ValueError(kind)
