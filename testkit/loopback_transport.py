"""A loop-back transport on one GPU: the wire of a two-GPU refit replaced by a device copy.

`LoopbackWire(device)` gives two endpoints (`wire.sender`, `wire.receiver`) that satisfy the
executor's `Transport` protocol, so the real `send_buckets` and `recv_buckets` run unchanged, each
in a thread of its own (as the trainer and generator would each run theirs). The i-th send is
paired with the i-th receive; once both are posted, one copy moves the bytes on the wire's own
stream (highest priority, like the NCCL transport's), after both sides' enqueued work, and an
event marks it done for both handles. The copy reads and writes HBM, so the pipeline pays for a
wire that moves bytes; the benchmark compares against one copy of all bytes in the same run.

Limits of the stand-in: both loops share one Python interpreter (one GIL), so host time is that
of both sides together, and a `fence` blocks the host until the peer posted its half.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import replace

import torch

from syncd.member.dataplane import GcPause, LoopCache
from syncd.member.dataplane.landing_fault import LandingFault
from syncd.member.dataplane.transport import TransferTimeout
from syncd.vocabulary import Direction


class _WireHandle:
    def __init__(self, what: str) -> None:
        self._paired = threading.Event()
        self._done: torch.cuda.Event | None = None
        self._what = what

    def _complete(self, done: torch.cuda.Event) -> None:
        self._done = done
        self._paired.set()

    def _await_pairing(self, timeout_s: float) -> torch.cuda.Event:
        if not self._paired.wait(timeout_s):
            raise TransferTimeout(f"{self._what}: the peer posted nothing within {timeout_s:.0f} s")
        assert self._done is not None  # set before `_paired`
        return self._done

    def fence(self, timeout_s: float) -> None:
        torch.cuda.current_stream().wait_event(self._await_pairing(timeout_s))

    def wait(self, timeout_s: float) -> None:
        self._await_pairing(timeout_s).synchronize()


class _Endpoint:
    def __init__(self, wire: LoopbackWire, rank: int) -> None:
        self.wire, self.rank, self.world_size = wire, rank, 2

    def isend(self, buf: torch.Tensor, peer: int) -> _WireHandle:
        return self.wire.post("send", buf)

    def irecv(self, buf: torch.Tensor, peer: int) -> _WireHandle:
        return self.wire.post("recv", buf)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class LoopbackWire:
    """Pairs sends with receives in posting order and copies each pair's bytes on one stream.
    `marks` keeps (start, end) CUDA events of every copy, for the idle-wire timeline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=-100)
        self.sender, self.receiver = _Endpoint(self, 0), _Endpoint(self, 1)
        # What a member keeps: per side the loops' cache (staging, prepared work or graphs), and
        # one collector pause for both loops of the process, as `MemberAgent` holds.
        self.caches = {Direction.SEND: LoopCache(), Direction.RECV: LoopCache()}
        self.gc_pause = GcPause()
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()
        # Per side, the posts not yet paired: (buffer, its ready event, the poster's handle).
        self._waiting: dict[str, collections.deque[tuple[torch.Tensor, torch.cuda.Event, _WireHandle]]] = {
            "send": collections.deque(),
            "recv": collections.deque(),
        }

    def post(self, side: str, buf: torch.Tensor) -> _WireHandle:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the packed bytes / the free slot
        handle = _WireHandle(f"loop-back {side} of {buf.numel()} bytes")
        other = "recv" if side == "send" else "send"
        with self._lock:
            if not self._waiting[other]:
                self._waiting[side].append((buf, ready, handle))
                return handle
            peer_buf, peer_ready, peer_handle = self._waiting[other].popleft()
            src, dst = (buf, peer_buf) if side == "send" else (peer_buf, buf)
            if src.numel() != dst.numel():
                raise ValueError(
                    f"loop-back send of {src.numel()} bytes paired with a receive of {dst.numel()}"
                )
            done = self._copy(src, dst, ready, peer_ready)
        handle._complete(done)
        peer_handle._complete(done)
        return handle

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, *after: torch.cuda.Event) -> torch.cuda.Event:
        for event in after:
            self.stream.wait_event(event)
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        with torch.cuda.stream(self.stream):
            dst.copy_(src)
        done.record(self.stream)
        self.marks.append((start, done))
        return done

    def refit(
        self,
        plan,
        sender: tuple[str, dict],
        receiver: tuple[str, dict],
        verify: bool = True,
        graphs: bool = False,
        landing_fault: LandingFault | None = None,
    ):
        """The executor's send and receive loops of `plan` at once, each in its own thread, over
        this wire; `sender`/`receiver` are (member id, catalog views); `verify` and `graphs` go to
        both loops' `LoopOptions`, `landing_fault` to the receiver's. Returns (sender stats,
        receiver stats); a failed side raises."""
        from syncd.member.dataplane import LoopOptions, recv_buckets, send_buckets

        ranks = {sender[0]: 0, receiver[0]: 1}
        options = LoopOptions(120, verify=verify, graphs=graphs, gc_pause=self.gc_pause)
        receiving = replace(options, landing_fault=landing_fault)
        out: dict = {}

        def run(name, fn, member, views, endpoint):
            try:
                cache = self.caches[Direction(name)]
                side = receiving if name == "recv" else options
                out[name] = fn(plan.for_member(member), views, endpoint, ranks, side, cache=cache)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller after join: a failed side fails the run
                out[name] = e

        threads = [
            threading.Thread(target=run, args=("send", send_buckets, *sender, self.sender)),
            threading.Thread(target=run, args=("recv", recv_buckets, *receiver, self.receiver)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        for side in out.values():
            if isinstance(side, BaseException):
                raise side
        return out["send"], out["recv"]

    def timeline(self) -> dict:
        """How busy the wire was between its first and last copy, and its idle gaps (ms)."""
        t0 = self.marks[0][0]
        spans = [(t0.elapsed_time(a), t0.elapsed_time(b)) for a, b in self.marks]
        gaps = [max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(spans)]
        return {
            "copies": len(spans),
            "span_ms": round(spans[-1][1], 3),
            "busy_ms": round(sum(b - a for a, b in spans), 3),
            "idle_ms": round(sum(gaps), 3),
            "largest_gap_ms": round(max(gaps, default=0.0), 3),
        }


class _Done:
    def fence(self, timeout_s: float) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        pass


class NullTransport:
    """A wire that moves nothing and is done at once: it lets one side's loop run alone in the
    calling thread, which the torch profiler (one thread only) needs to attribute that side's
    launches to executor steps. What a receiver unpacks from it is whatever its staging held."""

    rank, world_size = 0, 2

    def isend(self, buf: torch.Tensor, peer: int) -> _Done:
        return _Done()

    def irecv(self, buf: torch.Tensor, peer: int) -> _Done:
        return _Done()

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass
