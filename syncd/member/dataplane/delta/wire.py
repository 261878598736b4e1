"""What both ends of a delta link agree on, from the plan alone: the parts of a message and their
alignment, what a unit's header code costs on the wire, which buckets go dense, how a link is cut
into groups (a header and a piece each), and the trailers that mark a message's end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from syncd.member.dataplane.executor import TransferAborted, TransferStats
from syncd.plan.types import Bucket, TransferUnit

_INDEX = torch.int32  # positions within one unit: units are cut at bucket size, far below 2**31 elements

_ALIGN = 8  # every part of a delta message starts 8-byte aligned, so it can be viewed in its dtype


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _sparse_bytes(changed: int, itemsize: int) -> int:
    return _aligned(changed * _INDEX.itemsize) + _aligned(changed * itemsize)


# A delta link travels in groups of buckets of at most this many (dense) bytes, a header and a piece
# each: small enough that the comparison, the wire, each hop of a chain and the receivers' apply
# overlap, large enough that a hop is not one wake-up per bucket (2.5 % changed: ~1.2 MB pieces).
_GROUP_BYTES = 16 << 20

_TRAILER = 8  # a piece ends with its byte count (int64), a header with its code count: `_Incoming`

# Added to a link's first header's trailer when every bucket of the link goes dense: the sender sends
# no other header for the link (`_dense_whole`), its receiver takes no other.
_REST_DENSE = 1 << 40


def _unit_bytes(code: int, u: TransferUnit) -> int:
    itemsize = u.nbytes // u.canon.numel
    return _sparse_bytes(code, itemsize) if code >= 0 else _aligned(u.nbytes)


def _dense_bucket(codes: Sequence[int], bucket: Bucket, max_fraction: float) -> bool:
    """A bucket goes dense whole when its delta would not save `max_fraction` of its bytes, or
    when it holds blockwise-FP8 units (the executor's packing quantizes them)."""
    if any(u.quantized for u in bucket.units):
        return True
    delta = sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units))
    return all(c < 0 for c in codes) or delta > max_fraction * bucket.nbytes


@dataclass
class DeltaStats(TransferStats):
    """A member's transfer with delta links: bytes actually moved; over its delta links, the units'
    elements and how many of them changed."""

    elements: int = 0
    changed: int = 0
    touched: set[str] = field(default_factory=set)  # receiver: its tensors that took new values


def _add(total: DeltaStats, part: TransferStats) -> None:
    total.bytes += part.bytes
    total.buckets += part.buckets
    total.checksums.update(part.checksums)


def _groups(link: Sequence[Bucket]) -> list[list[Bucket]]:
    """A link's buckets cut, in order, into groups of at most `_GROUP_BYTES` (at least one bucket):
    each group is one header and one piece. Sender and receivers cut alike, from the plan alone."""
    groups: list[list[Bucket]] = []
    size = 0
    for bucket in link:
        if groups and size + bucket.nbytes <= _GROUP_BYTES:
            groups[-1].append(bucket)
            size += bucket.nbytes
        else:
            groups.append([bucket])
            size = bucket.nbytes
    return groups


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise TransferAborted("transfer aborted")
