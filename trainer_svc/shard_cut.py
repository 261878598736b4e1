"""Cutting canonical tensors into one rank's parameters, executing `sharding.PLAN` with plain tensor
ops (catalog.py executes the same table as syncd layout expressions; tests comparing the two
catch an executor that misreads it).

Local parameter names equal canonical names except the fused experts:
`model.layers.L.mlp.experts.gate_up_proj` ([E_l*2*I_l, H], from gate_proj and up_proj) and
`model.layers.L.mlp.experts.down_proj` ([E_l, H, I_l], from down_proj.weight).
"""

from __future__ import annotations

import torch

from syncd.layout import Shard
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.sharding import on_mesh, sharding_of, sources


def shard_for_rank(
    name: str, canonical: dict[str, torch.Tensor], dims: ParallelDims, c: Coords
) -> torch.Tensor:
    """The value of local parameter `name` on the rank at `c`, cut from canonical tensors."""
    parts = []
    for source in sources(name):
        t = canonical[source]
        for p, size, coord in zip(sharding_of(name).placements, on_mesh(dims), on_mesh(c)):
            if isinstance(p, Shard):
                t = t.chunk(size, p.dim)[coord]
        parts.append(t)
    if len(parts) == 1:
        return parts[0].clone()
    stacked = torch.stack(parts, dim=1)
    return stacked.reshape(-1, stacked.shape[-1]).clone()


@torch.no_grad()
def load_into(
    model: torch.nn.Module, canonical: dict[str, torch.Tensor], dims: ParallelDims, c: Coords
) -> None:
    for name, p in model.named_parameters():
        p.copy_(shard_for_rank(name, canonical, dims, c))
