"""The relay loop (fan-out, `syncd.plan.fanout`): a replica receives its buckets and sends each one
on, unchanged, to the replicas after it, while it receives the next.

It is the receive loop of `executor` with a `BucketForwarder` hooked in: right after bucket i arrived
(its slot fenced), the Forwarder posts one send per relay bucket that forwards it, from the very
bytes that arrived (the staging slot, or the tensor a one-unit bucket arrived straight into); the
bucket is then checksummed and unpacked as any received bucket, so a relay verifies and stages
what it received like every other replica. A slot is received into again only after its sends
left (`release`): memory stays `in_flight` buckets, and a slow successor slows its relay down to
its pace instead of growing a queue.

Order: the receive loop takes a link's buckets in (src, index) order, and the planner numbers
relay buckets in exactly that order of their sender's received buckets, so a relay forwards in
index order and its successors, which receive from it alone, take them in index order too. No
cycle: a relay waits only for its successors, the last replica waits for nobody.

Delta refits (`relay_with_deltas`): a relay receives each sender's delta as a delta receiver does
(`syncd.member.dataplane.delta`) and forwards its parts as they came: each group's header and
piece as soon as it arrived (before the relay applies it, so the chain pipelines group by
group), then the dense buckets through a `BucketForwarder` as above. It applies the delta to
its own copy and checksums whole regions like any receiver, so every replica is compared with
the sender's checksums. Its successors receive exactly the sender's messages, in
the sender's order, and apply them in turn: every replica must hold the same base (syncd plans
delta links through a chain only then, `syncd.daemon.delta_bases`).

Works through the `Transport` interface alone: gloo (tested) and NCCL, where `fence` orders the
next receive into a slot after its sends on the device instead of blocking the host.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from syncd.commands import DeltaLinks
from syncd.member.dataplane.delta import DeltaStats, recv_with_deltas
from syncd.member.dataplane.executor import TransferStats, _run
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.transport import Handle, Transport
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction


class BucketForwarder:
    """Sends received buckets on to the members that relay buckets name."""

    def __init__(
        self, outgoing: Sequence[Bucket], transport: Transport, ranks: Mapping[str, int], timeout_s: float
    ) -> None:
        self._out: dict[tuple[str, str, int], list[Bucket]] = defaultdict(list)
        for b in outgoing:
            assert b.relay is not None, f"bucket {b.key} is not a relay bucket"
            self._out[b.relay.forwards].append(b)
        self._transport, self._ranks, self._timeout_s = transport, ranks, timeout_s
        self._in_slot: dict[int, list[Handle]] = defaultdict(list)
        self._all = tuple(outgoing)
        self._sent: set[tuple[str, str, int]] = set()
        self.bytes = 0

    def expects(self, received: Sequence[Bucket]) -> None:
        """Every relay bucket must forward one of the buckets this member receives."""
        keys = {b.key for b in received}
        missing = sorted(k for k in self._out if k not in keys)
        if missing:
            raise ValueError(f"relay buckets forward buckets this member does not receive: {missing[:3]}")

    def forward(self, slot: int, bucket: Bucket, flat: torch.Tensor) -> None:
        """`bucket` arrived in `flat` (slot `slot`): send it to every successor that gets it."""
        for out in self._out.get(bucket.key, ()):
            if out.nbytes != flat.numel():
                raise ValueError(f"relay {out.key} carries {out.nbytes} bytes, received {flat.numel()}")
            self._in_slot[slot].append(self._transport.isend(flat, self._ranks[out.dst]))
            self._sent.add(out.key)
            self.bytes += out.nbytes

    def release(self, slot: int) -> None:
        """Before `slot` is received into again: its sends are ordered first (on CPU: done)."""
        for handle in self._in_slot.pop(slot, ()):
            handle.fence(self._timeout_s)

    def finish(self) -> None:
        """Wait for the last forwards; a relay bucket never sent is an error here, at once, rather
        than a successor starving until its stall timeout names this member."""
        for slot in list(self._in_slot):
            for handle in self._in_slot.pop(slot):
                handle.wait(self._timeout_s)
        unsent = sorted(b.key for b in self._all if b.key not in self._sent)
        if unsent:
            raise RuntimeError(
                f"relay loop ended with {len(unsent)} relay buckets not forwarded: {unsent[:3]}"
            )


def relay_buckets(
    buckets: Sequence[Bucket],
    member_id: str,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
    forward_timeout_s: float | None = None,
) -> TransferStats:
    """Receive this member's buckets of one stage into `tensors` and forward those that relay
    buckets (its own, `src == member_id`) name. Options, cancel and cache as `recv_buckets`;
    `forward_timeout_s` (default `options.timeout_s`) bounds each forward. The stats count the
    bytes received and forwarded (this member's part of the plan) and the received checksums."""
    incoming = [b for b in buckets if b.dst == member_id]
    outgoing = [b for b in buckets if b.src == member_id]
    forwarder = BucketForwarder(
        outgoing, transport, ranks, forward_timeout_s if forward_timeout_s is not None else options.timeout_s
    )
    forwarder.expects(incoming)
    # A relay's slot is busy for a receive and then a forward: twice the slots keep its incoming
    # link as busy as a plain receiver's.
    relay_options = replace(options, in_flight=2 * options.in_flight)
    stats = _run(Direction.RECV, incoming, tensors, transport, ranks, relay_options, cancel, cache, forwarder)
    stats.bytes += forwarder.bytes
    return stats


class DeltaForwarder:
    """A relay's `LinkForward` in a delta refit: sends each part of an incoming link's delta on to
    the successors whose relay buckets forward that link's buckets."""

    def __init__(
        self,
        outgoing: Sequence[Bucket],
        transport: Transport,
        ranks: Mapping[str, int],
        timeout_s: float,
        cancel: threading.Event | None,
        cache: LoopCache | None,
    ) -> None:
        self._outgoing = tuple(outgoing)
        self._transport, self._ranks, self._timeout_s = transport, ranks, timeout_s
        self._cancel, self._cache = cancel, cache
        self._pending: list[tuple[Handle, torch.Tensor]] = []  # sends in flight, with their buffers
        self._successors_of: dict[tuple, list[str]] = {}  # by the link's first bucket
        self.bytes = 0

    def _successors(self, link: Sequence[Bucket]) -> list[str]:
        """The members that get this link's delta: each must get all of it (the header covers the
        whole link), as fan-out plans give every relayed replica all of its relay's buckets."""
        if link[0].key in self._successors_of:
            return self._successors_of[link[0].key]
        keys = {b.key for b in link}
        forwarded: dict[str, set] = defaultdict(set)
        for o in self._outgoing:
            if o.relay is not None and o.relay.forwards in keys:
                forwarded[o.dst].add(o.relay.forwards)
        partial = sorted(dst for dst, got in forwarded.items() if got != keys)
        if partial:
            raise ValueError(f"relay successors {partial[:3]} get part of a delta link from {link[0].src}")
        self._successors_of[link[0].key] = sorted(forwarded)
        return self._successors_of[link[0].key]

    def header(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        for dst in self._successors(link):
            self._pending.append((self._transport.isend(data, self._ranks[dst]), data))

    def message(self, link: Sequence[Bucket], data: torch.Tensor) -> None:
        """One group's piece: forwarded as it arrived, before the relay applies it."""
        successors = self._successors(link)
        for dst in successors:
            self._pending.append((self._transport.isend(data, self._ranks[dst]), data))
        self.bytes += data.numel() * len(successors)  # counted as a delta receiver counts it

    def dense(self, dense: Sequence[Bucket], tensors, options: LoopOptions) -> TransferStats:
        """The relay loop over `dense`, forwarding each bucket to the successors that get it."""
        keys = {b.key for b in dense}
        outgoing = [o for o in self._outgoing if o.relay is not None and o.relay.forwards in keys]
        forwarder = BucketForwarder(outgoing, self._transport, self._ranks, self._timeout_s)
        relay_options = replace(options, in_flight=2 * options.in_flight)  # as `relay_buckets`
        stats = _run(
            Direction.RECV,
            dense,
            tensors,
            self._transport,
            self._ranks,
            relay_options,
            self._cancel,
            self._cache,
            forwarder,
        )
        self.bytes += forwarder.bytes
        return stats

    def finish(self) -> None:
        """Wait for the header and message sends."""
        for handle, _ in self._pending:
            handle.wait(self._timeout_s)
        self._pending.clear()


def relay_with_deltas(
    buckets: Sequence[Bucket],
    member_id: str,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    links: DeltaLinks,
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
    forward_timeout_s: float | None = None,
) -> DeltaStats:
    """`relay_buckets` for a relay whose links go as deltas (it and its successors in `links.dsts`):
    receives and applies each sender's delta (`recv_with_deltas`) and forwards it as it came. The
    stats count the bytes received and forwarded, and the received checksums."""
    incoming = [b for b in buckets if b.dst == member_id]
    outgoing = [b for b in buckets if b.src == member_id]
    BucketForwarder(outgoing, transport, ranks, options.timeout_s).expects(incoming)
    forwarder = DeltaForwarder(
        outgoing,
        transport,
        ranks,
        forward_timeout_s if forward_timeout_s is not None else options.timeout_s,
        cancel,
        cache,
    )
    stats = recv_with_deltas(
        incoming, tensors, transport, ranks, links, options, cancel=cancel, cache=cache, forward=forwarder
    )
    forwarder.finish()
    stats.bytes += forwarder.bytes
    return stats
