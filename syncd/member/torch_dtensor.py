"""The one adapter to DTensor's private internals that `syncd.member.dtensor` needs.

DTensor's public API says what a placement is (`Shard(dim)`: `torch.chunk` semantics, uneven and
empty shards allowed; `Replicate`; `Partial`), but `_StridedShard` (what FSDP2 produces on top of
tensor parallelism) is private, and so is the code that cuts a tensor by a placement. Rather than
restate DTensor's cutting rules here (and drift from them), we run DTensor's own `_split_tensor` on
index vectors: whatever torch does to a tensor, it does to `arange(n)`, and the result says which
global indices a rank holds. Every private symbol is imported here, once, behind a version guard,
and `tests/dtensor/test_torch_dtensor_adapter.py` tests each one.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

# Tested against these torch releases (major.minor); another one may have moved a private symbol.
TESTED_TORCH = ("2.13",)

try:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError as e:  # pragma: no cover - only on an untested torch
    raise ImportError(
        f"torch {torch.__version__}: a DTensor internal that syncd.member.torch_dtensor needs "
        f"moved ({e}); tested with torch {', '.join(TESTED_TORCH)}"
    ) from e

__all__ = [
    "DTensor",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "held_indices",
    "local_shape",
    "shard_dim",
    "split_factor",
    "torch_version_tested",
]

StridedShard = _StridedShard


def torch_version_tested() -> bool:
    return ".".join(torch.__version__.split(".")[:2]) in TESTED_TORCH


def split_factor(p: Placement) -> int:
    """A `_StridedShard`'s split factor as an int (it may be symbolic under tracing)."""
    return int(p.split_factor)  # type: ignore[attr-defined]  # only _StridedShard has it


def shard_dim(p: Placement) -> int:
    """The tensor dim a `Shard` or `_StridedShard` cuts."""
    return int(p.dim)  # type: ignore[attr-defined]  # torch's Placement base class does not declare dim


def held_indices(placement: Placement, indices: torch.Tensor, num_chunks: int, coord: int) -> torch.Tensor:
    """The part of the 1-D `indices` that mesh coordinate `coord` of `num_chunks` holds under
    `placement` (a `Shard` or `_StridedShard`, applied here to dim 0), by DTensor's own split."""
    if isinstance(placement, StridedShard):
        on_dim0: Placement = StridedShard(0, split_factor=split_factor(placement))
    elif isinstance(placement, Shard):
        on_dim0 = Shard(0)
    else:
        raise TypeError(f"{placement} does not cut a tensor")
    shards, _ = on_dim0._split_tensor(indices, num_chunks, with_padding=False, contiguous=False)  # type: ignore[attr-defined]  # private: see module docstring
    return shards[coord]


def local_shape(dt: DTensor) -> tuple[int, ...]:
    """DTensor's own account of this rank's local shape (for a cross-check)."""
    shape, _ = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(shape)
