"""Fan-out: each byte leaves the sources once per layout, however many replicas receive it.

Destinations with identical catalogs (the same TP rank of R replicas of one vLLM layout) need
identical buckets. `make_fanout_plan` groups them into *replica sets*, plans the first member of
each set (its head) from the sources exactly as `make_plan` does, and lets every other member
receive the head's buckets from a member before it, in a tree of bounded fan-out over the set in
its given order: member p (p >= 1) receives from member (p - 1) // fanout. fanout=1 is a chain,
the default: every member's link then carries one copy in and one copy out, the least any member
can carry, and a relay forwards bucket i while it receives bucket i + 1, so the refit takes about
one copy plus a bucket time per hop.

Relay buckets (`Bucket.relay`) carry the units of the bucket they forward, unchanged, and are
numbered in their sender's receive order: by (stage, src, index) of the head's buckets, the order
in which every receiver loop takes a link's buckets. So a relay receives its i-th bucket, forwards
it as its children's i-th, and each child, receiving from one member, takes them in that order.

Destinations that install while they receive (`DestMember.by_layer`) are their own sets of one:
their buckets are cut at their layer groups, and their loop takes buckets interleaved by landing
place rather than in link order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from syncd.plan.planner import DEFAULT_BUCKET_BYTES, make_plan
from syncd.plan.types import Bucket, DestMember, Plan, Relay, SourceMember

DEFAULT_FANOUT = 1


def replica_sets(destinations: Sequence[DestMember]) -> list[list[DestMember]]:
    """Destinations grouped by identical catalogs, each set in the given order (sets by their first
    member); `by_layer` destinations each alone."""
    sets: list[list[DestMember]] = []
    for d in destinations:
        match = None
        if not d.by_layer:
            match = next(
                (
                    s
                    for s in sets
                    if not s[0].by_layer and (s[0].catalog is d.catalog or s[0].catalog == d.catalog)
                ),
                None,
            )
        if match is None:
            sets.append([d])
        else:
            match.append(d)
    return sets


def relay_parent(position: int, fanout: int) -> int:
    """The position in its replica set of the member that relays to member `position` (>= 1)."""
    return (position - 1) // fanout


def make_fanout_plan(
    sources: Sequence[SourceMember],
    destinations: Sequence[DestMember],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fanout: int = DEFAULT_FANOUT,
) -> Plan:
    """`make_plan` for the head of every replica set, plus relay buckets that carry the head's
    buckets to the set's other members (`fanout` children per relay at most). Raises ValueError as
    `make_plan` does, and for a fanout below 1."""
    if fanout < 1:
        raise ValueError(f"fanout must be at least 1 (1: a chain), got {fanout}")
    sets = replica_sets(destinations)
    base = make_plan(sources, [s[0] for s in sets], bucket_bytes=bucket_bytes)
    received: dict[str, list[Bucket]] = {}
    for b in base.buckets:
        received.setdefault(b.dst, []).append(b)
    relays: list[Bucket] = []
    stage_members = {s: set(ids) for s, ids in base.stage_members.items()}
    for members in sets:
        head_buckets = sorted(received.get(members[0].member_id, ()), key=lambda b: (b.stage, b.src, b.index))
        for position in range(1, len(members)):
            parent = members[relay_parent(position, fanout)].member_id
            child = members[position].member_id
            for index, b in enumerate(head_buckets):
                if parent == members[0].member_id:
                    forwards = b.key
                else:
                    forwards = (_grandparent(members, position, fanout), parent, index)
                relays.append(
                    Bucket(b.stage, parent, child, index, b.units, b.nbytes, Relay(b.origin, forwards))
                )
                stage_members.setdefault(b.stage, set()).add(child)
    relays.sort(key=lambda b: (b.stage, b.src, b.dst, b.index))
    return Plan(
        buckets=base.buckets + tuple(relays),
        bucket_bytes=base.bucket_bytes,
        stage_members={s: tuple(sorted(ids)) for s, ids in sorted(stage_members.items())},
    )


def relay_depths(plan: Plan) -> dict[str, int]:
    """Hops from the sources to each member of `plan`: 0 for sources, 1 for destinations they feed,
    1 + its relay's depth for a relayed destination."""
    parent = {b.dst: b.src for b in plan.buckets if b.relay is not None}
    depths = {b.src: 0 for b in plan.buckets if b.relay is None}

    def depth(member: str) -> int:
        if member not in depths:
            depths[member] = 1 if member not in parent else 1 + depth(parent[member])
        return depths[member]

    for b in plan.buckets:
        depth(b.dst)
    return depths


def _grandparent(members: Sequence[DestMember], position: int, fanout: int) -> str:
    """The member that relays to the parent of member `position` (whose parent is not the head)."""
    return members[relay_parent(relay_parent(position, fanout), fanout)].member_id


def received_bytes(plan: Plan, reported: Mapping[str, int]) -> int:
    """What the destinations of `plan` received, from the bytes each reported: a relay reports
    what it forwarded too, which is what its successors received (also on delta links, whose
    bytes it forwards as they came)."""
    children: dict[str, set[str]] = {}
    for b in plan.buckets:
        if b.relay is not None:
            children.setdefault(b.src, set()).add(b.dst)

    def received(member: str) -> int:
        return reported[member] - sum(received(c) for c in children.get(member, ()))

    return sum(received(m) for m in {b.dst for b in plan.buckets})
