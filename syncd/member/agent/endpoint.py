"""What the agent drives and whom it answers: the member's `Endpoint` (what it exposes to the
data plane) and its `Reporter` (the client that reports to syncd)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from syncd.commands import Phase
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.plan.types import Bucket
from syncd.weight_version import WeightVersion


class Endpoint(Protocol):
    """What a member exposes to the data plane."""

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor] | ReceiveSink:
        """Tensors (views in the catalog's shapes) to send `buckets` from or receive them into, or
        a receiver that takes each arrived bucket itself (`ReceiveSink`)."""
        ...

    def end(self, refit_id: str, ok: bool) -> None:
        """This member's transfer is over: all its buckets moved (`ok`) or it failed. A trainer may
        step again; a generator knows what it staged. A sender with delta refits on hears it on
        Verify (or the refit's abort), once its mirror took what it sent (`SenderMirror`)."""
        ...

    def verify(self, refit_id: str) -> None: ...

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        """Make `weight_version` live within `timeout_s` (syncd's deadline) or raise."""
        ...

    def abort(self) -> None: ...

    # Optional: `received_delta(refit_id, changed)` hears, after a delta transfer, which of its
    # tensors changed (the rest hold the base version), so a generator installs only those.
    # Optional: `begin_adapter(refit_id, weight_version, buckets, spec)`, on generators that take
    # named LoRA adapters into slots: like `begin`, for a refit of adapter `spec` (its buffers are
    # named by `syncd.layout.adapters.slot_tensor`); Verify, Commit and Abort of that refit then
    # concern the adapter, not the base weights.


class Reporter(Protocol):
    """What the agent needs of its client (`MemberClient`): its id, and answering a command."""

    @property
    def member_id(self) -> str: ...

    def report(
        self,
        refit_id: str,
        phase: Phase,
        *,
        ok: bool = True,
        error: str = "",
        bytes: int = 0,
        checksums: dict[str, str] | None = None,
        timings: dict[str, float] | None = None,
        address: str = "",
        delta_elements: int = 0,
        changed_elements: int = 0,
    ) -> None: ...
