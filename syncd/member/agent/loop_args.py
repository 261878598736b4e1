"""What the transfer loops are called with, built once per refit (`RefitTransfer`, from the
ExecutePlan) and sliced per stage group (`StageTransfer`), so that each loop of `stage_loops`
takes one object instead of a long list of arguments."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from syncd.commands import DeltaLinks, ExecutePlan
from syncd.member.agent.groups import JoinedGroup
from syncd.member.agent.progress import ArrivedBytes
from syncd.member.agent.settings import AgentSettings
from syncd.member.dataplane import GcPause, LoopCache, LoopOptions, Transport
from syncd.member.dataplane.delta import Diffs
from syncd.member.dataplane.landing_fault import LandingFault
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.plan.types import Bucket


@dataclass(frozen=True)
class RefitTransfer:
    """This member's part of one refit's transfer.

    wait_s: how long one receive may wait (the stall timeout within the phase's deadline), so a
        slow peer is named, not waited for; sends and forwards wait twice that: a blocked sender
        is its receiver's victim, and the member starving on a receive names the stuck one first
        (`syncd.daemon.survivors`).
    delta, diffs: the delta links this member sends or receives over, and a sender's comparisons
        with its mirror (`SenderMirror.delta_part`); None outside delta refits.
    """

    member_id: str
    refit_id: str
    tensors: Mapping[str, torch.Tensor] | ReceiveSink  # what `Endpoint.begin` gave
    cancel: threading.Event  # set by an Abort
    wait_s: float
    in_flight: int
    gc_pause: GcPause | None
    landing_fault: LandingFault | None
    delta: DeltaLinks | None
    diffs: Diffs | None
    ipc_links: frozenset[tuple[int, str, str]]  # (stage, src, dst) that go through CUDA IPC
    arrived: ArrivedBytes | None = None  # counts what the receive loops took, for progress reports

    @staticmethod
    def of(
        cmd: ExecutePlan,
        member_id: str,
        tensors: Mapping[str, torch.Tensor] | ReceiveSink,
        cancel: threading.Event,
        settings: AgentSettings,
        gc_pause: GcPause | None,
        landing_fault: LandingFault | None,
        delta_part: tuple[DeltaLinks | None, Diffs | None],
        arrived: ArrivedBytes | None = None,
    ) -> RefitTransfer:
        stall = cmd.stall_timeout_s
        wait_s = min(cmd.timeout_s, stall) if stall > 0 else cmd.timeout_s
        delta, diffs = delta_part
        return RefitTransfer(
            member_id,
            cmd.refit_id,
            tensors,
            cancel,
            wait_s,
            settings.in_flight,
            gc_pause,
            landing_fault,
            delta,
            diffs,
            cmd.ipc_links,
            arrived,
        )

    def stage(self, stage: int, group: JoinedGroup, buckets: Sequence[Bucket]) -> StageTransfer:
        me = self.member_id
        relaying = any(b.relay is not None and b.src == me for b in buckets)  # fan-out
        # A relay is a receiver first: its receives wait `wait_s`, only its forwards twice (its
        # own relay buckets sort before a trainer's, so buckets[0] may be one).
        sending = not relaying and buckets[0].src == me
        options = LoopOptions(
            2 * self.wait_s if sending else self.wait_s,
            self.in_flight,
            gc_pause=self.gc_pause,
            landing_fault=self.landing_fault,
            on_received=None if self.arrived is None else self.arrived.add,
        )
        return StageTransfer(self, stage, group, buckets, group.ranks, sending, relaying, options)


@dataclass(frozen=True)
class StageTransfer:
    """One stage group's part of a `RefitTransfer`: its buckets (plan order), its group, and
    whether this member sends, receives, or relays (receives and forwards) them."""

    refit: RefitTransfer
    stage: int
    group: JoinedGroup
    buckets: Sequence[Bucket]
    ranks: Mapping[str, int]  # each group member's rank
    sending: bool
    relaying: bool
    options: LoopOptions

    @property
    def transport(self) -> Transport:
        assert self.group.transport is not None  # only CUDA IPC groups have none
        return self.group.transport

    @property
    def cache(self) -> LoopCache:
        return self.group.cache

    @property
    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """The tensors as the loops that take named tensors declare them. A sender always names
        its tensors; a receiver's `ReceiveSink` goes through as it is (the receive loops take it
        by what it does)."""
        return cast(Mapping[str, torch.Tensor], self.refit.tensors)

    @property
    def forward_timeout_s(self) -> float:
        """How long a relay's forward may wait (a send: twice a receive's wait)."""
        return 2 * self.refit.wait_s
