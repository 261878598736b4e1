"""JoinGroup: this member joins one stage group over the group's backend (`join_group`).

Rank 0 creates the rendezvous address (gloo) or NCCL unique id and reports it (GROUP_ADDRESS)
before it blocks in init; the others join with the address syncd relays; all report JOINED. Each
backend has its way to connect (`_CONNECT`):

- gloo: a gloo group, with shared memory to the peers on this host (`ShmTransport`);
- NCCL: a communicator, or none at all where syncd made every link CUDA IPC (`ipc_links`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from syncd.commands import JoinGroup, Phase
from syncd.member.agent.endpoint import Reporter
from syncd.member.agent.groups import JoinedGroup, JoinedGroups
from syncd.member.agent.settings import AgentSettings
from syncd.member.dataplane import GlooTransport, LoopCache, Transport, ipc_links
from syncd.member.dataplane.ipc_links import IpcLinks
from syncd.member.dataplane.shm import ShmTransport, sweep_orphans
from syncd.vocabulary import Backend, LinkTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Connected:
    """What a backend's connect gives: a transport, or (a CUDA IPC group) the links instead."""

    transport: Transport | None
    ipc: IpcLinks | None = None


def _connect_nccl(cmd: JoinGroup, client: Reporter, settings: AgentSettings, t0: float) -> _Connected:
    from syncd.member.dataplane.nccl import NcclTransport

    device = torch.device(settings.device)
    # syncd decides per group (`syncd.plan.transports.ipc_group`): every link CUDA IPC and no NCCL
    # communicator, or NCCL on every link.
    others = [r for r in range(cmd.world_size) if r != cmd.rank]
    over_ipc = bool(cmd.links) and all(cmd.links[r] == LinkTransport.CUDA_IPC for r in others)
    create = ipc_links.create_address if over_ipc else NcclTransport.create_address
    address = create() if cmd.rank == 0 else cmd.address
    if cmd.rank == 0:
        client.report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
    if over_ipc:
        left = cmd.timeout_s - (time.perf_counter() - t0)
        return _Connected(None, IpcLinks(ipc_links.meet(address, cmd.rank, others, left), device))
    return _Connected(NcclTransport.connect(address, cmd.rank, cmd.world_size, device, cmd.timeout_s))


def _connect_gloo(cmd: JoinGroup, client: Reporter, settings: AgentSettings, t0: float) -> _Connected:
    store = None
    address = cmd.address
    if cmd.rank == 0:
        address, store = GlooTransport.create_address(settings.host, cmd.world_size, cmd.timeout_s)
        client.report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
    gloo = GlooTransport.connect(
        address, cmd.rank, cmd.world_size, cmd.group_id, cmd.timeout_s, store, bind_host=settings.host
    )
    local = [r for r, link in enumerate(cmd.links) if link == LinkTransport.SHM and r != cmd.rank]
    if not local:
        return _Connected(gloo)
    # peers on this host: shared memory to them, gloo to the others
    sweep_orphans()  # what members killed in an earlier refit left
    return _Connected(ShmTransport(gloo, local, cmd.group_id, cmd.timeout_s))


_CONNECT: dict[Backend, Callable[[JoinGroup, Reporter, AgentSettings, float], _Connected]] = {
    Backend.NCCL: _connect_nccl,
    Backend.GLOO: _connect_gloo,
}


def join_group(cmd: JoinGroup, client: Reporter, settings: AgentSettings, groups: JoinedGroups) -> None:
    """Replace the group of `cmd.stage` with the one `cmd` names, then report JOINED (the group is
    in `groups` first, so an Abort that follows the report closes it)."""
    groups.close(cmd.stage)
    t0 = time.perf_counter()
    connect = _CONNECT.get(cmd.backend)
    if connect is None:
        known = " or ".join(repr(str(b)) for b in _CONNECT)
        raise ValueError(f"no way to join a {cmd.backend!r} group; this member joins {known}")
    connected = _unless_aborted(connect, cmd, client, settings, t0, groups)
    transport = connected.transport
    # Over shared memory the loops' staging is the transport's: sends from it copy nothing.
    allocate = transport.allocate if isinstance(transport, ShmTransport) else None
    groups.add(
        cmd.stage, JoinedGroup(cmd.group_id, cmd.members, transport, LoopCache(allocate), connected.ipc)
    )
    client.report(cmd.refit_id, Phase.JOINED, timings={"join_s": time.perf_counter() - t0})
    shm = sorted(transport.local_peers) if isinstance(transport, ShmTransport) else []
    ipc = connected.ipc
    log.info(
        "%s joined %s as rank %d/%d%s%s",
        client.member_id,
        cmd.group_id,
        cmd.rank,
        cmd.world_size,
        f", shared memory to ranks {shm}" if shm else "",
        f", CUDA IPC to ranks {sorted(ipc.peers)}" if ipc is not None else "",
    )


def _unless_aborted(
    connect: Callable[[JoinGroup, Reporter, AgentSettings, float], _Connected],
    cmd: JoinGroup,
    client: Reporter,
    settings: AgentSettings,
    t0: float,
    groups: JoinedGroups,
) -> _Connected:
    """`connect` on a thread of its own, given up at an Abort: a group whose member was lost while
    it formed blocks the others in its rendezvous until `cmd.timeout_s`, and the commands after
    the Abort (the retry's groups) would wait behind it. A connect given up closes what it made
    once it ends."""
    aborts = groups.aborts
    joined, lock = threading.Event(), threading.Lock()
    outcome: list[_Connected | BaseException] = []
    abandoned = False

    def run() -> None:
        try:
            connected: _Connected | BaseException = connect(cmd, client, settings, t0)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            connected = e
        with lock:
            if abandoned and isinstance(connected, _Connected):
                _close(connected)
            else:
                outcome.append(connected)
        joined.set()
        groups.wake()

    threading.Thread(target=run, name=f"join-{cmd.group_id}", daemon=True).start()
    if not groups.joining(joined, aborts):
        with lock:
            abandoned = True
            made = [c for c in outcome if isinstance(c, _Connected)]
        for connected in made:
            _close(connected)
        raise RuntimeError(f"joining {cmd.group_id} was given up: the refit was aborted")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _close(connected: _Connected) -> None:
    if connected.transport is not None:
        connected.transport.close()
    if connected.ipc is not None:
        connected.ipc.close()
