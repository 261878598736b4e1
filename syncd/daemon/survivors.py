"""Survivors: after a refit that lost generator replicas, retry it once over the replicas still alive.

A replica killed or cut off mid-refit aborts the refit (its peers' transfers fail, or its lease
ends): nobody committed, so nothing is torn. Without more, the other replicas would wait for an
operator, since a refit needs every expected member. So the refit thread, after the abort:

1. waits up to `settle_s` (the lease plus a second: a dead member's lease has ended by then) for
   the members of the failed plan to be accounted for; a member is *lost* when it is no longer
   registered, or registered again under a new session (restarted: its communicators are gone);
2. retries once when generators were lost and every trainer of the plan is still there: the
   trainers' newest weight version (the aborted one, unless they trained on meanwhile), over the
   registered members minus every *replica* that lost a worker (the other TP ranks of a replica
   that lost one would otherwise install half a version), with the readiness check asking for
   the trainers and at least one generator instead of all expected.
   Stage groups are negotiated anew over the new membership (the abort dropped them), never reused.
   A trainer waiting for the aborted version (`--sync-refit`) is released by the abort and trains
   on: if the retry then aborts because the trainers announced a newer version meanwhile (they
   refuse the one it moves) and it lost nobody, that newer version is retried once more over the
   same survivors (`Coordinator._retry_survivors`), so the survivors do move on.
3. The lost replica catches up when it registers again: it reports an older version, so syncd's
   catch-up refit (`AutoRefit._wants_catch_up`) brings it to the committed one.

A member that is alive but slow is not lost: the refit aborts naming it (`stall_timeout`), and is
not retried (the same member would stall the retry). At most one retry per refit, plus the one of
the trainers' newer version, so the whole sequence is bounded by `settle_s` plus the lease plus two
refits' phase timeouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from syncd.daemon.registry import Member
from syncd.plan import Plan
from syncd.plan.fanout import relay_depths
from syncd.vocabulary import Role


@dataclass(frozen=True)
class Lost:
    """What the failed refit lost, and what a retry must leave out."""

    members: frozenset[str]
    excluded: frozenset[str]  # the lost members and the other workers of their replicas
    reason_not_to_retry: str | None


def replica_of(member: Member) -> tuple[str, int] | None:
    """A generator worker's replica (its `replica` coordinate); None for trainers."""
    if member.role != Role.GENERATOR:
        return None
    return ("replica", int(member.coords.get("replica", 0)))


def stall_timeouts(plan: Plan, base_s: float) -> dict[str, float]:
    """Per member, how long one of its receives may wait (its sends wait twice as long: a member
    blocked on a send is downstream's victim, not its witness).

    When a member stalls, everybody waits: downstream members starve on receives, upstream ones
    block on sends. The first to give up names its peer in the abort, so the first must be the
    stuck member's successor: receives give up before sends, and deeper members a little later
    (10% of `base_s` per hop from the trainers), so among the starved the shallowest, which
    receives from the stuck member itself, names it. A stuck last replica has no successor: then
    its predecessor, blocked first, gives up first."""
    return {m: base_s * (1 + 0.1 * d) for m, d in relay_depths(plan).items()}


def find_lost(planned: Mapping[str, Member], registered: Mapping[str, Member]) -> Lost:
    """`planned`: the failed plan's members as they were when it started; `registered`: now."""
    lost = frozenset(
        m for m, was in planned.items() if m not in registered or registered[m].session_id != was.session_id
    )
    if not lost:
        return Lost(lost, lost, "no member was lost")
    trainers = sorted(m for m in lost if planned[m].role == Role.TRAINER)
    if trainers:
        return Lost(lost, lost, f"trainer ranks {', '.join(trainers)} were lost")
    lost_replicas = {replica_of(planned[m]) for m in lost}
    excluded = lost | frozenset(
        m.member_id
        for m in registered.values()
        if m.role == Role.GENERATOR and replica_of(m) in lost_replicas
    )
    if not any(m.role == Role.GENERATOR and m.member_id not in excluded for m in registered.values()):
        return Lost(lost, excluded, "no generator replica is left")
    return Lost(lost, excluded, None)


def wait_for_lost(
    planned: Mapping[str, Member],
    members: Callable[[], Iterable[Member]],
    settle_s: float,
    poll_s: float = 0.2,
) -> Lost:
    """What the failed plan lost: polled until a member is lost or `settle_s` passed (a member
    alive keeps its lease; a dead one's has ended by then)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = find_lost(planned, {m.member_id: m for m in members()})
        if found.members or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)
