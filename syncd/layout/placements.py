"""Placements and layout expressions: how a member computes its catalog.

Three expression kinds describe any local tensor:

- `Canon(name, shape, box, drop)`: a box of a canonical tensor (by default all of it), optionally
  with size-1 dims dropped so it can sit inside a lower-rank fused tensor.
- `Concat(dim, parts)`: a fusion, e.g. vLLM's `qkv_proj` or `w13 = [gate; up]`.
- `Stack(dim, parts)`: a fusion along a new dim, e.g. a trainer's fused gate/up expert weight seen
  as `[E_l, 2, I/tp, H]`.
- `Sharded(expr, placements, mesh_sizes, coords)`: the part of `expr` this rank holds. Placements
  apply in mesh-dim order, each to the local view the previous ones left:
  `Replicate()`, `Shard(dim)` (contiguous, uneven allowed) and `InterleavedShard(dim, stripes)`
  (cut the dim into `stripes` equal stripes and split every stripe over the mesh dim: the expert-TP
  layout of a fused `[experts * 2 * I, H]` gate/up weight).

`local_tensor(name, dtype, expr)` evaluates an expression into a concrete `LocalTensor`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from syncd.layout.box import Box, split_range
from syncd.layout.catalog import LocalTensor, Piece


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class InterleavedShard:
    dim: int
    stripes: int


Placement = Replicate | Shard | InterleavedShard


class Expr:
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape this expression evaluates to."""
        raise NotImplementedError

    def pieces(self) -> list[Piece]:
        """Pieces whose `local` boxes are in this expression's coordinates."""
        raise NotImplementedError


@dataclass(frozen=True)
class Canon(Expr):
    name: str
    canonical_shape: tuple[int, ...]
    box: Box | None = None
    drop: tuple[int, ...] = ()

    @property
    def region(self) -> Box:
        return self.box if self.box is not None else Box.full(self.canonical_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        full = self.region.shape
        for d in self.drop:
            if full[d] != 1:
                raise ValueError(f"{self.name}: cannot drop dim {d} of extent {full[d]}")
        return tuple(n for d, n in enumerate(full) if d not in self.drop)

    def pieces(self) -> list[Piece]:
        if not self.region.within(self.canonical_shape):
            raise ValueError(f"box {self.region} is outside {self.name} {self.canonical_shape}")
        return [Piece(self.name, self.region, Box.full(self.shape))]


@dataclass(frozen=True)
class Concat(Expr):
    dim: int
    parts: tuple[Expr, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        for p in self.parts:
            if len(p.shape) != len(first) or any(
                a != b for d, (a, b) in enumerate(zip(p.shape, first)) if d != self.dim
            ):
                raise ValueError(f"cannot concatenate shapes {first} and {p.shape} on dim {self.dim}")
        return tuple(sum(p.shape[d] for p in self.parts) if d == self.dim else n for d, n in enumerate(first))

    def pieces(self) -> list[Piece]:
        out: list[Piece] = []
        offset = 0
        for part in self.parts:
            out.extend(Piece(p.canonical, p.canon, p.local.shifted(self.dim, offset)) for p in part.pieces())
            offset += part.shape[self.dim]
        return out


@dataclass(frozen=True)
class Stack(Expr):
    dim: int
    parts: tuple[Expr, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        if any(p.shape != first for p in self.parts):
            raise ValueError(f"cannot stack shapes {[p.shape for p in self.parts]}")
        return (*first[: self.dim], len(self.parts), *first[self.dim :])

    def pieces(self) -> list[Piece]:
        out = []
        for i, part in enumerate(self.parts):
            for p in part.pieces():
                start = (*p.local.start[: self.dim], i, *p.local.start[self.dim :])
                stop = (*p.local.stop[: self.dim], i + 1, *p.local.stop[self.dim :])
                out.append(Piece(p.canonical, p.canon, Box(start, stop)))
        return out


@dataclass(frozen=True)
class Sharded(Expr):
    expr: Expr
    placements: tuple[Placement, ...]
    mesh_sizes: tuple[int, ...]
    coords: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.placements) == len(self.mesh_sizes) == len(self.coords):
            raise ValueError("placements, mesh_sizes and coords must have one entry per mesh dim")

    @property
    def _intervals(self) -> list[list[tuple[int, int]]]:
        """Per dim, the expression coordinates this rank holds, in local order."""
        runs = [[(0, n)] for n in self.expr.shape]
        for placement, size, coord in zip(self.placements, self.mesh_sizes, self.coords):
            if isinstance(placement, Replicate):
                continue
            d = placement.dim
            total = sum(hi - lo for lo, hi in runs[d])
            if isinstance(placement, Shard):
                runs[d] = _select(runs[d], *split_range(total, size, coord))
            else:
                if total % placement.stripes:
                    raise ValueError(
                        f"InterleavedShard: dim {d} of extent {total} is not divisible "
                        f"into {placement.stripes} stripes"
                    )
                stripe = total // placement.stripes
                lo, hi = split_range(stripe, size, coord)
                runs[d] = [
                    r
                    for s in range(placement.stripes)
                    for r in _select(runs[d], s * stripe + lo, s * stripe + hi)
                ]
        return runs

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(hi - lo for lo, hi in r) for r in self._intervals)

    def pieces(self) -> list[Piece]:
        per_dim = []
        for runs in self._intervals:
            offset, placed = 0, []
            for lo, hi in runs:
                placed.append((lo, hi, offset))
                offset += hi - lo
            per_dim.append(placed)
        out = []
        for child in self.expr.pieces():
            inverse = Piece(child.canonical, child.local, child.canon)
            for combo in itertools.product(*per_dim):
                selected = Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
                hit = child.local.intersect(selected)
                if hit is None:
                    continue
                local = Box(
                    tuple(s - c[0] + c[2] for s, c in zip(hit.start, combo)),
                    tuple(s - c[0] + c[2] for s, c in zip(hit.stop, combo)),
                )
                out.append(Piece(child.canonical, inverse.local_region(hit), local))
        return out


def _select(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The runs covering concatenated positions [start, stop) of `runs`."""
    out, pos = [], 0
    for lo, hi in runs:
        a, b = max(start, pos), min(stop, pos + hi - lo)
        if a < b:
            out.append((lo + a - pos, lo + b - pos))
        pos += hi - lo
    return out


def local_tensor(name: str, dtype: str, expr: Expr) -> LocalTensor:
    """Evaluate `expr` into a `LocalTensor` whose boxes are in `expr.shape` coordinates."""
    return LocalTensor(name, tuple(expr.shape), dtype, tuple(expr.pieces()))
