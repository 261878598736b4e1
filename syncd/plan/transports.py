"""Which transport carries each link of a plan: a pure function of the members' reported hosts and
devices and syncd's settings.

A stage group has one backend (NCCL when all its members are on GPUs, gloo otherwise, unless
`SYNCD_BACKEND` pins one). Within a gloo group, a link between two members that reported the same
host identity (`syncd.net.host_identity`) goes through shared memory
(`syncd.member.dataplane.shm`), every other link through gloo; so one plan, even one group,
mixes both. NCCL groups keep NCCL on every link (a CUDA IPC path is not built yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from syncd.plan.types import Plan
from syncd.vocabulary import Backend, LinkTransport, SameHost


def group_backend(setting: str, devices: Sequence[str]) -> Backend:
    """`setting`: "auto" (NCCL if every member is on a GPU, else gloo), "gloo" or "nccl"."""
    if setting != "auto":
        return Backend(setting)
    return Backend.NCCL if all(d.startswith("cuda") for d in devices) else Backend.GLOO


def link_transport(backend: str, same_host: str, src_host: str, dst_host: str) -> LinkTransport:
    """The transport between two members of a group on `backend`; an empty host is unknown
    (a member that did not report one) and never matches."""
    if backend == Backend.GLOO and same_host == SameHost.SHM and src_host and src_host == dst_host:
        return LinkTransport.SHM
    return LinkTransport(backend)


def plan_transports(
    plan: Plan,
    groups: Mapping[int, tuple[str, ...]],
    hosts: Mapping[str, str],
    devices: Mapping[str, str],
    backend_setting: str,
    same_host: str,
) -> dict[tuple[int, str, str], LinkTransport]:
    """(stage, src, dst) -> transport for every link of `plan`; `groups`: each stage's members
    (`syncd.daemon.plan_cache.stage_membership`), whose devices choose the stage's backend."""
    backends = {
        s: group_backend(backend_setting, [devices.get(m, "") for m in ids]) for s, ids in groups.items()
    }
    return {
        (k.stage, k.src, k.dst): link_transport(
            backends[k.stage], same_host, hosts.get(k.src, ""), hosts.get(k.dst, "")
        )
        for k in plan.links()
    }
