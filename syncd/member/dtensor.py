"""A torch model's parameters -> this rank's syncd catalog, read off DTensor placements.

Each parameter is a DTensor (FSDP2, tensor parallel, expert parallel, or any mix: a global shape,
a device mesh and one placement per mesh dim) or a plain tensor (held whole: replicated). Per
tensor dim, the rank holds a list of global indices in local order; placements are applied in
mesh-dim order to the indices the previous ones left, by DTensor's own split
(`syncd.member.torch_dtensor.held_indices`), so `Shard`'s uneven `torch.chunk` cuts and
`_StridedShard`'s interleaving come out exactly as DTensor lays the local tensor out. Consecutive
indices fold into runs, and the runs of every dim select the parameter's part of its canonical
layout expression (`syncd.layout.selection.Selection`): the boxes this rank holds.

Refused at registration, naming the parameter (`LayoutRefusedError`, all problems at once): a `Partial`
placement (pending reductions are not weights), a placement type this module does not know, a
parameter that no name rule maps to canonical tensors, a mapped layout whose shape is not the
parameter's, a local tensor whose shape disagrees with DTensor's own account, and a layout so
interleaved that it needs more than `MAX_PIECES` boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from syncd.layout import CanonicalTensor, Catalog, LocalTensor, local_tensor
from syncd.layout.placements import Expr
from syncd.layout.selection import Runs, Selection
from syncd.member import torch_dtensor as tdt
from syncd.member.canonical_names import UserNames, canonical_shapes, expert_counts, layout_of

MAX_PIECES = 4096  # per parameter and rank: beyond this the layout is a scatter, not a few boxes


class LayoutRefusedError(ValueError):
    """Parameters whose layout cannot be registered; `problems` maps each one to why."""

    def __init__(self, problems: Mapping[str, str]) -> None:
        self.problems = dict(problems)
        lines = "\n".join(f"  {name}: {why}" for name, why in self.problems.items())
        super().__init__(f"{len(self.problems)} parameter(s) cannot be registered with syncd:\n{lines}")


def _runs(indices: torch.Tensor) -> Runs:
    """[3, 4, 5, 9, 10] -> ((3, 6), (9, 11))."""
    values = indices.tolist()
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return tuple(out)


def held_runs(t: torch.Tensor, param: str) -> tuple[Runs, ...] | None:
    """Per dim, the global index runs this rank holds of `t`, in local order; None when it holds
    nothing (an empty uneven shard, or a rank outside the mesh). Raises ValueError naming `param`."""
    if not isinstance(t, tdt.DTensor):
        return tuple(((0, n),) for n in t.shape) if t.numel() else None
    coords = t.device_mesh.get_coordinate()
    if coords is None:
        return None
    indices = [torch.arange(n) for n in t.shape]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, tdt.Partial):
            raise ValueError(
                f"placement {placement} on mesh dim {mesh_dim} holds a pending reduction, not "
                "weights; redistribute it to Replicate or Shard before registering"
            )
        if isinstance(placement, tdt.Replicate):
            continue
        if not isinstance(placement, tdt.Shard | tdt.StridedShard):
            raise ValueError(f"placement {placement!r} on mesh dim {mesh_dim} has no mapping to boxes")
        d = tdt.shard_dim(placement)
        if isinstance(placement, tdt.StridedShard):
            _check_split_factor(t, mesh_dim)
        indices[d] = tdt.held_indices(placement, indices[d], t.device_mesh.size(mesh_dim), coords[mesh_dim])
    shape = tuple(len(i) for i in indices)
    local = tuple(t.to_local().shape)
    if shape != local or shape != tdt.local_shape(t):
        raise ValueError(
            f"placements {t.placements} give a local shape {shape}, but the local tensor is {local} "
            f"and DTensor computes {tdt.local_shape(t)}"
        )
    if not all(shape):
        return None
    return tuple(_runs(i) for i in indices)


def _check_split_factor(t: tdt.DTensor, mesh_dim: int) -> None:
    """A `_StridedShard` states right-to-left sharding (FSDP2 on top of TP): its split factor must
    be the number of shards the later mesh dims cut the same tensor dim into. DTensor's own
    `full_tensor()` disagrees with its split for other factors (torch 2.13: e.g. sf=3 over 2 x 2),
    so such a layout is refused rather than mapped to boxes nobody can check."""
    placement = t.placements[mesh_dim]
    dim = tdt.shard_dim(placement)
    later = 1
    for i in range(mesh_dim + 1, t.device_mesh.ndim):
        p = t.placements[i]
        if isinstance(p, tdt.Shard | tdt.StridedShard) and tdt.shard_dim(p) == dim:
            later *= t.device_mesh.size(i)
    if tdt.split_factor(placement) != later:
        raise ValueError(
            f"placement {placement!r} on mesh dim {mesh_dim}: its split factor is not the {later} "
            f"shard(s) that the later mesh dims cut dim {dim} into ({t.placements}); "
            "DTensor itself does not reassemble such a layout consistently"
        )


@dataclass(frozen=True)
class RankLayout:
    """What one rank registers: its catalog, and for each of its local tensors the parameter it
    reads (the local tensor's name is the parameter's name)."""

    catalog: Catalog
    params: Mapping[str, torch.Tensor]

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters' local data as they are now (views, no copies), by catalog name."""
        out = {}
        for name, p in self.params.items():
            local = p.to_local() if isinstance(p, tdt.DTensor) else p
            out[name] = local.detach()
        return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _local_tensor(name: str, t: torch.Tensor, expr: Expr) -> LocalTensor | None:
    if tuple(expr.shape) != tuple(t.shape):
        raise ValueError(
            f"its name mapping gives a layout of shape {tuple(expr.shape)}, the parameter is {tuple(t.shape)}"
        )
    runs = held_runs(t, name)
    if runs is None:
        return None
    pieces = math.prod(len(r) for r in runs) * len(canonical_shapes(expr))
    if pieces > MAX_PIECES:
        raise ValueError(
            f"placements {getattr(t, 'placements', ())} cut it into {pieces} boxes on this rank "
            f"(more than {MAX_PIECES}); shard it contiguously"
        )
    return local_tensor(name, _dtype_name(t), Selection.of(expr, runs))


