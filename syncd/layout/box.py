"""Boxes: per-dimension half-open ranges `[start, stop)` of an n-dimensional tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Box:
    """A region `[start[d], stop[d])` for every dim `d`. Empty boxes are never constructed."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    # Derived once: the data plane asks every unit's box for them on every refit.
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.start) != len(self.stop):
            raise ValueError(f"box rank mismatch: start {self.start} vs stop {self.stop}")
        for lo, hi in zip(self.start, self.stop):
            if not 0 <= lo < hi:
                raise ValueError(f"box [{self.start}, {self.stop}) is empty or negative")
        shape = tuple(hi - lo for lo, hi in zip(self.start, self.stop))
        object.__setattr__(self, "shape", shape)  # frozen: set once, here
        object.__setattr__(self, "numel", math.prod(shape))

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def rank(self) -> int:
        return len(self.start)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in zip(self.start, self.stop))

    def within(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == self.rank and all(hi <= n for hi, n in zip(self.stop, shape))

    def intersect(self, other: Box) -> Box | None:
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(lo >= hi for lo, hi in zip(start, stop)):
            return None
        return Box(start, stop)

    def shifted(self, dim: int, by: int) -> Box:
        start, stop = list(self.start), list(self.stop)
        start[dim] += by
        stop[dim] += by
        return Box(tuple(start), tuple(stop))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in zip(self.start, self.stop)) + "]"


def non_unit_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d, n in enumerate(shape) if n != 1)


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` contiguous chunks of `range(size)`; the first `size % parts`
    chunks are one longer (numpy.array_split semantics, so uneven splits are allowed)."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"cannot take chunk {index} of {parts}")
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
