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

On CPU this is one xxh3 pass over the received bytes (after a copy of a region that is not
contiguous in its tensor: `Checksums.add_region`); on GPUs the same two reductions per region as
the wire checksums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane.checksum import Checksums
from syncd.plan.types import Bucket, TransferUnit


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