def rank_layout(
    named_params: Iterable[tuple[str, torch.Tensor]],
    names: UserNames | None = None,
    exclude: Iterable[str] = (),
) -> RankLayout:
    """This rank's catalog of `named_params` (as `model.named_parameters()` gives them), every
    canonical tensor declared in its parameter's dtype. Raises `LayoutRefusedError`."""
    skip = set(exclude)
    params = {n: p for n, p in named_params if n not in skip}
    experts = expert_counts({n: tuple(p.shape) for n, p in params.items()})
    problems: dict[str, str] = {}
    canonical: dict[str, CanonicalTensor] = {}
    tensors: list[LocalTensor] = []
    held: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        expr = layout_of(name, tuple(p.shape), names, experts)
        if expr is None:
            problems[name] = "no canonical name: map it with names={...} or leave it out with exclude=[...]"
            continue
        try:
            for cname, shape in canonical_shapes(expr).items():
                prior = canonical.setdefault(cname, CanonicalTensor(cname, shape, _dtype_name(p)))
                if (prior.shape, prior.dtype) != (shape, _dtype_name(p)):
                    raise ValueError(f"maps to {cname} {shape} {_dtype_name(p)}, already declared as {prior}")
            lt = _local_tensor(name, p, expr)
        except ValueError as e:
            problems[name] = str(e)
            continue
        if lt is not None:
            tensors.append(lt)
            held[name] = p
    if problems:
        raise LayoutRefusedError(problems)
    catalog = Catalog(tuple(canonical.values()), tuple(tensors))
    catalog.validate()
    return RankLayout(catalog, held)
