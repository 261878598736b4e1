"""Packing plan buckets into flat buffers and back, with torch (CPU or GPU).

`tensors` maps a catalog's local tensor names to tensors already viewed as the catalog's shape
(`LocalTensor.shape`); `catalog_views` builds that mapping from a member's own tensors.
"""

from __future__ import annotations

from typing import Mapping

import torch

from syncd.layout import Catalog
from syncd.plan.types import Bucket

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def catalog_views(catalog: Catalog, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views (no copies) of `tensors` in the catalog's shapes. Raises ValueError naming the tensor
    when one is missing, non-contiguous, of another dtype or of another size."""
    out = {}
    for t in catalog.tensors:
        if t.name not in tensors:
            raise ValueError(f"catalog tensor {t.name} has no local tensor")
        x = tensors[t.name]
        if x.dtype != TORCH_DTYPES[t.dtype]:
            raise ValueError(f"{t.name} is {x.dtype}, the catalog says {t.dtype}")
        if not x.is_contiguous() or x.numel() != torch.Size(t.shape).numel():
            raise ValueError(f"{t.name}: a contiguous tensor of {t.shape} elements is needed, got {tuple(x.shape)}")
        out[t.name] = x.view(t.shape)
    return out


def _region(t: torch.Tensor, box) -> torch.Tensor:
    return t[box.slices()]


def pack_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's source regions into the byte buffer `out` (at least `bucket.nbytes`);
    returns the filled prefix."""
    offset = 0
    for u in bucket.units:
        src = _region(tensors[u.src_tensor], u.src_box)
        dst = out[offset : offset + u.nbytes].view(src.dtype).view(src.shape)
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
