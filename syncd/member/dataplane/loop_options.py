"""What the send/recv loops are told (`LoopOptions`) and what they keep between refits
(`LoopCache`), both passed in by the caller: the data plane holds no state of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from syncd.member.dataplane.gc_pause import GcPause
from syncd.member.dataplane.graphs import LoopGraphs
from syncd.member.dataplane.landing_fault import LandingFault
from syncd.member.dataplane.prepared import PreparedLoop
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction


@dataclass(frozen=True)
class LoopOptions:
    """How one call of `send_buckets` / `recv_buckets` (or their delta variants) runs.

    timeout_s: how long any one wait on the wire may take (members pass syncd's phase deadline).
    in_flight: staging buffers per loop: 2 packs the next bucket while the previous is on the wire.
    verify: checksum every unit on both sides (syncd compares them), and on the receiving side
        once more where it landed, before the loop returns (`syncd.member.dataplane.landed`).
    verify_landed: with `verify`, the check where the bytes landed; off only to measure its cost
        (`bench/landed_bench.py`): without it a fault in the receiver's own code goes unseen.
    graphs: on GPUs, capture each bucket's copies and checksums as CUDA graphs on the first refit
        and replay them on later ones (`syncd.member.dataplane.graphs`); every loop of the process
        must agree. Off: on one H100 it ran slower
        (bench/reports/2026-11-23-data-plane-host-work.md).
    gc_pause: held while the loop runs (`syncd.member.dataplane.gc_pause`); None leaves the
        collector alone. `MemberAgent` passes its own.
    on_received: called with each bucket a receive loop took off the wire (a member's progress
        reports count them, `syncd.member.agent.progress`); it must return at once. None: nothing.
    landing_fault: tests only (`syncd.member.dataplane.landing_fault`): a receive loop changes one
        received byte before its unpack. None (always, outside tests): nothing is changed.
    """

    timeout_s: float
    in_flight: int = 2
    verify: bool = True
    verify_landed: bool = True
    graphs: bool = False
    gc_pause: GcPause | None = None
    landing_fault: LandingFault | None = None
    on_received: Callable[[Bucket], None] | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"LoopOptions.timeout_s must be > 0 seconds, not {self.timeout_s!r}")
        if self.in_flight < 1:
            raise ValueError(f"LoopOptions.in_flight must be at least 1 buffer, not {self.in_flight!r}")

    def gc_paused(self) -> contextlib.AbstractContextManager:
        """`gc_pause` held (while a loop runs, or a delta transfer around its loops), or nothing."""
        return self.gc_pause.held() if self.gc_pause is not None else contextlib.nullcontext()


class LoopCache:
    """What the loops over one transport keep from one refit to the next, so that refits after the
    first neither fault in fresh staging memory nor prepare (or capture) every bucket's work again:
    the staging buffers (shared by both directions) and, per direction, the prepared bucket work
    or the CUDA graphs. Its owner keeps it as long as the transport (the agent: one per stage
    group, dropped with the group); a loop called without one starts from nothing."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        # Host staging from the transport (`ShmTransport.allocate`: shared memory its peers on
        # this host read from); None: plain memory.
        self._allocate = allocate
        self._staging: list[torch.Tensor] = []
        self._graphs: dict[Direction, LoopGraphs] = {}
        self._prepared: dict[Direction, PreparedLoop] = {}

    def staging(self, count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """`count` byte buffers of at least `nbytes` on `device`, the last ones when they fit."""
        pool = self._staging
        if len(pool) != count or pool[0].numel() < nbytes or pool[0].device != device:
            if self._allocate is not None and device.type == "cpu":
                pool = [self._allocate(nbytes) for _ in range(count)]
            else:
                pool = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
            self._staging = pool
        return pool

    def graphs(self, direction: Direction, device: torch.device) -> LoopGraphs:
        graphs = self._graphs.get(direction)
        if graphs is None or graphs.device != device:
            graphs = self._graphs[direction] = LoopGraphs(device)
        return graphs

    def prepared(self, direction: Direction) -> PreparedLoop:
        return self._prepared.setdefault(direction, PreparedLoop(direction))

    def drop_staging(self) -> None:
        """Let go of the staging buffers (a transport that lent them took them back)."""
        self._staging = []

    def clear(self) -> None:
        """Forget everything (benchmarks measure a first refit with it)."""
        self._staging, self._graphs, self._prepared = [], {}, {}
