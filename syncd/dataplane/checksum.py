"""Checksums of transferred regions, computed identically on sender and receiver, CPU or GPU.

A Fletcher-style pair over the region's bytes read as 32-bit words (bytes when the size is not a
multiple of 4): the plain sum and a position-weighted sum, both wrapping in int64. It catches
dropped, duplicated, reordered and corrupted words, runs as two reductions on the tensor's own
device, and needs no extra library.
"""

from __future__ import annotations

import torch

_MOD = 65521  # keep position weights small so the weighted sum stays meaningful when it wraps


def checksum(region: torch.Tensor) -> str:
    """Checksum of a (possibly non-contiguous) tensor's bytes in C order."""
    flat = region.contiguous().view(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    wide = words.to(torch.int64)
    weights = torch.arange(1, wide.numel() + 1, device=wide.device, dtype=torch.int64) % _MOD
    total = int(wide.sum())
    weighted = int((wide * weights).sum())
    return f"{flat.numel():x}:{total & 0xFFFFFFFFFFFFFFFF:016x}:{weighted & 0xFFFFFFFFFFFFFFFF:016x}"


def unit_key(canonical: str, start: tuple[int, ...], stop: tuple[int, ...]) -> str:
    """How checksums name a canonical region, on both sides and in syncd's comparison."""
    return canonical + "[" + ",".join(f"{a}:{b}" for a, b in zip(start, stop)) + "]"
