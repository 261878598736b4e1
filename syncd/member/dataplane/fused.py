"""On CPU, copies that hash what they wrote while it is still in cache.

On two cores the refit is bound by memory traffic, not by either core: one thread copies at about
6 GB/s here, two processes copying at once reach about 7 GB/s together. A pack followed by the
xxh3 of the packed bytes on another thread reads the bytes from memory twice, and so does an
unpack followed by the landed check. Here a unit is copied in chunks of about `CHUNK_BYTES`
(whole rows of its first dimension), and each chunk is hashed right after it is written, from
cache; xxh3 streams, so the checksum is the one of the unit's bytes side by side, as the
unfused path computes it (`checksum.Checksums.add`).

- Pack (`FusedCopies.pack`): each chunk of the source region is copied (and cast) into the
  bucket, and the bucket's chunk hashed: the sender's checksum of the packed bytes.
- Unpack with the landed check (`FusedCopies.unpack`): each chunk of the bucket is copied into
  its destination, and the destination chunk hashed where it lies (runs of `checksum.LONG_RUN_BYTES` or more)
  or gathered first into scratch memory (shorter runs): the landed checksum.
FP8 units (quantized from whole blocks) are computed whole and hashed after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import xxhash

from syncd.commands import checksum_key
from syncd.member.dataplane.checksum import LONG_RUN_BYTES, Checksums, long_runs
from syncd.member.dataplane.pack import copy_pairs
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction

CHUNK_BYTES = 1 << 20  # fits the L2 of a core here with room; 64 chunks of a 64 MiB bucket


@dataclass
class _Step:
    copy: Callable[[], object]
    hashed: list[memoryview]  # what the copy wrote (or gathered), in C order


@dataclass
class _Unit:
    key: str
    nbytes: int
    steps: list[_Step]


def _bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def _row_chunks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) cut into whole rows of their first dimension, about `CHUNK_BYTES` of `dst` each."""
    if dst.dim() == 0 or dst.numel() == 0:
        return [(dst, src)] if dst.numel() else []
    rows = dst.shape[0]
    row_bytes = dst.numel() // rows * dst.element_size()
    per = max(1, CHUNK_BYTES // row_bytes)
    return [(dst[r : r + per], src[r : r + per]) for r in range(0, rows, per)]


class FusedCopies:
    """A bucket's copies with their checksums, chunk by chunk (see the module docstring)."""

    def __init__(self, units: list[_Unit]) -> None:
        self._units = units

    @classmethod
    def pack(cls, bucket: Bucket, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> FusedCopies:
        copies = copy_pairs(Direction.SEND, bucket, tensors, flat)
        pairs, computed = iter(zip(copies.dsts, copies.srcs)), iter(copies.computed)
        units, offset = [], 0
        for u in bucket.units:
            packed = flat[offset : offset + u.nbytes]
            offset += u.nbytes
            if u.quantized:
                steps = [_Step(next(computed), [_bytes(packed)])]
            else:
                dst, src = next(pairs)
                steps = [_Step(_copier(d, s), [_bytes(d)]) for d, s in _row_chunks(dst, src)]
            units.append(_Unit(checksum_key(u.canonical, u.canon), u.nbytes, steps))
        return cls(units)

    @classmethod
    def unpack(
        cls, bucket: Bucket, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor, scratch: torch.Tensor
    ) -> FusedCopies:
        """`scratch`: the bucket's size, where chunks of short runs are gathered to be hashed."""
        copies = copy_pairs(Direction.RECV, bucket, tensors, flat)
        base = flat.data_ptr()
        units = []
        for u, dst, src in zip(bucket.units, copies.dsts, copies.srcs):
            steps = []
            for d, s in _row_chunks(dst, src):
                runs = long_runs(d, LONG_RUN_BYTES)
                if runs is not None:
                    steps.append(_Step(_copier(d, s), [r.numpy().data for r in runs]))
                    continue
                start = s.data_ptr() - base  # the chunk's place in the bucket, and in scratch
                gathered = scratch[start : start + d.numel() * d.element_size()]
                steps.append(_Step(_gatherer(d, s, gathered.view(d.dtype).view(d.shape)), [_bytes(gathered)]))
            units.append(_Unit(checksum_key(u.canonical, u.canon), u.nbytes, steps))
        return cls(units)

    def run(self, sums: Checksums) -> None:
        """Copy every unit, adding its checksum to `sums`."""
        for unit in self._units:
            state = xxhash.xxh3_64()
            for step in unit.steps:
                step.copy()
                for piece in step.hashed:
                    state.update(piece)
            sums.add_xxh3(unit.key, unit.nbytes, state.intdigest())


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    return lambda: dst.copy_(src)


def _gatherer(dst: torch.Tensor, src: torch.Tensor, gathered: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        dst.copy_(src)
        gathered.copy_(dst)

    return run
