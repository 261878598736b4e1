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


def copy_pairs(direction: str, bucket: Bucket, tensors: Mapping[str, torch.Tensor],
               flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destinations, sources) of the bucket's copies, unit by unit: for "send" from the source
    regions into the byte buffer `flat` (each unit's slice viewed in the unit's dtype, so the copy
    casts), for "recv" from `flat` into the destination regions. Views only, no copies."""
    dsts, srcs = [], []
    offset = 0
    for u in bucket.units:
        packed = flat[offset : offset + u.nbytes]
        offset += u.nbytes
        if direction == "send":
            src = tensors[u.src_tensor][u.src_box.slices()]
            dsts.append(packed.view(torch_dtype(u.dtype)).view(src.shape))
            srcs.append(src)
        else:
            dst = tensors[u.dst_tensor][u.dst_box.slices()]
            dsts.append(dst)
            srcs.append(packed.view(dst.dtype).view(dst.shape))
    return dsts, srcs


def pack_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's source regions into the byte buffer `out` (at least `bucket.nbytes`),
    converted to each unit's dtype; returns the filled prefix."""
    for dst, src in zip(*copy_pairs("send", bucket, tensors, out)):
        dst.copy_(src)
    return out[: bucket.nbytes]


def unpack_from(bucket: Bucket, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed byte buffer into the bucket's destination regions."""
    for dst, src in zip(*copy_pairs("recv", bucket, tensors, flat)):
        dst.copy_(src)
