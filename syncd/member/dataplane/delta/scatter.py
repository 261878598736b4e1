"""Writing a delta's values at their positions within a box of a tensor: the receiver applies a
piece so, and a sender's mirror takes its sparse changes so (`compare.Diffs.commit`); positions
are C-order flat positions within the box, ascending.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from syncd.layout import Box

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare bit patterns (NaN == NaN)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_BITS[x.element_size()])


_FEW_RUNS = 64  # `_scatter_box` and `compare._unit_change` go run by run up to this many runs


def _box_runs(shape: tuple[int, ...], box: Box) -> tuple[torch.Tensor, int]:
    """A box of a C-order tensor as contiguous runs of flat positions: their starts, in the box's
    own C order, and their common length. The dims after the last partial one are whole, so
    each run is that dim's range times the whole dims after it."""
    partial = max((d for d in range(len(shape)) if (box.start[d], box.stop[d]) != (0, shape[d])), default=-1)
    if partial < 0:
        return torch.zeros(1, dtype=torch.int64), math.prod(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    starts = torch.tensor([box.start[partial] * strides[partial]], dtype=torch.int64)
    for d in reversed(range(partial)):  # outer dims: every combination of their indices, in C order
        offsets = torch.arange(box.start[d], box.stop[d], dtype=torch.int64) * strides[d]
        starts = (offsets[:, None] + starts[None, :]).reshape(-1)
    return starts, (box.stop[partial] - box.start[partial]) * strides[partial]


def _scatter_box(
    parent: torch.Tensor, box: Box, dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> None:
    """`scatter_flat(dst, index, values)` for `dst`, `box` of `parent`, with `index` ascending
    (`_check_positions`). On CPU with a contiguous parent, the box's few contiguous runs each take
    their slice of the positions by a binary search, as numpy assignments (half the time of
    torch's `index_copy_` here, and no int64 arithmetic per position); with many runs, positions in
    the box's C order become the parent's flat positions through the runs, one `index_copy_`."""
    if parent.device.type != "cpu" or not parent.is_contiguous():
        scatter_flat(dst, index, values)
        return
    starts, run = _box_runs(tuple(parent.shape), box)
    if len(starts) > _FEW_RUNS:
        flat_at = index.long()
        parent.view(-1).index_copy_(0, starts[flat_at // run] + flat_at % run, values)
        return
    flat, at, new = _bits(parent.view(-1)).numpy(), index.numpy(), _bits(values).numpy()
    cuts = [0, *np.searchsorted(at, np.arange(1, len(starts)) * run).tolist(), at.size]
    for r, start in enumerate(starts.tolist()):
        lo, hi = cuts[r], cuts[r + 1]
        if lo < hi:
            flat[start : start + run][at[lo:hi] - r * run if r else at[lo:hi]] = new[lo:hi]


def scatter_flat(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """dst.flatten()[index] = values, in place, also for a region that is not contiguous."""
    if dst.is_contiguous():
        dst.view(-1).index_copy_(0, index.long(), values)
    else:
        dst.index_put_(unravel_flat(index.long(), dst.shape), values)


def unravel_flat(flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Coordinates of C-order flat positions (torch.unravel_index imports sympy on first use,
    a third of a second inside the first refit)."""
    coords = []
    for extent in reversed(shape):
        coords.append(flat % extent)
        flat = flat // extent
    return tuple(reversed(coords))
