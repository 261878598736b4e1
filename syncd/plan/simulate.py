"""A NumPy reference executor: what every data plane must do, without a network.

Used by property tests (random layouts in, bit-exact arrays out) and by services' own tests to
check that a catalog describes their tensors.

NumPy has no bfloat16, so bfloat16 arrays here hold their bit patterns as uint16 (`NUMPY_DTYPES`),
and `convert` is an independent NumPy reference of the casts the sender applies (round to nearest
even, as torch's `.to()`), so tests can check the torch data plane against it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from syncd.layout import Catalog
from syncd.plan.types import Bucket, Plan

NUMPY_DTYPES: dict[str, type] = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bit patterns
}

_BF16_QUIET_NAN = np.uint16(0x7FC0)  # what torch writes for any NaN


def convert(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """`values` (held as `NUMPY_DTYPES[src]`) converted to `dst`: the reference of every cast in
    `syncd.layout.dtypes.CASTS`, and the identity. Bit-exact except a NaN's payload, which no cast
    specifies (torch's CPU and CUDA casts differ there): a NaN stays a NaN."""
    if src == dst:
        return values
    if (src, dst) == ("float32", "bfloat16"):
        return _float32_to_bfloat16_bits(values)
    if (src, dst) == ("bfloat16", "float32"):
        return (values.astype(np.uint32) << 16).view(np.float32)
    if (src, dst) in {("float32", "float16"), ("float16", "float32")}:
        with np.errstate(over="ignore"):  # overflow to infinity is the cast's defined result
            return values.astype(NUMPY_DTYPES[dst])  # IEEE casts, NumPy rounds to nearest even
    raise ValueError(f"no reference conversion from {src} to {dst}")


def _float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even on the bit pattern: add 0x7FFF plus the lowest kept bit, truncate.
    Overflow carries into the exponent, which is right (to infinity); NaNs become the quiet NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), _BF16_QUIET_NAN, rounded)


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
    """The sender's side: the bucket's units, converted to their dtype, flattened in C order and
    concatenated as bytes."""
    parts = []
    for u in bucket.units:
        if u.quantized:  # NumPy has no e4m3; the torch data plane is the only FP8 sender
            raise ValueError(
                f"{u.canonical}: blockwise-FP8 units are packed by syncd.member.dataplane.pack only"
            )
        values = tensors[u.src_tensor][u.src_box.slices()].reshape(-1)
        parts.append(np.ascontiguousarray(convert(values, u.src_dtype or u.dtype, u.dtype)).view(np.uint8))
    return np.concatenate(parts)


def unpack(bucket: Bucket, flat: np.ndarray, tensors: Mapping[str, np.ndarray]) -> None:
    """The receiver's side: scatter a packed bucket (bytes) into the destination tensors."""
    offset = 0
    for u in bucket.units:
        dst = tensors[u.dst_tensor]
        dst[u.dst_box.slices()] = flat[offset : offset + u.nbytes].view(dst.dtype).reshape(u.dst_box.shape)
        offset += u.nbytes


def execute(
    plan: Plan,
    sources: Mapping[str, Mapping[str, np.ndarray]],
    destinations: Mapping[str, dict[str, np.ndarray]],
) -> None:
    """Run every bucket of `plan` from `sources[member][tensor]` into `destinations[member][tensor]`."""
    for bucket in plan.buckets:
        flat = pack(bucket, sources[bucket.src])
        if flat.nbytes != bucket.nbytes:
            raise AssertionError(
                f"bucket {bucket.src}->{bucket.dst}#{bucket.index} packed {flat.nbytes} bytes, "
                f"planned {bucket.nbytes}"
            )
        unpack(bucket, flat, destinations[bucket.dst])
