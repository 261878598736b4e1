"""A sender's mirror, while delta refits are on: what it last sent (`Mirror`), which its delta
receivers hold as their base, and the update a succeeded transfer leaves for Verify.

Lifecycle of one refit: `delta_part` (ExecutePlan) checks that the mirror holds the delta base
and marks it between versions; the transfer compares against it (`Diffs`); `hold` keeps the
transfer's `MirrorUpdate`, with the endpoint's weights still held; then either `update_on_verify`
(Verify) writes what was sent into the mirror, or `drop` (an Abort, the next ExecutePlan, close)
leaves the mirror between versions, and both release the weights (`Endpoint.end`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from syncd.commands import DeltaLinks, ExecutePlan
from syncd.member.agent.endpoint import Endpoint
from syncd.member.dataplane.delta import Diffs, Mirror
from syncd.weight_version import WeightVersion


@dataclass(frozen=True)
class MirrorUpdate:
    """A sender's transfer that succeeded, whose mirror takes what it sent (`Diffs.commit`) once
    every member's transfer is done (syncd's Verify): until then its endpoint's transfer has not
    ended, so the weights stay as they were sent (the trainer's optimizer step waits)."""

    refit_id: str
    version: WeightVersion
    diffs: Diffs
    tensors: Mapping[str, torch.Tensor]


class SenderMirror:
    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self.mirror: Mirror | None = None  # senders, while delta refits are on: what they last sent
        self._update: MirrorUpdate | None = None  # a sender's, from its transfer to Verify
        self._lock = threading.Lock()

    def delta_part(self, cmd: ExecutePlan, me: str) -> tuple[DeltaLinks | None, Diffs | None]:
        """This member's part in a delta refit: the delta links when it sends or receives deltas
        (a sender sends through its mirror whenever delta refits are on), and a sender's
        comparisons with its mirror, which must hold the base its delta receivers hold. `me`:
        this member's id."""
        d = cmd.delta
        if d is None:
            return None, None
        if not any(b.src == me and b.relay is None for b in cmd.buckets):  # relays: receivers
            return (d if me in d.dsts else None), None
        if self.mirror is None:
            self.mirror = Mirror()
        if any(b.dst in d.dsts for b in cmd.buckets) and self.mirror.version != d.base:
            raise RuntimeError(
                f"{me} holds what it sent of version {self.mirror.version}, not of the delta base {d.base}"
            )
        self.mirror.version = None  # until this transfer completes, the mirror is between versions
        return d, Diffs(self.mirror)

    def hold(self, update: MirrorUpdate, cancel: threading.Event) -> None:
        """Keep a succeeded transfer's update (and its weights held) until Verify."""
        with self._lock:
            self._update = update
        if cancel.is_set():  # aborted since the report: the abort may have looked already
            self.drop()

    def update_on_verify(self, refit_id: str) -> None:
        """Verify: every member's transfer is done, so the mirror's copy (a write of every dense
        byte) no longer competes with the transfer for the memory and cores; it overlaps the
        generators' verification and install instead. The handler thread runs it, so this
        member's Commit confirmation, and the next refit's comparisons, come after it; then the
        weights are released (`Endpoint.end`). A failure leaves the mirror's `version` None: no
        delta from it until a full refit refills it."""
        with self._lock:
            update, self._update = self._update, None
        if update is None:
            return
        try:
            if update.refit_id == refit_id:
                update.diffs.commit(update.tensors)
                update.diffs.mirror.version = update.version
        finally:
            self._endpoint.end(update.refit_id, True)

    def drop(self) -> None:
        """The refit failed after this sender's transfer: its mirror keeps the base (nothing was
        written into it), still marked between versions (`version` None), and the weights are
        released."""
        with self._lock:
            update, self._update = self._update, None
        if update is not None:
            self._endpoint.end(update.refit_id, True)
