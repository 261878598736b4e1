"""The mesh: one dataclass that validates the parallel layout and builds its process groups.

Ranks are laid out pp-major, tp-minor: rank = ((pp * DP + dp) * EP + ep) * TP + tp, so TP peers
are neighbours (one host on GPUs). Attention and the other non-expert weights are replicated over
dp x ep (both are data parallel for them) and sharded over tp; experts are sharded over ep and tp
and replicated over dp. Data is split over the dp x ep "data ranks"; TP peers see the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from trainer_svc.config import ModelArgs

MESH_DIMS = ("pp", "dp", "ep", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    ep: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "tp": self.tp}


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh dim {name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def data_ranks(self) -> int:
        """How many ways a stage's batch is split (dp x ep)."""
        return self.dp * self.ep

    def validate(self, args: ModelArgs, world_size: int | None = None) -> None:
        """Raise ValueError naming the numbers when the layout cannot hold the model."""
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != pp {self.pp} x dp {self.dp} x ep {self.ep} x tp {self.tp} "
                f"= {self.world_size}"
            )
        checks = [
            (args.num_experts, self.ep, "num_experts", "ep"),
            (args.num_attention_heads, self.tp, "num_attention_heads", "tp"),
            (args.num_key_value_heads, self.tp, "num_key_value_heads", "tp"),
            (args.moe_intermediate_size, self.tp, "moe_intermediate_size", "tp"),
        ]
        for total, parts, what, dim in checks:
            if total % parts:
                raise ValueError(f"{dim} {parts} must divide {what} {total}")
        if self.pp > args.num_hidden_layers:
            raise ValueError(f"pp {self.pp} exceeds num_hidden_layers {args.num_hidden_layers}")

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, ep = divmod(rest, self.ep)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp=pp, dp=dp, ep=ep, tp=tp)

    def rank_of(self, c: Coords) -> int:
        return ((c.pp * self.dp + c.dp) * self.ep + c.ep) * self.tp + c.tp

    def all_coords(self) -> list[Coords]:
        return [self.coords(r) for r in range(self.world_size)]

    def build_mesh(self, rank: int) -> Mesh:
        """Create every process group (collectively: all ranks call this in the same order)."""
        groups: dict[str, dist.ProcessGroup | None] = {}
        specs = {"tp": ("tp",), "ep": ("ep",), "dp": ("dp",), "dp_ep": ("dp", "ep")}
        for key, varying in specs.items():
            groups[key] = self._new_groups(rank, varying)
        return Mesh(dims=self, rank=rank, coords=self.coords(rank), **groups)

    def _new_groups(self, rank: int, varying: tuple[str, ...]) -> dist.ProcessGroup | None:
        """One group per fixed value of the other dims; returns this rank's (None if size 1)."""
        size = 1
        for d in varying:
            size *= getattr(self, d)
        if size == 1 or self.world_size == 1:
            return None
        buckets: dict[tuple, list[int]] = {}
        for r, c in enumerate(self.all_coords()):
            key = tuple(v for d, v in c.as_dict().items() if d not in varying)
            buckets.setdefault(key, []).append(r)
        mine = None
        for key in sorted(buckets):
            group = dist.new_group(buckets[key])
            if rank in buckets[key]:
                mine = group
        return mine


@dataclass(frozen=True)
class Mesh:
    """This rank's view of the layout: its coordinates and the groups it belongs to."""

    dims: ParallelDims
    rank: int
    coords: Coords
    tp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    dp_ep: dist.ProcessGroup | None = None

    @staticmethod
    def single() -> Mesh:
        return Mesh(dims=ParallelDims(), rank=0, coords=Coords(0, 0, 0, 0))

    @property
    def data_rank(self) -> int:
        return self.coords.dp * self.dims.ep + self.coords.ep

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.dims.pp - 1

    def stage_peer(self, offset: int) -> int:
        """Global rank of my counterpart (same dp, ep, tp) in stage pp + offset."""
        c = self.coords
        return self.dims.rank_of(Coords(c.pp + offset, c.dp, c.ep, c.tp))
