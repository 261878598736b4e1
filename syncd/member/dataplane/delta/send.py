"""Sending delta links (`send_with_deltas`): group by group, the header (`wire`), then the
encodings of the buckets that go as deltas, one piece; then the dense buckets through the
executor's loop, as a full refit sends them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from syncd.commands import DeltaLinks, checksum_key
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.delta.compare import Change, Diffs, _new_values
from syncd.member.dataplane.delta.wire import (
    _INDEX,
    _REST_DENSE,
    DeltaStats,
    _add,
    _aligned,
    _check,
    _dense_bucket,
    _groups,
    _unit_bytes,
)
from syncd.member.dataplane.executor import send_buckets
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.transport import Handle, Transport
from syncd.plan.types import Bucket


def _header_code(change: Change) -> int:
    """How a unit travels, in the link's header: k >= 0 for k (index, value) pairs, -1 - k for the
    dense bytes of a unit of which k elements changed."""
    return change.changed if change.sparse else -1 - change.changed


def _links(buckets: Sequence[Bucket], peer: str) -> dict[str, list[Bucket]]:
    out: dict[str, list[Bucket]] = defaultdict(list)
    for b in sorted(buckets, key=lambda b: (getattr(b, peer), b.index)):
        out[getattr(b, peer)].append(b)
    return out


def send_with_deltas(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    links: DeltaLinks,
    diffs: Diffs,
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
) -> DeltaStats:
    """`send_buckets` for a sender that keeps a mirror (`diffs`, this refit's comparisons with it):
    full links go through it (the mirror takes their values), the links to `links.dsts` as
    described in the module docstring. Links go one after another in destination order (what the
    receivers' source order expects). The collector stays paused throughout, as in the loops:
    the comparisons and headers between them are on the refit's path too."""
    stats, start = DeltaStats(), time.perf_counter()
    with options.gc_paused():
        for dst, link in _links(buckets, "dst").items():
            _check(cancel)
            if dst not in links.dsts:
                _add(
                    stats, send_buckets(link, tensors, transport, ranks, options, cancel=cancel, cache=cache)
                )
                for b in link:
                    for u in b.units:
                        diffs.absorb(u, dst)
                continue
            _send_link(
                dst,
                link,
                tensors,
                transport,
                ranks[dst],
                links.max_fraction,
                diffs,
                stats,
                options,
                cancel,
                cache,
            )
    stats.seconds = time.perf_counter() - start
    return stats


def _send_link(
    dst: str,
    link: list[Bucket],
    tensors,
    transport: Transport,
    peer: int,
    max_fraction: float,
    diffs: Diffs,
    stats: DeltaStats,
    options: LoopOptions,
    cancel: threading.Event | None,
    cache: LoopCache | None,
) -> None:
    """Group by group (`_groups`), in link order, the group's header (`_header_code` per unit),
    then the encodings (`_encode`) of its buckets that go as deltas, one piece: comparing group
    k + 1 overlaps the wire (and every relay and receiver down the chain) taking group k. Then
    the dense buckets. A link that goes dense whole (`_dense_whole`) sends its first header only."""
    dense: list[Bucket] = []
    sent: list[tuple[Handle, torch.Tensor]] = []  # with their buffers, alive until sent
    whole = _dense_whole(link, tensors, diffs, dst, max_fraction)
    for i, group in enumerate(_groups(link)):
        _check(cancel)
        if whole and i > 0:  # no header: all dense, counted as all changed (as its receiver does)
            numel = sum(u.canon.numel for b in group for u in b.units)
            stats.elements, stats.changed = stats.elements + numel, stats.changed + numel
            dense += group
            continue
        changes = [[diffs.of(u, tensors, dst) for u in b.units] for b in group]
        codes = [[_header_code(c) for c in cs] for cs in changes]
        flat_codes = [c for cs in codes for c in cs]
        trailer = len(flat_codes) + (_REST_DENSE if whole else 0)  # `_Incoming`
        header = torch.tensor([*flat_codes, trailer], dtype=torch.int64)
        sent.append((transport.isend(header, peer), header))
        parts = []
        for bucket, cs, bucket_codes in zip(group, changes, codes):
            stats.elements += sum(c.numel for c in cs)
            stats.changed += sum(c.changed for c in cs)
            if _dense_bucket(bucket_codes, bucket, max_fraction):
                dense.append(bucket)
            else:
                parts.append(_encode(bucket, cs, bucket_codes, tensors, stats.checksums))
        size = sum(p.numel() for p in parts)
        piece = torch.empty(0, dtype=torch.uint8)
        if size:  # nothing changed: the header says so, the receiver only checksums
            piece = torch.cat([*parts, torch.tensor([size], dtype=torch.int64).view(torch.uint8)])
            sent.append((transport.isend(piece, peer), piece))
        stats.bytes += piece.numel()
        stats.buckets += len(parts)
    _check(cancel)
    if dense:
        _add(stats, send_buckets(dense, tensors, transport, {dst: peer}, options, cancel=cancel, cache=cache))
    for handle, _ in sent:
        handle.wait(options.timeout_s)


def _dense_whole(link: Sequence[Bucket], tensors, diffs: Diffs, dst: str, max_fraction: float) -> bool:
    """Whether every bucket of `link` goes dense, found without an exact comparison of any big tensor
    (a step that changes everything: every tensor's sample says so). Where the samples settle every
    bucket (`_dense_by_samples`), its small tensors are not compared either: they go dense, counted
    as all changed. Its receiver then waits for one header instead of one a group before its dense
    buckets can move (on loopback, 12 headers of 4 senders took a tenth of a dense refit), and
    every sender's header waits for this."""
    units = [u for b in link for u in b.units]
    diffs.presample(units, tensors)  # the whole link's, once: its groups' comparisons use them too
    with diffs.lock:  # another stage's link may be comparing the same tensors
        by_samples = all(_dense_by_samples(b, diffs, max_fraction) for b in link)
    if by_samples:  # its small tensors need no comparison before the header
        diffs.assume_dense(units, dst)
        return True
    return all(diffs.known_cheaply(u, tensors) for u in units) and all(
        _dense_bucket([_header_code(diffs.of(u, tensors, dst)) for u in b.units], b, max_fraction)
        for b in link
    )


def _dense_by_samples(bucket: Bucket, diffs: Diffs, max_fraction: float) -> bool:
    """Whether `bucket` goes dense whatever its other units' comparisons find: the bytes of its
    units known dense without one (`Diffs.dense_without_comparing`) are already more than its delta
    may take (`_dense_bucket`; a unit's delta bytes are at least 0)."""
    if any(u.quantized for u in bucket.units):
        return True
    known = [diffs.dense_without_comparing(u) for u in bucket.units]
    return all(known) or (
        sum(_aligned(u.nbytes) for u, dense in zip(bucket.units, known) if dense)
        > max_fraction * bucket.nbytes
    )


def _encode(
    bucket: Bucket, changes: list[Change], codes: list[int], tensors, checksums: dict
) -> torch.Tensor:
    message = torch.zeros(sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units)), dtype=torch.uint8)
    sums, offset = Checksums(), 0
    for u, change, code in zip(bucket.units, changes, codes):
        new = _new_values(u, tensors)
        sums.add_region(checksum_key(u.canonical, u.canon), new)
        size = _unit_bytes(code, u)
        part = message[offset : offset + size]
        offset += size
        if code < 0:
            part[: u.nbytes].view(new.dtype).view(new.shape).copy_(new)
            continue
        assert change.index is not None and change.values is not None  # code >= 0: a delta unit
        index_bytes = _aligned(code * _INDEX.itemsize)
        part[: code * _INDEX.itemsize].copy_(change.index.view(torch.uint8))
        part[index_bytes : index_bytes + code * new.element_size()].copy_(change.values.view(torch.uint8))
    checksums.update(sums.result())
    return message
