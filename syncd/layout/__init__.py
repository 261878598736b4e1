"""The layout language: every local tensor is a set of boxes of named canonical tensors."""

from syncd.layout.box import Box, split_range
from syncd.layout.catalog import DTYPE_BYTES, CanonicalTensor, Catalog, LocalTensor, Piece, dtype_bytes
from syncd.layout.placements import (
    Canon,
    Concat,
    InterleavedShard,
    Placement,
    Replicate,
    Shard,
    Sharded,
    Stack,
    local_tensor,
)

__all__ = [
    "DTYPE_BYTES",
    "Box",
    "Canon",
    "CanonicalTensor",
    "Catalog",
    "Concat",
    "InterleavedShard",
    "LocalTensor",
    "Piece",
    "Placement",
    "Replicate",
    "Shard",
    "Sharded",
    "Stack",
    "dtype_bytes",
    "local_tensor",
    "split_range",
]
