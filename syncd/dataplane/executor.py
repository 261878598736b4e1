"""Thin execution loops: send or receive one member's buckets of one stage, double-buffered.

Ordering rule that makes the loops deadlock-free without any coordination: every sender walks its
buckets by (dst, index) and every receiver by (src, index), both in the plan's global order, so a
waiting chain always moves to strictly smaller members and cannot close into a cycle.

Memory: each loop owns `in_flight` staging buffers of `bucket_bytes` (default 2: pack the next
bucket while the previous one is on the wire; unpack the previous while the next one arrives).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from syncd.dataplane.checksum import checksum, unit_key
from syncd.dataplane.pack import pack_into, unpack_from
from syncd.dataplane.transport import Handle, Transport
from syncd.plan.types import Bucket


class TransferAborted(RuntimeError):
    pass


@dataclass
class TransferStats:
    bytes: int = 0
    buckets: int = 0
    checksums: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _region(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in zip(box.start, box.stop))]


def _buffers(count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]


def send_buckets(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    *,
    timeout_s: float,
    in_flight: int = 2,
    verify: bool = True,
    cancel: threading.Event | None = None,
) -> TransferStats:
    """Send `buckets` (all with this member as src) reading from `tensors` (catalog views)."""
    stats, start = TransferStats(), time.perf_counter()
    if not buckets:
        return stats
    device = next(iter(tensors.values())).device
    bufs = _buffers(in_flight, max(b.nbytes for b in buckets), device)
    pending: list[Handle | None] = [None] * in_flight
    for i, bucket in enumerate(sorted(buckets, key=lambda b: (b.dst, b.index))):
        _check(cancel)
        slot = i % in_flight
        if pending[slot] is not None:
            pending[slot].wait(timeout_s)  # the buffer is free only once its send completed
        flat = pack_into(bucket, tensors, bufs[slot])
        pending[slot] = transport.isend(flat, ranks[bucket.dst])
        if verify:
            for u in bucket.units:
                stats.checksums[unit_key(u.canonical, u.canon.start, u.canon.stop)] = checksum(_region(tensors[u.src_tensor], u.src_box))
        stats.bytes += bucket.nbytes
        stats.buckets += 1
    for handle in pending:
        if handle is not None:
            handle.wait(timeout_s)
    stats.seconds = time.perf_counter() - start
    return stats


def recv_buckets(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    *,
    timeout_s: float,
    in_flight: int = 2,
    verify: bool = True,
    cancel: threading.Event | None = None,
) -> TransferStats:
    """Receive `buckets` (all with this member as dst) into `tensors` (catalog views)."""
    stats, start = TransferStats(), time.perf_counter()
    if not buckets:
        return stats
    device = next(iter(tensors.values())).device
    ordered = sorted(buckets, key=lambda b: (b.src, b.index))
    bufs = _buffers(in_flight, max(b.nbytes for b in ordered), device)
    posted: list[tuple[Bucket, torch.Tensor, Handle]] = []

    def post(i: int) -> None:
        bucket = ordered[i]
        flat = bufs[i % in_flight][: bucket.nbytes]
        posted.append((bucket, flat, transport.irecv(flat, ranks[bucket.src])))

    for i in range(min(in_flight, len(ordered))):
        post(i)
    for i in range(len(ordered)):
        _check(cancel)
        bucket, flat, handle = posted[i]
        handle.wait(timeout_s)
        unpack_from(bucket, flat, tensors)
        if verify:
            for u in bucket.units:
                stats.checksums[unit_key(u.canonical, u.canon.start, u.canon.stop)] = checksum(_region(tensors[u.dst_tensor], u.dst_box))
        stats.bytes += bucket.nbytes
        stats.buckets += 1
        if i + in_flight < len(ordered):
            post(i + in_flight)  # its buffer was just unpacked
    stats.seconds = time.perf_counter() - start
    return stats


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise TransferAborted("transfer aborted")
