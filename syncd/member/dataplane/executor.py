"""Thin execution loops: send or receive one member's buckets of one stage, double-buffered.

Ordering rule that makes the loops deadlock-free without any coordination: every sender walks its
buckets by (dst, index) and every receiver by (src, index), both in the plan's global order, so a
waiting chain always moves to strictly smaller members and cannot close into a cycle.

Memory: each loop uses `in_flight` staging buffers of the largest bucket's size (default 2: pack
the next bucket while the previous one is on the wire; unpack the previous while the next arrives),
kept between refits in the caller's `LoopCache` with the rest of what the loops reuse.

State: none of the module's own. How a loop runs is the caller's `LoopOptions`; what it keeps from
one refit to the next is the caller's `LoopCache`; cancelling is the caller's event.

On GPUs the host only enqueues: packs/unpacks run on a stream of the loop's own (with their
checksums in the same kernel where a bucket's units are plain copies,
`PreparedBucket.copy_and_checksum`), other checksums on a second one, transfers on the
transport's, and every hand-over between them (bucket packed -> send; arrived -> unpack and
checksum; unpacked and checksummed -> the slot is received into again) is a stream wait. So the
per-bucket host cost (Python, kernel launches) overlaps the wire instead of adding to it; the host
waits only to stay a few buckets ahead (`_RUN_AHEAD`) and at the end. On CPU (gloo) the same code
waits on the host at those points, and checksums run on a worker thread.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, cast

import torch
from torch.profiler import record_function

from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.graphs import ENQUEUE_LOCK, BucketProgram, LoopGraphs
from syncd.member.dataplane.landed import add_landed
from syncd.member.dataplane.landing_fault import FaultAt, LandingFault, flip_bit
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.prepared import PreparedBucket, PreparedLoop, ReceiveSink, SinkBucket
from syncd.member.dataplane.shm import SharedRecv, ShmTransport
from syncd.member.dataplane.transport import GroupSender, Handle, Transport
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction

# How many buckets the host may enqueue beyond the staging depth before it waits for the wire.
_RUN_AHEAD = 4

_NO_LABEL = contextlib.nullcontext()


def _step(name: str):
    """A profiler label for an executor step, only while a profiler records: `record_function`
    dispatches an operator on enter and exit, microseconds the host cannot spare per bucket."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_LABEL


class Forwarder(Protocol):
    """Hooked into a receive loop by a relay (`syncd.member.dataplane.relay.BucketForwarder`)."""

    def forward(self, slot: int, bucket: Bucket, flat: torch.Tensor) -> None:
        """`bucket` arrived in `flat`, staging slot `slot`: send it on."""
        ...

    def release(self, slot: int) -> None:
        """Before `slot` is received into again."""
        ...

    def finish(self) -> None:
        """After the last bucket: every forward done."""
        ...


class TransferAborted(RuntimeError):
    pass


@dataclass
class TransferStats:
    bytes: int = 0
    buckets: int = 0
    checksums: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


