"""Run-to-run reproducibility for ``--check``: two runs from one seed, every logged loss and the final
parameters compared bit for bit.

Legend: W ranks of a job, N EP size.

A run's :func:`fingerprint` is its per-step train losses, balance (aux) losses and validation losses
(fp32 values as Python floats, so ``==`` compares bits) and a SHA-256 of the bytes of every tensor of
the final ``state_dict`` (parameters and buffers: expert bias, counters), per rank. :func:`compare`
names the first differing step or tensor.

:func:`repeat_spawned` runs the two runs at EP=2 from a single process: it spawns two ranks (gloo on
CPU; on CUDA, NCCL with one GPU per rank when there are two, else both ranks on GPU 0 over gloo with
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, as the shared-GPU EP tests do: the peers' symmetric
pools are then mapped from the same GPU and the ranks' kernels time-sliced, which checks the bits, not
the speed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..distributed import run_ranks
from .loop import Dist, RunConfig, RunResult, train

__all__ = ["compare", "fingerprint", "repeat_spawned"]


def _digest(t: torch.Tensor) -> str:
    if hasattr(t, "to_local"):  # FSDP2 DTensor: this rank's shard
        t = t.to_local()
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def fingerprint(res: RunResult) -> dict:
    """The logged losses and a digest of every final tensor of one rank's run (see the module docstring)."""
    return {"loss": list(res.losses), "aux_loss": list(res.aux_losses), "val": [v for _, v in res.val],
            "state": {k: _digest(v) for k, v in res.model.state_dict().items()}}


def compare(a: dict, b: dict) -> str | None:
    """None if the two fingerprints are bitwise equal, else what differs first (step or tensor name)."""
    for key in ("loss", "aux_loss", "val"):
        if len(a[key]) != len(b[key]):
            return f"{key}: {len(a[key])} vs {len(b[key])} values"
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            if x != y:  # Python floats holding fp32 values: != compares bits
                return f"{key} at step {i}: {x!r} vs {y!r}"
    if a["state"].keys() != b["state"].keys():
        return "final state: different tensor names"
    diff = [k for k in a["state"] if a["state"][k] != b["state"][k]]
    if diff:
        return f"final state: {len(diff)} of {len(a['state'])} tensors differ, first {diff[0]}"
    return None


def _rank_main(rank: int, world: int, port: int, rc: RunConfig, threads: int) -> list[dict]:
    """One spawned rank: join the group, train ``rc`` twice at EP=world, return both fingerprints."""
    torch.set_num_threads(threads)  # the parent's (--threads): CPU ranks of one machine share its cores
    backend, kw = "gloo", {}
    if rc.device.startswith("cuda"):
        n_gpu = torch.cuda.device_count()
        device = torch.device("cuda", rank % n_gpu)
        torch.cuda.set_device(device)
        if n_gpu >= world:
            backend, kw = "nccl", {"device_id": device}
        else:  # ranks share a GPU: NCCL refuses that; symmetric memory must map pools of one device
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        rc = dataclasses.replace(rc, device=str(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5), **kw)
    try:
        dctx = Dist.from_world(world, "cuda" if rc.device.startswith("cuda") else "cpu")
        return [fingerprint(train(rc, dctx)) for _ in range(2)]
    finally:
        dist.destroy_process_group()


def repeat_spawned(rc: RunConfig, world: int = 2, timeout_s: float = 1800.0) -> list[tuple[dict, dict]]:
    """Train ``rc`` twice at EP=``world`` in ``world`` spawned ranks; returns each rank's two fingerprints.
    Raises RuntimeError naming the rank if one fails or exits without a report (bounded: ``timeout_s``;
    megamoe.distributed.run_ranks)."""
    rc = dataclasses.replace(rc, out_dir=None, progress=False)
    threads = max(1, torch.get_num_threads() // world)
    runs = run_ranks(_rank_main, world, rc, threads, timeout_s=timeout_s, what=f"--check: EP={world}")
    return [tuple(r) for r in runs]
