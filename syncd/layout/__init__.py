"""The layout language: every local tensor is a set of boxes of named canonical tensors."""

from syncd.layout.box import Box, split_range
from syncd.layout.catalog import CanonicalTensor, Catalog, LocalTensor, Piece, owning_layer
from syncd.layout.dtypes import Conversion, conversion, dtype_bytes
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
    "Box",
    "Canon",
    "CanonicalTensor",
    "Catalog",
    "Concat",
    "Conversion",
    "InterleavedShard",
    "LocalTensor",
    "Piece",
    "Placement",
    "Replicate",
    "Shard",
    "Sharded",
    "Stack",
    "conversion",
    "dtype_bytes",
    "local_tensor",
    "owning_layer",
    "split_range",
]
