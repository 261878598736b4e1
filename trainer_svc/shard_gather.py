"""Gathering the ranks' parameters back into canonical tensors, the inverse of `shard_cut`: over
tp (`tp_whole`, also for `parallel_export.py`), then over ep and the stages to rank 0
(`gather_canonical`, for the gathered export and the tests).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from trainer_svc import comm
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import Mesh
from trainer_svc.sharding import local_shape, sharding_of, sources


def tp_whole(
    name: str, p: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], mesh: Mesh
) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, value) of every source of local parameter `name`, gathered over tp but still
    this rank's ep shard (collective over the tp group when `name` is cut over tp)."""
    sharding, names = sharding_of(name), sources(name)
    t = p.detach().view(local_shape(name, shapes, mesh.dims))
    tp_dim = sharding.tp_dim
    if tp_dim is not None:
        if len(names) > 1 and tp_dim >= 1:
            tp_dim += 1  # fused sources are stacked on dim 1
        t = torch.cat(_gather(t, mesh.tp), tp_dim)
    return list(zip(names, t.unbind(1))) if len(names) > 1 else [(names[0], t)]


@torch.no_grad()
def gather_canonical(
    weights: Mapping[str, torch.Tensor], mesh: Mesh, args: ModelArgs
) -> dict[str, torch.Tensor]:
    """Collective over the whole world: rank 0 gets every canonical tensor of `weights` (each
    rank's stage parameters by name), others get {}.
    Shards are all-gathered over tp, then over ep; one rank per stage (dp = ep = tp = 0) then ships
    its stage's tensors to rank 0."""
    shapes = canonical_shapes(args)
    stage: dict[str, torch.Tensor] = {}
    for name, p in weights.items():
        ep_dim = sharding_of(name).ep_dim
        for source, t in tp_whole(name, p, shapes, mesh):
            if ep_dim is not None:
                t = torch.cat(_gather(t, mesh.ep), ep_dim)
            stage[source] = t.clone(memory_format=torch.contiguous_format)
    if mesh.dims.world_size == 1:
        return stage
    c = mesh.coords
    mine = {k: v.cpu() for k, v in stage.items()} if (c.dp, c.ep, c.tp) == (0, 0, 0) else {}
    received: list[dict] | None = [{} for _ in range(mesh.dims.world_size)] if mesh.rank == 0 else None
    dist.gather_object(mine, received, dst=0)
    if mesh.rank != 0:
        return {}
    assert received is not None  # rank 0 made it
    merged = {k: v for part in received for k, v in part.items()}
    return {k: merged[k] for k in shapes}


def _gather(t: torch.Tensor, group: comm.Group) -> list[torch.Tensor]:
    if comm.group_size(group) == 1:
        return [t.detach()]
    out = [torch.empty_like(t) for _ in range(comm.group_size(group))]
    dist.all_gather(out, t.detach().contiguous(), group=group)
    return out
