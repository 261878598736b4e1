"""The stage groups a member joined (`JoinedGroups`): one per trainer PP stage, each with its
transport and what the loops over it keep between refits (`JoinedGroup`).

Lifecycle: a JoinGroup replaces its stage's group (`join_group`); the group is kept across
refits until syncd regroups that stage, an Abort closes them all, or a stage's transfer fails
(its thread closes the group, so that its peers fail fast instead of waiting out their timeout).
Thread-safe: the handler thread joins and transfers, the abort thread and the stage threads close.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from syncd.member.dataplane import LoopCache, Transport
from syncd.member.dataplane.ipc_links import IpcLinks
from syncd.member.dataplane.shm import ShmTransport, sweep_orphans


@dataclass
class JoinedGroup:
    group_id: str
    members: tuple[str, ...]
    # None: a CUDA IPC group (its members all share memory), without NCCL (`ipc_links`).
    transport: Transport | None
    cache: LoopCache  # what the loops over `transport` keep between refits; dropped with it
    ipc: IpcLinks | None = None  # the links to members this member shares memory with (CUDA IPC)

    @property
    def ranks(self) -> Mapping[str, int]:
        """Each member's rank in the group."""
        return {m: i for i, m in enumerate(self.members)}

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.ipc is not None:
            self.ipc.close()


class JoinedGroups:
    def __init__(self) -> None:
        self._groups: dict[int, JoinedGroup] = {}
        self._lock = threading.Lock()
        # Aborts so far (`close_all`), and the condition a join in progress waits on (`joining`).
        self._changed = threading.Condition()
        self._aborts = 0

    def add(self, stage: int, group: JoinedGroup) -> None:
        with self._lock:
            self._groups[stage] = group

    def get(self, stage: int) -> JoinedGroup | None:
        with self._lock:
            return self._groups.get(stage)

    def close(self, stage: int) -> None:
        with self._lock:
            group = self._groups.pop(stage, None)
        if group is not None:
            group.close()

    def close_all(self) -> None:
        """An Abort (or the member closing): every group closes, and a join in progress gives up."""
        with self._changed:
            self._aborts += 1
            self._changed.notify_all()
        for stage in list(self._groups):
            self.close(stage)

    @property
    def aborts(self) -> int:
        with self._changed:
            return self._aborts

    def joining(self, joined: threading.Event, aborts: int) -> bool:
        """Block until `joined` is set (True) or an abort came after the first `aborts` (False)."""
        with self._changed:
            self._changed.wait_for(lambda: joined.is_set() or self._aborts != aborts)
            return self._aborts == aborts

    def wake(self) -> None:
        """A join in progress ended: whoever waits in `joining` looks again."""
        with self._changed:
            self._changed.notify_all()

    def end_shared_memory(self) -> None:
        """The transfer ended: no segment name of this refit stays in /dev/shm, ours or those of a
        local peer that died before it could unlink its own."""
        with self._lock:
            transports = [g.transport for g in self._groups.values()]
        shared = [t for t in transports if isinstance(t, ShmTransport)]
        for transport in shared:
            transport.end_refit()
        if shared:
            sweep_orphans()