class _SideStream:
    """Checksums off the loop's critical path, so bucket i is hashed while bucket i+1 is packed or
    unpacked and the wire moves another; a staging slot is reused only after its checksum finished.
    GPU: a stream of their own, ordered by events the work stream waits for, on the GPU.
    CPU: one worker thread (xxh3 and torch's copies release the GIL, so the hash, the pack or
    unpack and gloo's own thread all run at once); one thread keeps the regions in plan order."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done: list[torch.cuda.Event | None] = [None] * slots
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="weightsync-checksum") if self.stream is None else None
        )
        self._pending: list[list[Future]] = [[] for _ in range(slots)]  # per slot, in order
        self._untied: list[Future] = []  # CPU work that reads no slot: waited for by `collect` only

    def run(self, slot: int | None, fn) -> None:
        """`fn` on the side, after the work queued before it; the reuse of staging slot `slot`
        waits for it. `slot` None: work that reads no staging slot (the landed check reads the
        destinations), so that the next receive into the slot need not wait."""
        if self._worker is not None:
            future = self._worker.submit(fn)
            if slot is None:
                self._untied.append(future)
            else:
                self._pending[slot].append(future)
            return
        assert self.stream is not None  # no CPU worker: a GPU stream
        self.stream.wait_stream(torch.cuda.current_stream())  # the bytes are packed / arrived
        with torch.cuda.stream(self.stream):
            fn()
        if slot is None:
            return
        done = self.done[slot]
        if done is None:  # one event per slot, re-recorded: a wait binds the last record
            done = self.done[slot] = torch.cuda.Event()
        done.record(self.stream)

    def before_reuse(self, slot: int) -> None:
        if self._worker is not None:
            for pending in self._pending[slot]:
                pending.result()  # re-raises a failed checksum here
            self._pending[slot] = []
            return
        done = self.done[slot]
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def collect(self, sums: Checksums) -> dict[str, str]:
        """The checksums' fold runs on this stream, queued behind the last region's reductions
        while the last unpack still runs, instead of after a host sync."""
        if self._worker is not None:
            for slot in range(len(self._pending)):
                self.before_reuse(slot)
            for future in self._untied:
                future.result()  # re-raises a failed checksum here
            self._untied = []
            return sums.result()
        assert self.stream is not None
        # Behind the work stream too: a fused copy (`PreparedBucket.copy_and_checksum`) sums there.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            return sums.result()

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def close(self) -> None:
        """Ends the CPU worker after the hash it is running (on abort too: it only reads staging)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)


