"""Executes Muon's communication plans (`muon_plan.py`) with torch.distributed collectives.

`WorkGroups` creates the process groups once, collectively, and keys them by the tuple of their
global ranks: a stable identity of the mesh, equal on every rank and across runs (unlike `id()`
of a group object). `orthogonalized_pieces` takes this rank's pieces of a batch's momentum
matrices and returns its pieces of their scaled Muon updates, whichever path the batch takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer_svc.optim.muon import muon_update
from trainer_svc.optim.muon_plan import (
    ALL_GATHER,
    ALL_TO_ALL,
    BATCHED,
    LOCAL,
    BatchLayout,
    Exchange,
    Item,
    gather_to_owners,
    owners,
    scatter_from_owners,
)
from trainer_svc.parallel_dims import ParallelDims

# The mesh dims a work group spans: every rank with the same values of the other dims.
GROUP_SPANS = (("tp",), ("dp", "tp"), ("dp", "ep", "tp"))
Ranks = tuple[int, ...]


def group_ranks(dims: ParallelDims, rank: int, span: tuple[str, ...]) -> Ranks:
    """The sorted global ranks that share `rank`'s coordinates outside `span`."""
    mine = dims.coords(rank).as_dict()
    return tuple(
        r
        for r, c in enumerate(dims.all_coords())
        if all(v == mine[d] for d, v in c.as_dict().items() if d not in span)
    )


class WorkGroups:
    """Every process group Muon may use, created collectively in one fixed order (all ranks call
    the constructor); `get(ranks)` returns the group of those global ranks (None for one rank)."""

    def __init__(self, dims: ParallelDims) -> None:
        self._groups: dict[Ranks, dist.ProcessGroup] = {}
        if dims.world_size == 1:
            return
        wanted = sorted({group_ranks(dims, r, span) for span in GROUP_SPANS for r in range(dims.world_size)})
        for ranks in wanted:
            if len(ranks) > 1:
                self._groups[ranks] = dist.new_group(list(ranks))

    def get(self, ranks: Ranks) -> dist.ProcessGroup | None:
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            raise ValueError(f"no Muon work group for ranks {ranks}; known: {sorted(self._groups)}")
        return self._groups[ranks]


def _whole(pieces: Sequence[torch.Tensor], shard_dim: int) -> torch.Tensor:
    return torch.cat(list(pieces), dim=shard_dim)


def _mine(update: torch.Tensor, layout: BatchLayout, t: int) -> torch.Tensor:
    return update.chunk(layout.tp, dim=layout.shard_dim)[t].contiguous()


def orthogonalized_pieces(
    pieces: Sequence[torch.Tensor],
    layout: BatchLayout,
    path: str,
    me: int,
    work_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None,
    ns_steps: int,
) -> list[torch.Tensor]:
    """This rank's pieces of the scaled Muon update of every matrix of the batch. `pieces[m]` is
    this rank's piece of momentum matrix m; `me` its rank in the work group (r * tp + t)."""

    def update(whole: torch.Tensor) -> torch.Tensor:
        return muon_update(whole, ns_steps)

    if path == LOCAL:
        return [update(p) for p in pieces]  # tp == 1: a piece is the whole matrix
    if path == ALL_GATHER:
        return _via_all_gather(pieces, layout, me % layout.tp, tp_group, update)
    if path in (ALL_TO_ALL, BATCHED):
        return _via_owners(pieces, layout, me, work_group, update)
    raise ValueError(f"unknown Muon path {path!r}")


def _via_all_gather(pieces, layout: BatchLayout, t: int, tp_group, update) -> list[torch.Tensor]:
    """All tp ranks hold equal-size pieces, so one all_gather of their concatenation suffices."""
    flat = torch.cat([p.reshape(-1) for p in pieces])
    gathered = [torch.empty_like(flat) for _ in range(layout.tp)]
    dist.all_gather(gathered, flat, group=tp_group)
    sizes = [layout.piece_numel(m) for m in range(layout.matrices)]
    per_rank = [g.split(sizes) for g in gathered]
    out = []
    for m in range(layout.matrices):
        parts = [per_rank[t2][m].view(layout.piece_shape(m)) for t2 in range(layout.tp)]
        whole = _whole(parts, layout.shard_dim)
        out.append(_mine(update(whole), layout, t))
    return out


def _via_owners(pieces, layout: BatchLayout, me: int, group, update) -> list[torch.Tensor]:
    """All-to-all every piece to its matrix's owner, orthogonalize there, all-to-all back."""
    received = run_exchange(
        {(m, me % layout.tp): p for m, p in enumerate(pieces)},
        gather_to_owners(layout, me),
        layout,
        group,
        pieces[0],
    )
    results: dict[Item, torch.Tensor] = {}
    for m, owner in enumerate(owners(layout)):
        if owner == me:
            whole = update(_whole([received[(m, t)] for t in range(layout.tp)], layout.shard_dim))
            for t in range(layout.tp):
                results[(m, t)] = _mine(whole, layout, t)
    back = run_exchange(results, scatter_from_owners(layout, me), layout, group, pieces[0])
    t = me % layout.tp
    return [back[(m, t)] for m in range(layout.matrices)]


def run_exchange(
    have: dict[Item, torch.Tensor],
    plan: Exchange,
    layout: BatchLayout,
    group: dist.ProcessGroup | None,
    like: torch.Tensor,
) -> dict[Item, torch.Tensor]:
    """One all_to_all_single with uneven splits: send the planned pieces, return those received.
    `like` gives dtype and device (a rank may have nothing to send)."""
    send_items = [item for items in plan.send for item in items]

    def numel(items: Sequence[Item]) -> int:
        return sum(layout.piece_numel(m) for m, _ in items)

    send = torch.cat([have[i].reshape(-1) for i in send_items]) if send_items else like.new_empty(0)
    recv = like.new_empty(sum(numel(items) for items in plan.recv))
    if group is None:  # a group of one: everything is sent to oneself
        recv.copy_(send)
    else:
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[numel(i) for i in plan.recv],
            input_split_sizes=[numel(i) for i in plan.send],
            group=group,
        )
    recv_items = [item for items in plan.recv for item in items]
    chunks = recv.split([layout.piece_numel(m) for m, _ in recv_items])
    return {item: chunk.view(layout.piece_shape(item[0])) for item, chunk in zip(recv_items, chunks)}
