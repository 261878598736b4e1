"""`Selection`: the part of an expression a rank holds, given directly as per-dim index runs.

`Sharded` derives each dim's runs from syncd's placements. A member whose framework already knows
which indices it holds (DTensor's `_StridedShard`, whose runs interleave in ways no syncd
placement states) hands the runs over instead; the pieces then follow exactly as for `Sharded`
(the same code: `Selection` only replaces where the runs come from).
"""

from __future__ import annotations

from dataclasses import dataclass

from syncd.layout.placements import Sharded

Runs = tuple[tuple[int, int], ...]  # [lo, hi) ranges of one dim, in the order the rank stores them


@dataclass(frozen=True)
class Selection(Sharded):
    """`expr` restricted to `runs` (one tuple of [lo, hi) ranges per dim, in local order). Build it
    with `Selection.of(expr, runs)`."""

    runs: tuple[Runs, ...] = ()

    @staticmethod
    def of(expr, runs: tuple[Runs, ...]) -> Selection:
        shape = expr.shape
        if len(runs) != len(shape):
            raise ValueError(f"{len(runs)} dims of runs for an expression of shape {shape}")
        for d, (dim_runs, n) in enumerate(zip(runs, shape)):
            if not dim_runs or any(not 0 <= lo < hi <= n for lo, hi in dim_runs):
                raise ValueError(f"dim {d}: runs {dim_runs} are empty or outside [0, {n})")
        return Selection(expr, (), (), (), runs)

    @property
    def _intervals(self) -> list[list[tuple[int, int]]]:
        return [list(r) for r in self.runs]
