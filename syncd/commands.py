"""Commands syncd sends to a member through its Watch stream, as typed frozen dataclasses.

`MemberClient` converts each protobuf `Command` into one of these and passes it to the member's
handler. Every command carries the refit it belongs to and, except Abort, `timeout_s`: the
seconds left of syncd's deadline for that phase. Members take their timeouts from it, so that a
member never works on after syncd has given up on the phase (syncd's settings are the one place
timeouts are defined). The member answers each with a `MemberReport` (`MemberClient.report(refit_id,
phase, ...)` builds it) naming its `Phase`; both sides convert it to and from protobuf at the edge
(`syncd.api.convert`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from syncd.layout import Box
from syncd.layout.adapters import AdapterSpec
from syncd.plan.types import Bucket
from syncd.vocabulary import Backend, LinkTransport
from syncd.weight_version import WeightVersion


class Phase(StrEnum):
    """Phase names for `MemberClient.report`; each answers one command (a StrEnum: each is also the
    plain string the protobuf enum is named after)."""

    GROUP_ADDRESS = "GROUP_ADDRESS"  # JoinGroup to rank 0: the address it created, before init
    JOINED = "JOINED"  # JoinGroup: communicator initialised
    TRANSFERRED = "TRANSFERRED"  # ExecutePlan: bytes, checksums, timings
    VERIFIED = "VERIFIED"  # Verify: optionally more checksums
    COMMITTED = "COMMITTED"  # Commit: the new version is live
    ABORTED = "ABORTED"  # Abort: communicators torn down (informational)


@dataclass(frozen=True)
class MemberReport:
    """A member's answer to one command of refit `refit_id`. TRANSFERRED carries the bytes it
    moved, a checksum per unit (`checksum_key`) and timings; GROUP_ADDRESS the address it created."""

    member_id: str
    refit_id: str
    phase: Phase
    ok: bool = True
    error: str = ""
    bytes: int = 0
    checksums: Mapping[str, str] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    address: str = ""
    delta_elements: int = 0  # TRANSFERRED over delta links: the units' elements,
    changed_elements: int = 0  # and how many of them changed


@dataclass(frozen=True)
class StageGroup:
    """The communicator of one trainer PP stage: its senders then its receivers, in rank order."""

    stage: int
    group_id: str
    backend: Backend
    members: tuple[str, ...]

    def rank_of(self, member_id: str) -> int:
        return self.members.index(member_id)


@dataclass(frozen=True)
class JoinGroup:
    """Join `group_id` as `rank`. Rank 0 gets an empty `address`: it creates the rendezvous
    address (gloo) or NCCL unique id, reports it with phase GROUP_ADDRESS *before* blocking in
    init, and syncd relays it to the other ranks. Everyone reports JOINED once initialised."""

    refit_id: str
    group_id: str
    stage: int
    rank: int
    world_size: int
    backend: Backend
    address: str
    members: tuple[str, ...]
    timeout_s: float
    # Per group rank, the transport between this member and that one; empty: the backend on every
    # link.
    links: tuple[LinkTransport, ...] = ()


@dataclass(frozen=True)
class DeltaLinks:
    """Delta refits are on: senders keep what they send (`syncd.member.dataplane.delta`), and the
    members `dsts`, which hold version `base` (None when no member does), receive only the elements
    that changed since; a bucket whose delta would not save `max_fraction` of its bytes goes dense."""

    base: WeightVersion | None
    dsts: frozenset[str]
    max_fraction: float


@dataclass(frozen=True)
class ExecutePlan:
    """Send or receive `buckets` (plan order) over the stage groups in `groups`, then report
    TRANSFERRED with bytes and per-unit checksums keyed by `checksum_key`. `delta`: set while delta
    refits are on. `stall_timeout_s`: how long one send or receive may wait before the member
    gives up, naming the peer as slow or stuck (0: up to `timeout_s`)."""

    refit_id: str
    weight_version: WeightVersion
    buckets: tuple[Bucket, ...]
    groups: tuple[StageGroup, ...]
    timeout_s: float
    delta: DeltaLinks | None = None
    stall_timeout_s: float = 0.0
    # (stage, src, dst) of the links whose buckets go through CUDA IPC (`syncd.plan.transports`);
    # every other link goes through its group's backend.
    ipc_links: frozenset[tuple[int, str, str]] = frozenset()
    # A refit of a named adapter (`syncd.layout.adapters`): receivers take it into the adapter's
    # slot tensors; None for a refit of the base weights.
    adapter: AdapterSpec | None = None


@dataclass(frozen=True)
class Verify:
    """Transfer finished everywhere: check the staged weights and report VERIFIED."""

    refit_id: str
    weight_version: WeightVersion
    timeout_s: float


@dataclass(frozen=True)
class Commit:
    """Switch to `weight_version` of training run `run_id` (generators install staged weights, reset
    prefix caches) within `timeout_s`, or fail. (run_id, weight_version) names one weight set."""

    refit_id: str
    weight_version: WeightVersion
    timeout_s: float
    run_id: str = ""
    # A refit of this named adapter: `weight_version` is the adapter's, installed into its slot;
    # the base version the member serves does not change. Empty for the base weights.
    adapter: str = ""


@dataclass(frozen=True)
class Abort:
    """Tear down communicators, drop staged weights, keep serving the committed version."""

    refit_id: str
    reason: str


Command = JoinGroup | ExecutePlan | Verify | Commit | Abort


def checksum_key(canonical: str, canon: Box) -> str:
    """The key of a checksum report: a canonical tensor and a box of it, e.g. `w[0:8,0:16]`.
    Senders and receivers of the same unit produce the same key (the data plane names its
    checksums with it) and syncd's comparison looks them up by it."""
    return canonical + "[" + ",".join(f"{a}:{b}" for a, b in zip(canon.start, canon.stop)) + "]"


@dataclass(frozen=True)
class ProgressReport:
    """A receiving member's bytes so far of each link into it, while it transfers (not an answer
    to a command: it sends one a few times a second at most, `syncd.member.agent.progress`).
    `links`: (stage, src) -> bytes of that link's buckets that arrived, a running total."""

    member_id: str
    refit_id: str
    links: Mapping[tuple[int, str], int]
