"""Which transport carries each link of a plan: a pure function of where the members reported
they run (`Place`), the bytes the link moves and syncd's settings.

A stage group has one backend (NCCL when all its members are on GPUs, gloo otherwise, unless
`SYNCD_BACKEND` pins one). With `SYNCD_SAME_HOST=shm` (the default), members that reported the
same host identity (`syncd.net.host_identity`) skip the network:
- in a gloo group, through shared memory (`syncd.member.dataplane.shm`);
- in an NCCL group, members on the same GPU (the same reported UUID, `syncd.net.gpu_identity`)
  through CUDA IPC (`syncd.member.dataplane.cuda_ipc`): the receiver copies straight out of the
  sender's tensors. A CUDA IPC copy moves bytes as they are, so a link whose units the sender
  converts or quantizes, or one a relay forwards (fan-out), keeps NCCL (`ipc_refusal`).
Every other link goes through the group's backend, so one plan, even one group, mixes them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from syncd.commands import checksum_key
from syncd.plan.types import Bucket, Plan, TransferUnit
from syncd.vocabulary import Backend, LinkTransport, SameHost


class Place(NamedTuple):
    """Where a member runs, as it reported: its host identity and its GPU's UUID; "" is unknown
    (or no GPU) and never matches."""

    host: str
    gpu: str = ""


_UNKNOWN = Place("")


def group_backend(setting: str, devices: Sequence[str]) -> Backend:
    """`setting`: "auto" (NCCL if every member is on a GPU, else gloo), "gloo" or "nccl"."""
    if setting != "auto":
        return Backend(setting)
    return Backend.NCCL if all(d.startswith("cuda") for d in devices) else Backend.GLOO


def link_transport(backend: str, same_host: str, src: Place, dst: Place) -> LinkTransport:
    """The transport between two members of a group on `backend`, whatever they move (see
    `ipc_refusal` for what CUDA IPC cannot carry)."""
    if same_host == SameHost.SHM and src.host and src.host == dst.host:
        if backend == Backend.GLOO:
            return LinkTransport.SHM
        if backend == Backend.NCCL and src.gpu and src.gpu == dst.gpu:
            return LinkTransport.CUDA_IPC
    return LinkTransport(backend)


def nccl_group_problem(members: Mapping[str, Place], same_host: str) -> str | None:
    """Why an NCCL group of `members` cannot form, or None. NCCL refuses two ranks on one GPU; a
    group whose members all share one GPU needs no NCCL communicator (every link is CUDA IPC)."""
    first = next(iter(members.values()), _UNKNOWN)
    if all(
        link_transport(Backend.NCCL, same_host, first, p) == LinkTransport.CUDA_IPC for p in members.values()
    ):
        return None
    on_gpu: dict[str, list[str]] = {}
    for member, place in members.items():
        if place.gpu:
            on_gpu.setdefault(place.gpu, []).append(member)
    shared = next((ids for ids in on_gpu.values() if len(ids) > 1), None)
    if shared is None:
        return None
    return (
        f"{' and '.join(shared)} run on one GPU ({members[shared[0]].gpu}) in an NCCL group whose other "
        "members do not, and NCCL refuses two ranks on one GPU: put all of a stage's members on one GPU "
        "(CUDA IPC, with SYNCD_SAME_HOST=shm) or each on its own"
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
    same_host: str,
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
    relays = {b.src for b in plan.buckets if b.relay is not None}
    by_link: dict[tuple[int, str, str], list[Bucket]] = {}
    for b in plan.buckets:
        by_link.setdefault((b.stage, b.src, b.dst), []).append(b)
    out = {}
    for (stage, src, dst), buckets in by_link.items():
        src_place, dst_place = places.get(src, _UNKNOWN), places.get(dst, _UNKNOWN)
        transport = link_transport(backends[stage], same_host, src_place, dst_place)
        if transport == LinkTransport.CUDA_IPC and (
            dst in relays or dst in installs_by_layer or ipc_refusal(buckets) is not None
        ):
            transport = LinkTransport(backends[stage])
        out[stage, src, dst] = transport
    return out
