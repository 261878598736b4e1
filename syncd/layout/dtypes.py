"""The one registry of element types: the names catalogs use, their sizes, their torch dtypes, and
which conversions the sender may apply while packing.

Catalogs name dtypes by torch's attribute names ("float32", "bfloat16", ...). syncd's control plane
imports this module and does not need torch, so torch is imported only inside `torch_dtype`, which
only data planes call.

Conversions (`conversion(src, dst, tensor=...)`): the identity for every dtype; float32 -> bfloat16
and float32 -> float16 rounded to nearest even, exactly torch's `.to()` (what the sender's copy
into the bucket does); bfloat16 -> float32 and float16 -> float32, which are exact. Every other
pair is refused: narrowing to FP8 needs scales (a quantizer, not a cast: the planner plans
blockwise-FP8 destinations itself, `syncd.plan.fp8_blocks`), and a silent
float64 -> float32 or bfloat16 <-> float16 cast would lose range or precision nobody asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One element type as catalogs name it (also its attribute name in torch)."""

    name: str
    itemsize: int
    safetensors: str  # the dtype code in a safetensors header


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", 8, "F64"),
        DType("float32", 4, "F32"),
        DType("bfloat16", 2, "BF16"),
        DType("float16", 2, "F16"),
        DType("float8_e4m3fn", 1, "F8_E4M3"),
        DType("float8_e5m2", 1, "F8_E5M2"),
        DType("int64", 8, "I64"),
        DType("int32", 4, "I32"),
        DType("int16", 2, "I16"),
        DType("int8", 1, "I8"),
        DType("uint8", 1, "U8"),
        DType("bool", 1, "BOOL"),
    )
}

# (source, destination) pairs that the sender casts while packing, besides the identity.
CASTS: frozenset[tuple[str, str]] = frozenset(
    {
        ("float32", "bfloat16"),  # round to nearest even
        ("float32", "float16"),  # round to nearest even
        ("bfloat16", "float32"),  # exact
        ("float16", "float32"),  # exact
    }
)


@dataclass(frozen=True, slots=True)
class Conversion:
    """What the sender does to the elements of one canonical tensor: read `src`, write `dst`."""

    src: str
    dst: str

    @property
    def is_identity(self) -> bool:
        return self.src == self.dst


def lookup(name: str) -> DType:
    """The registered dtype `name`; ValueError listing the known names otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype `name`."""
    return lookup(name).itemsize


def conversion(src: str, dst: str, *, tensor: str) -> Conversion:
    """The conversion from `src` to `dst` for canonical tensor `tensor`. Raises ValueError naming
    the tensor and both dtypes when the pair is not supported (or a dtype is unknown)."""
    lookup(src)
    lookup(dst)
    if src != dst and (src, dst) not in CASTS:
        supported = ", ".join(f"{a} -> {b}" for a, b in sorted(CASTS))
        raise ValueError(
            f"canonical tensor {tensor}: cannot convert {src} (source) to {dst} (destination); "
            f"supported conversions: identity, {supported}"
        )
    return Conversion(src, dst)


@cache  # packing asks once per unit, on the host path that feeds the GPU
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of `name` (imports torch: for data planes only)."""
    import torch

    return getattr(torch, lookup(name).name)
