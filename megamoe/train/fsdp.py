"""FSDP2 for ``python -m megamoe.train --fsdp``: parameters sharded instead of replicated, next to EP.

Legend: W ranks of the job, N EP size, R = W / N replicas of each expert.

Wrapping (:func:`shard_model`), innermost first, each ``fully_shard`` on its own mesh:
  * every MoE layer's ``router`` (fp32 weight) and the layer itself (its shared expert) over all W ranks:
    FSDP2 wants one dtype per wrapped module, and the layer's experts are in the config's dtype;
  * every MoE layer's ``experts`` over the R replicas that hold the same experts (the ``"dp"`` dimension of
    ``Dist.mesh``); with R = 1 the experts are not replicated and stay as they are;
  * every attention module, then the model (embedding, norms, head), over all W ranks.
FSDP2 gathers a module's parameters around its forward and reduce-scatters their gradients, averaging over
its mesh: the replicated parameters get (sum over W) / W, as ``loop._allreduce_grads`` gives them; the
experts get (sum over R) / R, so :func:`scale_expert_grads` divides them by N more (mean over W ranks),
and with R = 1 their EP-group sums by N. The same split of meshes as torchtitan's (experts on a mesh
without the EP dimension, the rest on all ranks).

Checkpoints: each rank saves the local shards of its parameters and optimizer state
(:func:`local_state_dicts`) and restores them into a model and optimizer wrapped the same way
(:func:`load_local_state_dicts`), so resuming needs the same W, N and ``--fsdp`` (the checkpoint records
them). torch.distributed.checkpoint is not used: the experts of different EP ranks share their names,
which it would take for one tensor.
"""

from __future__ import annotations

import torch

__all__ = ["shard_model", "scale_expert_grads", "local_state_dicts", "load_local_state_dicts"]


def shard_model(model, dctx, device_type: str) -> None:
    """Wrap ``model`` (a ``GPT``) in FSDP2 as the module docstring says, in place. Collective."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # MoE.forward returns a view of its [T, D] result (a free reshape to x's shape); FSDP2 warns that an
    # in-place op on it would skip its hooks. GPT.forward adds it out of place, so the warning says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view tensor")
    everyone = init_device_mesh(device_type, (dctx.world,), mesh_dim_names=("all",))
    for blk in model.blocks:
        moe = blk.moe
        fully_shard(moe.router, mesh=everyone)
        if dctx.replicas > 1:
            fully_shard(moe.experts, mesh=dctx.mesh["dp"])
        fully_shard(moe, mesh=everyone)
        fully_shard(blk.attn, mesh=everyone)
    fully_shard(model, mesh=everyone)


@torch.no_grad()
def scale_expert_grads(model, dctx) -> None:
    """Experts' gradients from FSDP2's mean over the R replicas (or, with R = 1, the EP-group sum) to the
    mean over all W ranks: divided by N."""
    for m in model.moe_layers():
        for p in m.experts.parameters():
            if p.grad is not None:
                p.grad.div_(dctx.ep_size)


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def local_state_dicts(model, opt) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with every DTensor replaced by this rank's local shard."""
    model_sd = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
    opt_sd = opt.state_dict()
    opt_sd["state"] = {i: {k: _local(v).clone() if torch.is_tensor(v) else v for k, v in st.items()}
                       for i, st in opt_sd["state"].items()}
    return model_sd, opt_sd


@torch.no_grad()
def load_local_state_dicts(model, opt, model_sd: dict, opt_sd: dict) -> None:
    """Inverse of :func:`local_state_dicts` on a model and optimizer wrapped the same way."""
    from torch.distributed.tensor import DTensor

    for k, v in model.state_dict().items():
        _local(v).copy_(model_sd[k])
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, st in opt_sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v.to(_local(p).device), p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride())
                        if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v)
                    for k, v in st.items()}
    opt.load_state_dict({**opt_sd, "state": state})
