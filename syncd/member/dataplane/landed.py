"""Verifying what landed, not only what travelled.

The data plane checksums every unit's packed bytes on both sides (`checksum.Checksums`, keyed by
`syncd.commands.checksum_key`): that proves the wire. Between the receiver's checksum of a bucket
and the tensor the engine computes with, our own code still runs (the unpack, the in-place
writes), and the checksum of a bucket runs on a worker thread that races the unpack. So once a
receive loop has unpacked a bucket, the receiver checksums each of its units again where it
landed (staging, or a layer's tensors before vLLM post-processes them) with the same algorithm
and key, on the same checksum worker (or GPU stream) behind the bucket's wire checksum, so it
overlaps the next buckets' transfers; after the last bucket it requires the two to be equal
before it reports TRANSFERRED: a unit's packed bytes
are its destination region's bytes in C order (`pack.copy_pairs` views them so), so the values
are comparable one to one. The received checksums are what syncd compares with the senders', so
a landed region equal to them is equal to what the senders packed.

On CPU the landed checksums replace the wire ones: the receive loop does not hash the arrived
bytes, and reports the landed checksums as what it received (`executor._Loop.landed_is_received`),
so syncd's comparison with the senders' covers the wire and the unpack in one xxh3 pass per byte
(the prepared loop gathers a bucket's strided destination regions back into its packed layout in
scratch memory first, `prepared.PreparedBucket.landed`). On GPUs, where the wire reductions are
part of the buckets' captured programs, both are taken and `check_landed` compares them; the
landed ones come from `checksum_kernel`, which reads each region where it lies.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.checksum_kernel import collapse
from syncd.member.dataplane.pack import Copies
from syncd.plan.types import Bucket, TransferUnit


class CpuLanded:
    """The landed check of one received bucket on CPU, prepared once per plan (the regions, the
    copies and the arrays are fixed between refits; `prepared.PreparedBucket` keeps it). A unit
    whose region lies in runs of at least `RUN_BYTES` is hashed where it lies, run after run; the
    others are gathered into `scratch` (the bucket's size, in its packed layout) in one call and
    hashed there. (Per region, a copy into fresh memory and the tensor calls around it from
    Python cost about 20 us, and the check of the demo's model, 105 units of 21 KB on average,
    was host-bound by them; the copy was most of the rest.)"""

    RUN_BYTES = 4096  # a run's hash call costs under a tenth of copying it

    def __init__(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], scratch: torch.Tensor) -> None:
        self._gather = Copies()
        self._pieces: list[tuple[str, int, list[memoryview]]] = []  # key, bytes, what to hash in order
        offset = 0
        for u in bucket.units:
            region = tensors[u.dst_tensor][u.dst_box.slices()]
            runs = long_runs(region, self.RUN_BYTES)
            if runs is None:
                gathered = scratch[offset : offset + u.nbytes]
                self._gather.dsts.append(gathered.view(region.dtype).view(region.shape))
                self._gather.srcs.append(region)
                runs = [gathered]
            self._pieces.append(
                (checksum_key(u.canonical, u.canon), u.nbytes, [r.numpy().data for r in runs])
            )
            offset += u.nbytes

    def add_to(self, sums: Checksums) -> None:
        self._gather.run()
        for key, nbytes, pieces in self._pieces:
            sums.add_pieces(key, nbytes, pieces)


def long_runs(region: torch.Tensor, min_bytes: int) -> list[torch.Tensor] | None:
    """`region`'s bytes in C order as its contiguous runs (uint8 views), or None when it has more
    than one run and they are shorter than `min_bytes`."""
    dims, steps = collapse(tuple(region.shape), tuple(region.stride()))
    if len(dims) == 1 and steps[0] == 1:
        return [region.reshape(-1).view(torch.uint8)]
    if steps[-1] != 1 or dims[-1] * region.element_size() < min_bytes:
        return None
    base = region.storage_offset()
    return [
        region.as_strided((dims[-1],), (1,), base + sum(i * s for i, s in zip(index, steps))).view(
            torch.uint8
        )
        for index in itertools.product(*(range(d) for d in dims[:-1]))
    ]


class LandedMismatch(RuntimeError):
    """A unit's bytes in its destination are not the bytes that arrived for it."""


def add_landed(units: Iterable[TransferUnit], tensors: Mapping[str, torch.Tensor], sums: Checksums) -> None:
    """Add the checksum of each unit's destination region in `tensors` (catalog views) to `sums`,
    by unit key."""
    for u in units:
        sums.add_region(checksum_key(u.canonical, u.canon), tensors[u.dst_tensor][u.dst_box.slices()])
    sums.flush()  # on GPUs: now, on this stream, behind the writes it checks


def landed_checksums(units: Iterable[TransferUnit], tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Checksums of each unit's destination region in `tensors`, by unit key."""
    sums = Checksums()
    add_landed(units, tensors, sums)
    return sums.result()


def check_landed(buckets: Sequence[Bucket], received: Mapping[str, str], landed: Mapping[str, str]) -> None:
    """Raise `LandedMismatch` naming every unit (tensor and region) whose landed checksum is
    missing or differs from the checksum of the bytes that arrived for it."""
    problems = []
    for b in buckets:
        for u in b.units:
            key = checksum_key(u.canonical, u.canon)
            got, want = landed.get(key), received.get(key)
            if got is None:
                problems.append(
                    f"tensor {u.canonical} region {u.canon} (from {b.src}): not verified where it landed"
                )
            elif got != want:
                problems.append(
                    f"tensor {u.canonical} region {u.canon} (from {b.src}, into {u.dst_tensor}): "
                    f"received {want}, landed {got}"
                )
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise LandedMismatch(f"bytes written differ from bytes received: {shown}")
