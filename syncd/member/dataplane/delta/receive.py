"""Receiving delta links (`recv_with_deltas`): the headers and pieces taken on a thread of their
own (`_Taker`), forwarded as they came (a relay), applied with whole-region checksums; then the
dense buckets through the executor's loop, as a full refit receives them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from syncd.commands import DeltaLinks, checksum_key
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.delta.scatter import _scatter_box
from syncd.member.dataplane.delta.wire import (
    _INDEX,
    _REST_DENSE,
    _TRAILER,
    DeltaStats,
    _add,
    _aligned,
    _check,
    _dense_bucket,
    _groups,
    _unit_bytes,
)
from syncd.member.dataplane.executor import TransferStats, recv_buckets
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.transport import TransferError, Transport
from syncd.plan.types import Bucket, TransferUnit


class LinkForward(Protocol):
    """A relay's part in a delta refit (`syncd.member.dataplane.relay.DeltaForwarder`): what
    arrives on one incoming link goes on, as it came, to the successors that receive that link."""

    def header(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        """A group's header arrived in `data`: send it on."""
        ...

    def message(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        """A group's piece (its buckets' delta encodings) arrived in `data`: send it on."""
        ...

    def dense(self, dense: Sequence[Bucket], tensors, options: LoopOptions) -> TransferStats:
        """Receive the link's `dense` buckets into `tensors`, forwarding each."""
        ...


class Undo(Protocol):
    """Keeps what a delta overwrites, so a failed refit can put it back (`generator_svc.worker.undo_log`)."""

    def save(self, region: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Called before the delta writes `region` at flat positions `index` (all of it: None)."""
        ...


class DeltaSink(Protocol):
    """A receiver that applies deltas to its live tensors (the generator's in-place install):
    the tensors holding the base version, and the undo log to save into before each write."""

    def delta_targets(self) -> tuple[Mapping[str, torch.Tensor], Undo]: ...


def recv_with_deltas(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor] | DeltaSink,
    transport: Transport,
    ranks: Mapping[str, int],
    links: DeltaLinks,
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
    forward: LinkForward | None = None,
) -> DeltaStats:
    """The receiving side of `send_with_deltas`, for a member whose links all go as deltas: applies
    each delta to `tensors` (which must hold the base version) and checksums every whole region.
    `buckets` are those this member receives; `forward`: it relays them (fan-out). A `DeltaSink`
    names its tensors and an undo log that saves what each write overwrites.

    Link by link, group by group, its header, then its piece, taken (and forwarded) by a thread of
    their own (`_Taker`) while this one applies the pieces taken before; then one pipelined loop
    over all the links' dense buckets: each peer's messages come in its order (headers and
    pieces, dense buckets), and a relay forwards them in the order it takes them, which its
    successors take them in; no link waits for the previous link's dense buckets (and a relay for
    its forwards), and a link's changes are in place while a later sender is still comparing."""
    stats, start = DeltaStats(), time.perf_counter()
    undo: Undo | None = None
    if not isinstance(tensors, Mapping):
        tensors, undo = tensors.delta_targets()
    with options.gc_paused():  # as `send_with_deltas`
        taker = _Taker(_origin_links(buckets), transport, ranks, links.max_fraction, options, forward, cancel)
        dense: list[Bucket] = []
        try:
            for arrived in taker.arrivals():
                dense += _apply_group(arrived, tensors, stats, undo)
                if options.on_received is not None:  # the dense ones count when they arrive
                    for bucket, _, _ in arrived.sparse:
                        options.on_received(bucket)
        finally:
            taker.stop()
        _check(cancel)
        if dense and undo is not None:  # the executor overwrites these units whole
            for u in [u for b in dense for u in b.units]:
                undo.save(tensors[u.dst_tensor][u.dst_box.slices()])
        if dense and forward is not None:
            _add(stats, forward.dense(dense, tensors, options))
        elif dense:
            _add(stats, recv_buckets(dense, tensors, transport, ranks, options, cancel=cancel, cache=cache))
    stats.seconds = time.perf_counter() - start
    return stats


@dataclass
class _Arrived:
    """One group of a delta link as it arrived (`_Taker`): its buckets that go dense (received later,
    with the others), those that go as deltas with their codes and bytes in `piece`, in order."""

    group: list[Bucket]
    dense: list[Bucket] = field(default_factory=list)
    sparse: list[tuple[Bucket, list[int], int]] = field(default_factory=list)
    piece: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    elements: int = 0  # of all its units, and how many of them changed
    changed: int = 0
    touched: set[str] = field(default_factory=set)  # destination tensors that take new values
    rest_dense: bool = False  # its header said every later group of the link goes dense

    @classmethod
    def dense_whole(cls, group: list[Bucket]) -> _Arrived:
        """A group after a header with `rest_dense`: all of it dense, counted as all changed (its
        sender compared it, but sent no header of it)."""
        numel = sum(u.canon.numel for b in group for u in b.units)
        touched = {u.dst_tensor for b in group for u in b.units}
        return cls(group, dense=list(group), elements=numel, changed=numel, touched=touched)


class _Taker:
    """Takes a receiver's delta links group by group on a thread of its own: each group's header,
    then its piece (sized from the header), each forwarded as it arrived (a relay). Gloo sends a
    message only once its receive is posted, so taking the next group while the previous one is
    applied keeps the wire, and every hop of a chain after this one, moving."""

    def __init__(
        self,
        links: Mapping[tuple[str, str], list[Bucket]],
        transport: Transport,
        ranks: Mapping[str, int],
        max_fraction: float,
        options: LoopOptions,
        forward: LinkForward | None,
        cancel: threading.Event | None,
    ) -> None:
        self._links, self._transport, self._ranks = list(links.values()), transport, ranks
        self._max_fraction, self._options, self._forward = max_fraction, options, forward
        self._cancel, self._stopped = cancel, threading.Event()
        self._queue: queue.SimpleQueue[_Arrived | BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="delta-take", daemon=True)
        self._thread.start()

    def arrivals(self) -> Iterator[_Arrived]:
        """The groups in the order they arrive; raises what stopped the taking."""
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
        self._thread.join()

    def stop(self) -> None:
        """No more groups after the one being taken (the applier failed); a receive waiting for its
        message ends with the transfer's timeout or abort."""
        self._stopped.set()

    def _run(self) -> None:
        try:
            groups: list[tuple[Sequence[Bucket], list[Bucket], int]] = []
            ends: list[int] = []  # per group, the index of the first group of the next link
            for origin in self._links:
                cut = _groups(origin)
                groups += [(origin, g, self._ranks[origin[0].src]) for g in cut]
                ends += [len(groups)] * len(cut)
            header = self._header(*groups[0]) if groups else None
            i = 0
            while i < len(groups):
                if self._stopped.is_set():
                    return
                _check(self._cancel)
                assert header is not None  # the first posted above, each next one by `_take`
                link, group, peer = groups[i]
                after = groups[i + 1] if i + 1 < len(groups) else None
                after_link = groups[ends[i]] if ends[i] < len(groups) else None
                header, arrived = self._take(link, group, peer, header, after, after_link)
                self._queue.put(arrived)
                if arrived.rest_dense:
                    for later in groups[i + 1 : ends[i]]:
                        self._queue.put(_Arrived.dense_whole(later[1]))
                i = ends[i] if arrived.rest_dense else i + 1
        except BaseException as e:  # noqa: BLE001 - handed to the applier, which raises it
            self._queue.put(e)
        else:
            self._queue.put(None)

    def _header(self, link: Sequence[Bucket], group: list[Bucket], peer: int) -> _Incoming:
        buf = torch.empty(sum(len(b.units) for b in group) + 1, dtype=torch.int64)
        return _Incoming(buf, self._transport, peer, group)

    def _take(
        self,
        link: Sequence[Bucket],
        group: list[Bucket],
        peer: int,
        header: _Incoming,
        after: tuple[Sequence[Bucket], list[Bucket], int] | None,
        after_link: tuple[Sequence[Bucket], list[Bucket], int] | None,
    ) -> tuple[_Incoming | None, _Arrived]:
        """The group whose `header` was posted: its piece received, and the next header posted
        behind it, so its sender sends it as soon as it has it (one wait for a posted receive per
        group, not two): the group `after` it, or the first of the next link (`after_link`) when
        the header says the rest of this link goes dense. Returns that header and the group."""
        codes_buf = header.wait(self._options.timeout_s)
        if self._forward is not None:
            self._forward.header(link, codes_buf)
        flat_codes, at = codes_buf[:-1].tolist(), 0
        arrived = _Arrived(group, rest_dense=header.rest_dense)
        for bucket in group:
            codes = flat_codes[at : at + len(bucket.units)]
            at += len(bucket.units)
            _check_codes(bucket, codes)
            arrived.elements += sum(u.canon.numel for u in bucket.units)
            arrived.changed += sum(c if c >= 0 else -1 - c for c in codes)
            if _dense_bucket(codes, bucket, self._max_fraction):
                arrived.dense.append(bucket)
                arrived.touched.update(u.dst_tensor for u in bucket.units)
            else:
                size = sum(_unit_bytes(c, u) for c, u in zip(codes, bucket.units))
                arrived.sparse.append((bucket, codes, size))
                arrived.touched.update(u.dst_tensor for u, c in zip(bucket.units, codes) if c)
        size = sum(size for _, _, size in arrived.sparse)
        piece = (
            _Incoming(torch.empty(size + _TRAILER, dtype=torch.uint8), self._transport, peer, group)
            if size
            else None
        )
        following = after_link if arrived.rest_dense else after
        next_header = self._header(*following) if following is not None else None
        if piece is not None:
            arrived.piece = piece.wait(self._options.timeout_s)
            if self._forward is not None:
                self._forward.message(link, arrived.piece)
        return next_header, arrived


def _apply_group(
    arrived: _Arrived, tensors: Mapping[str, torch.Tensor], stats: DeltaStats, undo: Undo | None
) -> list[Bucket]:
    """Apply one group's piece bucket by bucket, checksumming whole regions; count it in `stats`.
    Returns its dense buckets."""
    stats.elements += arrived.elements
    stats.changed += arrived.changed
    stats.touched |= arrived.touched
    offset = 0
    for bucket, codes, size in arrived.sparse:
        _apply(bucket, codes, arrived.piece[offset : offset + size], tensors, stats.checksums, undo)
        offset += size
    stats.bytes += arrived.piece.numel()
    stats.buckets += len(arrived.sparse)
    return arrived.dense


class _Incoming:
    """A header (int64) or piece (uint8) being received into `buf`, whose last 8 bytes, its trailer,
    the sender set to the count of the codes (header) or bytes (piece) before it. Gloo takes a
    message shorter than the buffer without a word: a truncated one leaves the sentinel put there
    first. Posted at construction, so the sender may send it while the receiver does other work."""

    def __init__(self, buf: torch.Tensor, transport: Transport, peer: int, group: Sequence[Bucket]) -> None:
        self.buf, self._peer, self._group = buf, peer, group
        self.rest_dense = False  # a header whose trailer adds `_REST_DENSE`
        buf.view(torch.int64)[-1] = -1
        self._handle = transport.irecv(buf, peer)

    def wait(self, timeout_s: float) -> torch.Tensor:
        """The message, its trailer checked."""
        self._handle.wait(timeout_s)
        what = "header" if self.buf.dtype == torch.int64 else "piece"
        words = self.buf.view(torch.int64)
        expected = (words.numel() - 1) * (1 if what == "header" else 8)
        self.rest_dense = what == "header" and int(words[-1]) == expected + _REST_DENSE
        if int(words[-1]) != expected and not self.rest_dense:
            raise TransferError(
                f"delta {what} of the group from bucket {self._group[0].key} arrived truncated or "
                f"corrupt: its trailer says {int(words[-1])}, {expected} expected",
                self._peer,
            )
        return self.buf


def _check_codes(bucket: Bucket, codes: list[int]) -> None:
    """A header's codes must describe the bucket's units (a corrupt one would size the piece
    wrong and leave the link waiting for bytes that never come)."""
    for u, code in zip(bucket.units, codes):
        changed = code if code >= 0 else -1 - code
        if changed > u.canon.numel:
            raise ValueError(
                f"delta header of bucket {bucket.key}: unit {u.canonical} has {u.canon.numel} "
                f"elements, the header says {changed} changed (code {code})"
            )


def _origin_links(buckets: Sequence[Bucket]) -> dict[tuple[str, str], list[Bucket]]:
    """A receiver's links cut by the sender that packed their bytes: each part is one sender's
    delta (its header, its message, its dense buckets). A relay's link to its successor carries
    what it received from each sender, in the order it received them (the planner numbers relay
    buckets so), each forwarded as it came."""
    out: dict[tuple[str, str], list[Bucket]] = defaultdict(list)
    for b in sorted(buckets, key=lambda b: (b.src, b.index)):
        out[(b.src, b.origin)].append(b)
    return out


def _apply(
    bucket: Bucket,
    codes: list[int],
    message: torch.Tensor,
    tensors,
    checksums: dict,
    undo: Undo | None = None,
) -> None:
    sums, offset = Checksums(), 0
    for u, code in zip(bucket.units, codes):
        dst = tensors[u.dst_tensor][u.dst_box.slices()]
        size = _unit_bytes(code, u)
        part = message[offset : offset + size]
        offset += size
        if code < 0:
            if undo is not None:
                undo.save(dst)
            dst.copy_(part[: u.nbytes].view(dst.dtype).view(dst.shape))
        elif code:
            index_bytes = _aligned(code * _INDEX.itemsize)
            index = part[: code * _INDEX.itemsize].view(_INDEX)
            values = part[index_bytes : index_bytes + code * dst.element_size()].view(dst.dtype)
            _check_positions(bucket, u, index)
            if undo is not None:
                undo.save(dst, index)
            _scatter_box(tensors[u.dst_tensor], u.dst_box, dst, index, values)
        sums.add_region(checksum_key(u.canonical, u.canon), dst)
    checksums.update(sums.result())


def _check_positions(bucket: Bucket, u: TransferUnit, index: torch.Tensor) -> None:
    """A delta unit's positions must ascend strictly within the unit (the sender lists them so;
    `_scatter_box` cuts them by run on it), or a corrupt piece could write outside its region."""
    at = index.numpy()
    if at[0] < 0 or at[-1] >= u.canon.numel or not bool(np.all(at[1:] > at[:-1])):
        raise ValueError(
            f"delta piece of bucket {bucket.key}: unit {u.canonical} has {u.canon.numel} elements, "
            f"its positions (from {int(at.min())} to {int(at.max())}) do not ascend within them"
        )
