"""Packing plan buckets into flat buffers and back, with torch (CPU or GPU).

`tensors` maps a catalog's local tensor names to tensors already viewed as the catalog's shape
(`LocalTensor.shape`); `catalog_views` builds that mapping from a member's own tensors.

The sender converts while packing: each unit's bytes in the bucket are in the unit's `dtype` (the
destination's), whatever the sender holds, so the wire and both sides' checksums carry the
converted bytes and the receiver unpacks plain copies. The cast is the copy into the bucket itself
(torch's `copy_` rounds like `.to()`: to nearest even), so no other buffer is needed. It casts
from whatever the sender's tensor holds (`catalog_views` checked that against its catalog, and the
planner checked the pair), so it does not depend on `TransferUnit.src_dtype`, which the gRPC
message does not carry yet.
"""

from __future__ import annotations

from typing import Mapping

import torch

from syncd.layout import Catalog
from syncd.layout.dtypes import torch_dtype
from syncd.plan.types import Bucket


def catalog_views(catalog: Catalog, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views (no copies) of `tensors` in the catalog's shapes. Raises ValueError naming the tensor
    when one is missing, non-contiguous, of another dtype or of another size."""
    out = {}
    for t in catalog.tensors:
        if t.name not in tensors:
            raise ValueError(f"catalog tensor {t.name} has no local tensor")
        x = tensors[t.name]
        if x.dtype != torch_dtype(t.dtype):
            raise ValueError(f"{t.name} is {x.dtype}, the catalog says {t.dtype}")
        if not x.is_contiguous() or x.numel() != torch.Size(t.shape).numel():
            raise ValueError(f"{t.name}: a contiguous tensor of {t.shape} elements is needed, got {tuple(x.shape)}")
        out[t.name] = x.view(t.shape)
    return out


def _region(t: torch.Tensor, box) -> torch.Tensor:
    return t[box.slices()]


def pack_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's source regions into the byte buffer `out` (at least `bucket.nbytes`),
    converted to each unit's dtype; returns the filled prefix."""
    offset = 0
    for u in bucket.units:
        src = _region(tensors[u.src_tensor], u.src_box)
        dst = out[offset : offset + u.nbytes].view(torch_dtype(u.dtype)).view(src.shape)
        dst.copy_(src)
        offset += u.nbytes
    return out[:offset]


def unpack_from(bucket: Bucket, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed byte buffer into the bucket's destination regions."""
    offset = 0
    for u in bucket.units:
        dst = _region(tensors[u.dst_tensor], u.dst_box)
        dst.copy_(flat[offset : offset + u.nbytes].view(dst.dtype).view(dst.shape))
        offset += u.nbytes
