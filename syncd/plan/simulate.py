"""A NumPy reference executor: what every data plane must do, without a network.

Used by property tests (random layouts in, bit-exact arrays out) and by services' own tests to
check that a catalog describes their tensors.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from syncd.layout import Catalog
from syncd.plan.types import Bucket, Plan


def materialize(catalog: Catalog, canonical: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every local tensor of `catalog`, filled from the canonical tensors through its pieces.
    Elements no piece covers stay zero."""
    out = {}
    for t in catalog.tensors:
        local = np.zeros(t.shape, dtype=canonical[t.pieces[0].canonical].dtype if t.pieces else np.float32)
        for p in t.pieces:
            local[p.local.slices()] = canonical[p.canonical][p.canon.slices()].reshape(p.local.shape)
        out[t.name] = local
    return out


def pack(bucket: Bucket, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The sender's side: the bucket's units, flattened in C order and concatenated."""
    return np.concatenate([tensors[u.src_tensor][u.src_box.slices()].reshape(-1) for u in bucket.units])


def unpack(bucket: Bucket, flat: np.ndarray, tensors: Mapping[str, np.ndarray]) -> None:
    """The receiver's side: scatter a packed bucket into the destination tensors."""
    offset = 0
    for u in bucket.units:
        n = u.dst_box.numel
        tensors[u.dst_tensor][u.dst_box.slices()] = flat[offset : offset + n].reshape(u.dst_box.shape)
        offset += n


def execute(
    plan: Plan,
    sources: Mapping[str, Mapping[str, np.ndarray]],
    destinations: Mapping[str, dict[str, np.ndarray]],
) -> None:
    """Run every bucket of `plan` from `sources[member][tensor]` into `destinations[member][tensor]`."""
    for bucket in plan.buckets:
        flat = pack(bucket, sources[bucket.src])
        if flat.nbytes != bucket.nbytes:
            raise AssertionError(f"bucket {bucket.src}->{bucket.dst}#{bucket.index} packed {flat.nbytes} bytes, planned {bucket.nbytes}")
        unpack(bucket, flat, destinations[bucket.dst])
