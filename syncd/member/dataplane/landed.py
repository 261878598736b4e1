"""Verifying what landed, not only what travelled.

Senders checksum every unit's packed bytes (`checksum.Checksums`, keyed by
`syncd.commands.checksum_key`), and syncd compares them with the receivers' before any commit.
Between the bytes that arrive and the tensor the engine computes with, our own code still runs
(the unpack, the in-place writes). So a receiver does not checksum the bytes that arrived: once
a receive loop has unpacked a bucket it checksums each unit where it landed (staging, or a
layer's tensors before vLLM post-processes them) with the same algorithm and key, on its
checksum worker (or GPU stream) so that it overlaps the next buckets' transfers, and reports
those as what it received. A unit's packed bytes are its destination region's bytes in C order
(`pack.copy_pairs` views them so), so the values compare one to one, and syncd's comparison
covers the wire and the unpack in one pass per byte. A mismatch aborts the refit naming tensor
and region (`syncd.daemon.checks`).

On CPU the check is xxh3, taken in the unpack itself (`fused.FusedCopies.unpack`: long runs hashed
where they lie, the rest gathered into scratch memory first); on GPUs `checksum_kernel` reads each
region where it lies, a bucket's regions in one launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane.checksum import Checksums
from syncd.plan.types import TransferUnit


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
