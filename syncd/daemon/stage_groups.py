"""Stage groups: one communicator per trainer PP stage, its senders then its receivers.

Groups outlive a refit: they are reused while their membership (member ids and sessions) is
unchanged, renegotiated when it changes, and dropped after an abort because members tear their
communicators down. A refit's thread asks for the groups of its plan (`for_plan`); an abort, from
any thread, forgets them all (`clear`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from syncd.commands import Command, JoinGroup, Phase, StageGroup
from syncd.daemon.plan_cache import stage_membership
from syncd.daemon.refit_run import RefitAborted, Run, seconds_left
from syncd.daemon.registry import Member
from syncd.plan import Plan
from syncd.plan.transports import (
    Place,
    group_backend,
    ipc_group,
    link_transport,
    nccl_group_problem,
    plan_transports,
)
from syncd.vocabulary import Backend, LinkTransport, SameHost

log = logging.getLogger(__name__)


def place_of(member: Member) -> Place:
    """Where `member` runs, as the transport choice reads it (`syncd.plan.transports`)."""
    return Place(member.host_id, member.gpu_id, frozenset(member.gpu_peers))


def link_transports(
    plan: Plan, members: Iterable[Member], backend: str, same_host: SameHost
) -> dict[tuple[int, str, str], LinkTransport]:
    """What carries each link of `plan` among `members` (`syncd.plan.transports`): what
    `syncctl plan` shows and what ExecutePlan tells the members (`ipc_links`)."""
    members = list(members)
    return plan_transports(
        plan,
        stage_membership(plan),
        {m.member_id: place_of(m) for m in members},
        {m.member_id: m.device for m in members},
        backend,
        same_host,
        frozenset(m.member_id for m in members if m.receive_by_layer),
    )


# Sends a command to a member of the run, raising RefitAborted if it cannot.
Send = Callable[[Run, str, Command], None]
# What a group's communicator depends on: its members and their sessions, in rank order.
GroupKey = tuple[tuple[str, str], ...]


class StageGroups:
    def __init__(self, backend: str, send: Send, same_host: SameHost) -> None:
        self._backend_setting = backend  # "gloo", "nccl" or "auto"
        self._same_host = same_host  # shared memory between members of one host, or not
        self._send = send
        self._lock = threading.Lock()
        self._groups: dict[int, tuple[GroupKey, StageGroup]] = {}

    def for_plan(
        self, run: Run, plan: Plan, members: Mapping[str, Member], deadline: float
    ) -> dict[int, StageGroup]:
        """The groups `plan` needs, stage -> group: cached ones whose membership is unchanged,
        the others negotiated now (raises RefitAborted if that fails)."""
        groups: dict[int, StageGroup] = {}
        for stage, ids in stage_membership(plan).items():
            key = tuple((i, members[i].session_id) for i in ids)
            with self._lock:
                cached = self._groups.pop(stage, None)
            if cached is not None and cached[0] == key:
                group = cached[1]
            else:
                backend = group_backend(self._backend_setting, [members[i].device for i in ids])
                group = StageGroup(stage, f"{run.id}/stage{stage}", backend, ids)
                places = {i: place_of(members[i]) for i in ids}
                problem = nccl_group_problem(places, self._same_host) if backend == Backend.NCCL else None
                if problem is not None:
                    raise RefitAborted(f"stage {stage}: {problem}")
                self._negotiate(run, group, places, deadline)
            with self._lock:
                self._groups[stage] = (key, group)
            groups[stage] = group
        return groups

    def clear(self) -> None:
        """Members tore their communicators down (after an abort): negotiate anew next time."""
        with self._lock:
            self._groups.clear()

    def _negotiate(self, run: Run, group: StageGroup, places: Mapping[str, Place], deadline: float) -> None:
        """Rank 0 creates the address and reports it before blocking in init; syncd relays it.
        Groups are negotiated one after another: a generator in several groups then never waits
        in one group's init while its peers wait in another's."""

        ipc = ipc_group(group.backend, self._same_host, list(places.values()))

        def join(rank: int, address: str) -> JoinGroup:
            return JoinGroup(
                refit_id=run.id,
                group_id=group.group_id,
                stage=group.stage,
                rank=rank,
                world_size=len(group.members),
                backend=group.backend,
                address=address,
                members=group.members,
                timeout_s=seconds_left(deadline),
                links=tuple(
                    link_transport(
                        group.backend, self._same_host, places[group.members[rank]], places[m], ipc
                    )
                    for m in group.members
                ),
            )

        root = group.members[0]
        self._send(run, root, join(0, ""))
        address = run.wait_for(Phase.GROUP_ADDRESS, (root,), deadline)[root].address
        if not address:
            raise RefitAborted(f"{root} reported an empty address for group {group.group_id}")
        for rank, member_id in enumerate(group.members[1:], start=1):
            self._send(run, member_id, join(rank, address))
        run.wait_for(Phase.JOINED, group.members, deadline)
        log.info("group %s joined: %s (%s)", group.group_id, ", ".join(group.members), group.backend)