@dataclass
class _Loop:
    tensors: Mapping[str, torch.Tensor] | ReceiveSink
    transport: Transport
    ranks: Mapping[str, int]
    options: LoopOptions
    cancel: threading.Event | None
    cache: LoopCache
    stats: TransferStats = field(default_factory=TransferStats)
    sums: Checksums = field(default_factory=Checksums)
    landed_sums: Checksums = field(default_factory=Checksums)  # receives: where the units landed
    side: _SideStream | None = None
    graphs: LoopGraphs | None = None
    prepared: PreparedLoop | None = None
    forwarder: Forwarder | None = None  # a relay's receive loop (`syncd.member.dataplane.relay`)
    slots: int = 0  # staging slots where they differ from `options.in_flight` (0: they don't)

    @property
    def checksums(self) -> _SideStream:
        """The side stream, which `_run` opens before the loop sends or receives."""
        assert self.side is not None, "the side stream is opened by _run before send/recv"
        return self.side

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    @property
    def in_flight(self) -> int:
        """Staging slots: the options' depth, or more for a send loop's rounds (`send`)."""
        return self.slots or self.options.in_flight

    @cached_property
    def sink(self) -> ReceiveSink | None:
        """`tensors` when a sink takes the buckets; found once (the loop asks per bucket, and a
        check against a runtime protocol walks its attributes: ~10 us)."""
        return self.tensors if isinstance(self.tensors, ReceiveSink) else None

    @property
    def named(self) -> Mapping[str, torch.Tensor]:
        """`tensors` where no sink takes the buckets: the named tensors to pack or unpack."""
        assert self.sink is None
        return cast(Mapping[str, torch.Tensor], self.tensors)

    @property
    def device(self) -> torch.device:
        if self.sink is not None:
            return self.sink.device
        return next(iter(self.named.values())).device

    def buffers(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        """`in_flight` staging buffers, kept in the cache so that refits after the first reuse
        them instead of faulting in fresh memory every time."""
        return self.cache.staging(self.in_flight, max(b.nbytes for b in buckets), self.device)

    def programs(
        self, direction: Direction, ordered: Sequence[Bucket], bufs: Sequence[torch.Tensor]
    ) -> Sequence[BucketProgram | PreparedBucket]:
        """Per bucket, its work in its slot: captured copies and checksums (on GPUs with graphs
        on; the first refit of a plan captures them all here, before anything is enqueued), or
        the prepared eager work (`syncd.member.dataplane.prepared`)."""
        flats = [bufs[i % self.in_flight][: b.nbytes] for i, b in enumerate(ordered)]
        if self.sink is not None:
            return [SinkBucket(b, flat, self.sink) for b, flat in zip(ordered, flats)]
        if self.graphs is None:
            assert self.prepared is not None  # _run sets one of the two
            return self.prepared.buckets(ordered, self.named, flats)
        return self.graphs.programs(direction, ordered, self.named, flats)

    def enqueuing(self):
        """Held while this loop enqueues device work (never across a wait), when graphs are on."""
        return ENQUEUE_LOCK if self.graphs is not None else contextlib.nullcontext()

    def fuses(self, program: BucketProgram | PreparedBucket) -> bool:
        """Whether `program`'s copy also takes its checksums (`PreparedBucket.fusable`: on CPU
        chunk by chunk from cache, on GPUs in the copy kernel itself), with checksums on: a
        bucket copied through staging (a receive only with the landed check, whose checksums
        are of the destinations)."""
        return isinstance(program, PreparedBucket) and program.fusable and self.options.verify

    def pack(
        self, bucket: Bucket, buf: torch.Tensor, program: BucketProgram | PreparedBucket, fused: bool = False
    ) -> torch.Tensor:
        """The bytes to send: packed into the staging slice (and hashed, `fused`), or the
        tensor's own bytes (`direct`)."""
        with _step("weightsync.pack"):
            if fused:
                assert isinstance(program, PreparedBucket)
                program.copy_and_checksum(self.sums)
            else:
                program.copy()
            return buf[: bucket.nbytes] if program.direct is None else program.direct

    def unpack(
        self, bucket: Bucket, flat: torch.Tensor, program: BucketProgram | PreparedBucket, fused: bool = False
    ) -> None:
        """Unpack the bucket; `fused`: with the landed check of what it wrote, chunk by chunk."""
        with _step("weightsync.unpack"):
            if fused:
                assert isinstance(program, PreparedBucket)
                program.copy_and_checksum(self.landed_sums)
            else:
                program.copy()

    def account(
        self,
        slot: int,
        bucket: Bucket,
        flat: torch.Tensor,
        program: BucketProgram | PreparedBucket,
        checksum: bool = True,
    ) -> None:
        """Both sides checksum the packed bytes of every unit: the same bytes in the same order
        (a receiver that checksums where they landed instead passes `checksum=False`)."""
        if self.options.verify and checksum:
            with _step("weightsync.checksum"):
                self.checksums.run(slot, lambda: program.checksum(self.sums))
        self.stats.bytes += bucket.nbytes
        self.stats.buckets += 1

    def strike(self, fault: LandingFault, slot: int, flat: torch.Tensor) -> None:
        """The test-only fault (`landing_fault`): change a received byte before its unpack, after
        the bucket's checksum ran or racing it."""
        if fault == LandingFault.AFTER_CHECKSUM:
            self.checksums.before_reuse(slot)
        flip_bit(flat)

    @property
    def checks_landed(self) -> bool:
        return self.options.verify and self.options.verify_landed

    def account_landed(self, slot: int, bucket: Bucket, program: BucketProgram | PreparedBucket) -> None:
        """Once `bucket` is unpacked: checksum its units where they landed, off the loop's path
        like the wire checksums (queued behind them on the same worker or stream), so the check
        overlaps the next buckets' transfers. A sink checksums its destinations itself."""
        if not self.checks_landed or self.sink is not None:
            return
        tensors = self.tensors
        assert isinstance(tensors, Mapping)  # not a sink: the catalog views
        with _step("weightsync.landed"):
            # The check reads the destinations only: no reuse of the slot waits for it.
            if isinstance(program, PreparedBucket):
                self.checksums.run(None, lambda: program.landed(self.landed_sums))
            else:
                self.checksums.run(None, lambda: add_landed(bucket.units, tensors, self.landed_sums))

    def landed(self) -> None:
        """After a receive with the landed check: the checksums of where the units landed are
        what the receiver reports as received (`syncd.member.dataplane.landed`); syncd compares
        them with the senders'. A sink checksummed its destinations itself, before it
        post-processed them."""
        if self.checks_landed:
            landed = self.sink.landed() if self.sink is not None else self.checksums.collect(self.landed_sums)
            self.stats.checksums = dict(landed)

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TransferAborted("transfer aborted")

    def throttle(self, handles: Sequence[Handle], i: int) -> None:
        """Keep the host at most `in_flight + _RUN_AHEAD` buckets ahead of the wire: on GPUs the
        loop only enqueues work (the device orders it), so a failed peer is noticed by this wait."""
        behind = i - self.in_flight - _RUN_AHEAD
        if behind >= 0:
            with _step("weightsync.throttle"):
                handles[behind].wait(self.timeout_s)

    def finish(self, handles: Sequence[Handle]) -> None:
        for handle in handles[max(0, len(handles) - self.in_flight - _RUN_AHEAD) :]:
            self.check_cancel()
            handle.wait(self.timeout_s)

    def send(self, rounds: Sequence[Sequence[Bucket]]) -> None:
        """`rounds`: `send_rounds` of the buckets, with `slots` set for them (`_run`)."""
        ordered = [b for r in rounds for b in r]
        bufs = self.buffers(ordered)
        programs = self.programs(Direction.SEND, ordered, bufs)
        handles: list[Handle] = []
        i = 0
        for round_ in rounds:
            packed: list[tuple[int, int, Bucket, torch.Tensor, bool]] = []  # (i, slot, bucket, flat, fused)
            for bucket in round_:
                self.check_cancel()
                self.throttle(handles, i)
                slot = i % self.in_flight
                if i >= self.in_flight:  # the slot is free once its last send and checksum are done
                    handles[i - self.in_flight].fence(self.timeout_s)
                with self.enqueuing():
                    if i >= self.in_flight:
                        self.checksums.before_reuse(slot)
                    fused = self.fuses(programs[i])
                    packed.append((i, slot, bucket, self.pack(bucket, bufs[slot], programs[i], fused), fused))
                i += 1
            with self.enqueuing():
                with _step("weightsync.isend"):
                    handles += self.post_sends([(flat, self.ranks[b.dst]) for _, _, b, flat, _ in packed])
                for j, slot, bucket, flat, fused in packed:  # after isend: the checksum overlaps the transfer
                    self.account(slot, bucket, flat, programs[j], checksum=not fused)
        self.finish(handles)

    def post_sends(self, sends: Sequence[tuple[torch.Tensor, int]]) -> list[Handle]:
        if len(sends) > 1:
            assert isinstance(self.transport, GroupSender)  # `send_rounds` groups only for one
            return list(self.transport.isend_group(sends))
        return [self.transport.isend(buf, peer) for buf, peer in sends]

    def reads_in_place(self, bucket: Bucket) -> bool:
        """Whether `bucket` is unpacked straight from where its sender packed it (a peer on this
        host over shared memory, `ShmTransport.irecv_shared`): when nothing reads the arrived bytes
        after the unpack, i.e. no checksum of them (the landed check replaces it, or none) and no
        relay forwarding them. Saves the copy into staging, a third of the receiver's work. (Not
        with the test-only landing fault armed: it flips a received byte, here the sender's.)"""
        transport = self.transport
        return (
            isinstance(transport, ShmTransport)
            and self.ranks[bucket.src] in transport.local_peers
            and self.forwarder is None
            and (self.checks_landed or not self.options.verify)
            and self.options.landing_fault is None
        )

    def in_place_program(self, bucket: Bucket, flat: torch.Tensor) -> PreparedBucket:
        """The unpack (and landed check) of `bucket` from a sender's segment (`reads_in_place`)."""
        if self.sink is not None:
            return SinkBucket(bucket, flat, self.sink)
        assert self.prepared is not None  # shared memory is host memory: no CUDA graphs
        return self.prepared.bucket(bucket, self.named, flat, direct=False)

    def recv(self, buckets: Sequence[Bucket]) -> None:
        ordered = sorted(buckets, key=lambda b: (b.src, b.index))
        if self.sink is not None and self.forwarder is None:  # a relay keeps the planned order
            ordered = interleaved(ordered, self.sink.position)
        in_place = [self.reads_in_place(b) for b in ordered]
        if all(in_place):  # no staging: every bucket is read where its sender packed it
            bufs: list[torch.Tensor] = []
            programs: Sequence[BucketProgram | PreparedBucket] = []
        else:
            bufs = self.buffers(ordered)
            programs = self.programs(Direction.RECV, ordered, bufs)
        handles: list[Handle] = []
        fault = FaultAt.of(self.options.landing_fault, len(ordered))

        def post(i: int) -> None:
            peer = self.ranks[ordered[i].src]
            if in_place[i]:
                assert isinstance(self.transport, ShmTransport)
                handles.append(self.transport.irecv_shared(ordered[i].nbytes, peer))
                return
            flat = _received_into(programs[i], bufs[i % self.in_flight], ordered[i])
            with _step("weightsync.irecv"):  # ordered after the current stream's unpacks
                handles.append(self.transport.irecv(flat, peer))

        with self.enqueuing():
            for i in range(min(self.in_flight, len(ordered))):
                post(i)
        for i, bucket in enumerate(ordered):
            self.check_cancel()
            self.throttle(handles, i)
            slot = i % self.in_flight
            handle = handles[i]
            handle.fence(self.timeout_s)  # what follows reads the bucket once it arrived
            if self.options.on_received is not None:
                self.options.on_received(bucket)
            program: BucketProgram | PreparedBucket
            if isinstance(handle, SharedRecv):
                flat = handle.view
                program = self.in_place_program(bucket, flat)
            else:
                program = programs[i]
                flat = _received_into(program, bufs[slot], bucket)
            with self.enqueuing():
                if self.forwarder is not None:
                    self.forwarder.forward(slot, bucket, flat)
                self.account(slot, bucket, flat, program, checksum=not self.checks_landed)
                if fault is not None and fault.index == i:
                    self.strike(fault.fault, slot, flat)
                fused = self.checks_landed and self.sink is None and self.fuses(program)
                self.unpack(bucket, flat, program, fused)
                if isinstance(handle, SharedRecv):
                    handle.release()  # unpacked: the sender may pack into its segment again
                if not fused:
                    self.account_landed(slot, bucket, program)
                if i + self.in_flight < len(ordered):
                    self.checksums.before_reuse(slot)  # the next receive into the slot waits for the checksum
                    if self.forwarder is not None:
                        self.forwarder.release(slot)  # ... and for the bucket's forwards
                    post(i + self.in_flight)
        self.finish(handles)
        if self.forwarder is not None:
            self.forwarder.finish()


def send_rounds(buckets: Sequence[Bucket], grouped: bool) -> list[list[Bucket]]:
    """A send loop's buckets in the rounds it posts them: one bucket a round, by (dst, index),
    or, where the transport posts sends to several peers at once (`GroupSender`: NCCL, whose
    sends on one stream would otherwise run one after the other), round r holds each
    destination's r-th bucket, so every link of the group moves at once. Each destination still
    gets its buckets in index order, which is all a receiver relies on: it takes a peer's
    messages in the order they were sent, and peers in the plan's order (see the module's
    ordering rule; a round only lets more sends progress at once)."""
    ordered = sorted(buckets, key=lambda b: (b.dst, b.index))
    if not grouped:
        return [[b] for b in ordered]
    links: dict[str, list[Bucket]] = {}
    for b in ordered:
        links.setdefault(b.dst, []).append(b)
    depth = max((len(link) for link in links.values()), default=0)
    return [[link[r] for link in links.values() if r < len(link)] for r in range(depth)]


def interleaved(ordered: Sequence[Bucket], position) -> list[Bucket]:
    """The links' buckets merged by where they land (`ReceiveSink.position`), each link's still in
    index order: a transport matches the messages of one peer in the order they were sent, while
    different peers' may be taken in any order (every sender serves its destinations in the same
    order, so this completes). A sink that installs layer by layer so gets a layer's parts from
    several sources together and holds its memory for less time."""
    links: dict[str, list[Bucket]] = {}
    for b in ordered:
        links.setdefault(b.src, []).append(b)
    return list(heapq.merge(*links.values(), key=position))


def _received_into(
    program: BucketProgram | PreparedBucket, buf: torch.Tensor, bucket: Bucket
) -> torch.Tensor:
    """Where a bucket arrives: its staging slice, or straight into its tensor (`direct`)."""
    return buf[: bucket.nbytes] if program.direct is None else program.direct


@contextlib.contextmanager
def _work_stream(device: torch.device) -> Iterator[None]:
    """On GPUs: a stream of this loop's own, ordered after the tensors' last writes and finished
    before the loop returns."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def _run(
    direction: Direction,
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor] | ReceiveSink,
    transport: Transport,
    ranks: Mapping[str, int],
    options: LoopOptions,
    cancel: threading.Event | None,
    cache: LoopCache | None,
    forwarder: Forwarder | None = None,
) -> TransferStats:
    cache = cache if cache is not None else LoopCache()
    loop = _Loop(tensors, transport, ranks, options, cancel, cache, forwarder=forwarder)
    if not buckets:
        return loop.stats
    program_cache: LoopGraphs | PreparedLoop
    if options.graphs and loop.device.type == "cuda" and loop.sink is None:
        loop.graphs = program_cache = loop.cache.graphs(direction, loop.device)
    else:
        loop.prepared = program_cache = loop.cache.prepared(direction)
    start = time.perf_counter()
    rounds: list[list[Bucket]] = []
    if direction == Direction.SEND:
        rounds = send_rounds(buckets, grouped=isinstance(transport, GroupSender))
        # A round's buckets are on the wire together: each destination gets `in_flight` slots.
        loop.slots = options.in_flight * max(len(r) for r in rounds)
    with options.gc_paused(), _work_stream(loop.device):
        loop.side = side = _SideStream(loop.device, loop.in_flight)
        try:
            loop.send(rounds) if direction == Direction.SEND else loop.recv(buckets)
            loop.stats.checksums = side.collect(loop.sums)
            side.join()
            if direction == Direction.RECV:
                loop.landed()
        finally:
            side.close()
    program_cache.retain_used()
    loop.stats.seconds = time.perf_counter() - start
    return loop.stats


def send_buckets(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    ranks: Mapping[str, int],
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
) -> TransferStats:
    """Send `buckets` (this member is their src), reading from `tensors` (catalog views), as
    `options` say. `cancel`, once set, stops the loop (`TransferAborted`); `cache` is what the
    loops over `transport` keep between refits (pass the same one on every call over it)."""
    return _run(Direction.SEND, buckets, tensors, transport, ranks, options, cancel, cache)


def recv_buckets(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor] | ReceiveSink,
    transport: Transport,
    ranks: Mapping[str, int],
    options: LoopOptions,
    *,
    cancel: threading.Event | None = None,
    cache: LoopCache | None = None,
) -> TransferStats:
    """Receive `buckets` (this member is their dst) into `tensors` (catalog views), or hand each
    arrived bucket to a `ReceiveSink`. Same options, cancel and cache."""
    return _run(Direction.RECV, buckets, tensors, transport, ranks, options, cancel, cache)
