"""Packing plan buckets into flat buffers and back, with torch (CPU or GPU).

`tensors` maps a catalog's local tensor names to tensors already viewed as the catalog's shape
(`LocalTensor.shape`); `catalog_views` builds that mapping from a member's own tensors.

The sender converts while packing: each unit's bytes in the bucket are in the unit's `dtype` (the
destination's), whatever the sender holds, so the wire and both sides' checksums carry the
converted bytes and the receiver unpacks plain copies. The cast is the copy into the bucket itself
(torch's `copy_` rounds like `.to()`: to nearest even), so no other buffer is needed. It casts
from whatever the sender's tensor holds (`catalog_views` checked that against its catalog, and the
planner checked the pair), so it does not depend on `TransferUnit.src_dtype`.

Units of a blockwise-FP8 destination (`TransferUnit.quantized`) are not copies of the sender's
elements but outputs of the block quantizer (`syncd.member.dataplane.fp8`) on the whole blocks they
belong to; the sender computes them while packing, every refit, from its current weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from syncd.layout import Box, Catalog
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import fp8_kernel
from syncd.member.dataplane.fp8 import block_scales, quantized_view
from syncd.plan.fp8_blocks import scale_shape, to_grid
from syncd.plan.types import Bucket, TransferUnit
from syncd.vocabulary import Direction, Fp8Part


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
            raise ValueError(
                f"{t.name}: a contiguous tensor of {t.shape} elements is needed, got {tuple(x.shape)}"
            )
        out[t.name] = x.view(t.shape)
    return out


@dataclass
class Copies:
    """A bucket's copies, as views (no data moved yet): `dsts[i]` from `srcs[i]`, and `computed`:
    functions that fill their part of the bucket from the sender's current tensors, one per FP8
    unit in the bucket's order (a scales unit whose values unit's kernel writes it too has one
    that does nothing: read the bucket only after `run`)."""

    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    computed: list[Callable[[], None]] = field(default_factory=list)

    def run(self) -> None:
        if len(self.dsts) == 1:
            self.dsts[0].copy_(self.srcs[0])
        elif self.dsts:  # one call for all units: the per-copy dispatch runs in C++, not in Python
            torch._foreach_copy_(self.dsts, self.srcs)
        for fill in self.computed:
            fill()


def copy_pairs(
    direction: Direction, bucket: Bucket, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor
) -> Copies:
    """The bucket's copies, unit by unit: for SEND from the source regions into the byte buffer
    `flat` (each unit's slice viewed in the unit's dtype, so the copy casts; FP8 units quantized),
    for RECV from `flat` into the destination regions. Views only, no copies."""
    copies = Copies()
    packed_of: list[torch.Tensor] = []
    offset = 0
    for u in bucket.units:
        packed_of.append(flat[offset : offset + u.nbytes])
        offset += u.nbytes
    scales_of = _scales_beside_values(bucket.units, tensors) if direction == Direction.SEND else {}
    for i, (u, packed) in enumerate(zip(bucket.units, packed_of)):
        if direction == Direction.SEND and u.quantized:
            partner = scales_of.get(i)
            if partner is not None and u.quantized == Fp8Part.SCALES:  # its values' kernel writes it
                copies.computed.append(_nothing)
                continue
            scales = None if partner is None else _typed(bucket.units[partner], packed_of[partner])
            copies.computed.append(_quantized(u, tensors, _typed(u, packed), scales))
        elif direction == Direction.SEND:
            src = tensors[u.src_tensor][u.src_box.slices()]
            copies.dsts.append(packed.view(torch_dtype(u.dtype)).view(src.shape))
            copies.srcs.append(src)
        else:
            dst = tensors[u.dst_tensor][u.dst_box.slices()]
            copies.dsts.append(dst)
            copies.srcs.append(packed.view(dst.dtype).view(dst.shape))
    return copies


def _typed(u: TransferUnit, packed: torch.Tensor) -> torch.Tensor:
    return packed.view(torch_dtype(u.dtype)).view(u.canon.shape)


def _nothing() -> None:
    """A scales unit's fill where its values unit's kernel writes them (`_scales_beside_values`)."""


def _scales_beside_values(
    units: Sequence[TransferUnit], tensors: Mapping[str, torch.Tensor]
) -> dict[int, int]:
    """Pairs of one bucket's units, both ways (index to index): an FP8 values unit and the scales
    unit of the same whole blocks of the same source region, where the fused kernel takes them.
    One kernel then reads the blocks once and writes both; apart, the scales unit read all of the
    blocks' bf16 again (a third more memory traffic than the values' own pass)."""
    values: dict[tuple, int] = {}
    pairs: dict[int, int] = {}
    for i, u in enumerate(units):
        if u.quantized == Fp8Part.VALUES and u.block_box == u.canon:
            values[(u.src_tensor, u.src_box, u.block_box)] = i
    for i, u in enumerate(units):
        if u.quantized != Fp8Part.SCALES or u.block_box is None or u.canon != to_grid(u.block_box):
            continue
        j = values.get((u.src_tensor, u.src_box, u.block_box))
        if j is not None and j not in pairs and fp8_kernel.available(tensors[u.src_tensor]):
            pairs[i], pairs[j] = j, i
    return pairs


def _quantized(
    u: TransferUnit,
    tensors: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> Callable[[], None]:
    """A function writing the FP8 values or scales of unit `u` into `out` (its slice of the
    bucket), quantized from its whole blocks (`u.block_box`, canonical) as they are when called.
    On NVIDIA GPUs one fused kernel (`fp8_kernel`) writes straight into the bucket when the unit is
    whole blocks, and a values unit's kernel writes its blocks' scales into `scales` (the slice of
    the scales unit of the same blocks, when the bucket carries it); otherwise the reference
    quantizer computes them and they are copied in."""
    assert u.block_box is not None
    region = tensors[u.src_tensor][u.src_box.slices()]
    shape = u.block_box.shape
    origin = u.block_box if u.quantized == Fp8Part.VALUES else to_grid(u.block_box)
    whole = u.canon == origin  # the unit is all of the blocks it reads
    take = Box(
        tuple(a - o for a, o in zip(u.canon.start, origin.start)),
        tuple(b - o for b, o in zip(u.canon.stop, origin.start)),
    ).slices()
    # `reshape` at each call, not once: where it must copy, the copy is of the current weights.
    if whole and fp8_kernel.available(region):
        if u.quantized == Fp8Part.VALUES:
            into = scales
            if into is None:
                into = torch.empty(scale_shape(shape), dtype=torch.float32, device=region.device)
            return lambda: fp8_kernel.quantize_into(region.reshape(shape), out, into)
        return lambda: fp8_kernel.quantize_into(region.reshape(shape), None, out)

    def values() -> None:
        out.copy_(quantized_view(region.reshape(shape))[0][take])

    def scales_only() -> None:  # only the amax pass: scales units do not pay for the values
        out.copy_(block_scales(region.reshape(shape))[take])

    return values if u.quantized == Fp8Part.VALUES else scales_only


def pack_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's source regions into the byte buffer `out` (at least `bucket.nbytes`),
    converted to each unit's dtype; returns the filled prefix."""
    copy_pairs(Direction.SEND, bucket, tensors, out).run()
    return out[: bucket.nbytes]


def unpack_from(bucket: Bucket, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed byte buffer into the bucket's destination regions."""
    copy_pairs(Direction.RECV, bucket, tensors, flat).run()
