"""Which transport carries each link of a plan: a pure function of where the members reported
they run (`Place`), the bytes the link moves and syncd's settings.

A stage group has one backend (NCCL when all its members are on GPUs, gloo otherwise, unless
`SYNCD_BACKEND` pins one). With `SYNCD_SAME_HOST=shm` (the default), members that reported the
same host identity (`syncd.net.host_identity`) skip the network:
- in a gloo group, through shared memory (`syncd.member.dataplane.shm`);
- an NCCL group whose members all share memory (one host and one GPU, the same reported UUID,
  `syncd.net.gpu_identity`, or GPUs that each reported the other's as read directly, peer access,
  `syncd.net.peer_gpu_identities`) is a CUDA IPC group (`ipc_group`): it has no NCCL
  communicator, and the receiver of every link copies straight out of the sender's tensors
  (`syncd.member.dataplane.cuda_ipc`). The decision is the group's, not each pair's: NCCL refuses
  two ranks on one GPU, and every member must know whether the group has a communicator. A CUDA
  IPC copy moves bytes as they are, so a link whose units the sender converts or quantizes, or
  one into a receiver that relays (fan-out) or installs by layer, cannot go that way: it keeps
  the backend's name in the plan and fails the refit by name (`ipc_refusal`).
Every other link goes through the group's backend, so one plan, even one group, mixes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from syncd.commands import checksum_key
from syncd.plan.types import Bucket, Plan, TransferUnit
from syncd.vocabulary import Backend, LinkTransport, SameHost


class Place(NamedTuple):
    """Where a member runs, as it reported: its host identity, its GPU's UUID and those of the
    GPUs its GPU reads directly; "" is unknown (or no GPU) and never matches."""

    host: str
    gpu: str = ""
    gpu_peers: frozenset[str] = frozenset()

    def shares_memory_with(self, other: Place) -> bool:
        """On one GPU, or on two that read each other's memory (both ways: both ends of a pair
        decide alike whether they meet)."""
        if not (self.gpu and other.gpu and self.host and self.host == other.host):
            return False
        return self.gpu == other.gpu or (other.gpu in self.gpu_peers and self.gpu in other.gpu_peers)


_UNKNOWN = Place("")


def group_backend(setting: str, devices: Sequence[str]) -> Backend:
    """`setting`: "auto" (NCCL if every member is on a GPU, else gloo), "gloo" or "nccl"."""
    if setting != "auto":
        return Backend(setting)
    return Backend.NCCL if all(d.startswith("cuda") for d in devices) else Backend.GLOO


def ipc_group(backend: Backend, same_host: SameHost, places: Collection[Place]) -> bool:
    """Whether a group on `backend` whose members run at `places` is a CUDA IPC group: NCCL, local
    transports on, and every pair of members sharing memory."""
    return (
        backend == Backend.NCCL
        and same_host == SameHost.SHM
        and all(a.shares_memory_with(b) for a, b in itertools.combinations(places, 2))
    )


def link_transport(
    backend: Backend, same_host: SameHost, src: Place, dst: Place, in_ipc_group: bool = False
) -> LinkTransport:
    """The transport between two members of a group on `backend` (`in_ipc_group`: `ipc_group`
    holds for it), whatever they move (see `ipc_refusal` for what CUDA IPC cannot carry)."""
    if in_ipc_group:
        return LinkTransport.CUDA_IPC
    if backend == Backend.GLOO and same_host == SameHost.SHM and src.host and src.host == dst.host:
        return LinkTransport.SHM
    return LinkTransport(backend)


def nccl_group_problem(members: Mapping[str, Place], same_host: SameHost) -> str | None:
    """Why an NCCL group of `members` cannot form, or None. NCCL refuses two ranks on one GPU; a
    CUDA IPC group (`ipc_group`) needs no NCCL communicator."""
    if ipc_group(Backend.NCCL, same_host, list(members.values())):
        return None
    on_gpu: dict[str, list[str]] = {}
    for member, place in members.items():
        if place.gpu:
            on_gpu.setdefault(place.gpu, []).append(member)
    shared = next((ids for ids in on_gpu.values() if len(ids) > 1), None)
    if shared is None:
        return None
    return (
        f"{' and '.join(shared)} run on one GPU ({members[shared[0]].gpu}) in an NCCL group whose "
        "members do not all share memory, and NCCL refuses two ranks on one GPU: put a stage's members "
        "on one GPU or on GPUs that read each other's memory (CUDA IPC, with SYNCD_SAME_HOST=shm), or "
        "each on a GPU of its own"
    )


def ipc_units_refusal(units: Iterable[TransferUnit]) -> str | None:
    """Why `units` cannot go through CUDA IPC (the first whose bytes change on the way), or None."""
    for u in units:
        if u.src_dtype is not None or u.quantized is not None:
            what = "converts" if u.src_dtype is not None else "quantizes"
            key = checksum_key(u.canonical, u.canon)
            return f"unit {key}: the sender {what} it; a CUDA IPC copy moves bytes as they are"
    return None


def ipc_refusal(buckets: Iterable[Bucket]) -> str | None:
    """Why these buckets of one link cannot go through CUDA IPC, or None: a relay forwards what it
    received from its own staging (fan-out), and a copy cannot convert or quantize."""
    for b in buckets:
        if b.relay is not None:
            return f"bucket {b.index} of {b.src} -> {b.dst} is a relay's (fan-out)"
        refusal = ipc_units_refusal(b.units)
        if refusal is not None:
            return refusal
    return None


def plan_transports(
    plan: Plan,
    groups: Mapping[int, tuple[str, ...]],
    places: Mapping[str, Place],
    devices: Mapping[str, str],
    backend_setting: str,
    same_host: SameHost,
    installs_by_layer: Collection[str] = (),
) -> dict[tuple[int, str, str], LinkTransport]:
    """(stage, src, dst) -> transport for every link of `plan`; `groups`: each stage's members
    (`syncd.daemon.plan_cache.stage_membership`), whose devices choose the stage's backend.
    CUDA IPC copies into the receiver's staging, so a receiver that relays what it received (its
    staging's packed buckets) or installs as buckets arrive (`installs_by_layer`: the generators
    that registered `receive_by_layer`) keeps the backend too."""
    backends = {
        s: group_backend(backend_setting, [devices.get(m, "") for m in ids]) for s, ids in groups.items()
    }
    ipc_groups = {
        s: ipc_group(backends[s], same_host, [places.get(m, _UNKNOWN) for m in ids])
        for s, ids in groups.items()
    }
    relays = {b.src for b in plan.buckets if b.relay is not None}
    by_link: dict[tuple[int, str, str], list[Bucket]] = {}
    for b in plan.buckets:
        by_link.setdefault((b.stage, b.src, b.dst), []).append(b)
    out = {}
    for (stage, src, dst), buckets in by_link.items():
        src_place, dst_place = places.get(src, _UNKNOWN), places.get(dst, _UNKNOWN)
        transport = link_transport(backends[stage], same_host, src_place, dst_place, ipc_groups[stage])
        if transport == LinkTransport.CUDA_IPC and (
            dst in relays or dst in installs_by_layer or ipc_refusal(buckets) is not None
        ):
            transport = LinkTransport(backends[stage])
        out[stage, src, dst] = transport
    return out
