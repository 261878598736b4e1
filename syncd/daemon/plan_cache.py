"""Plans for the current membership, cached by topology and catalog hashes, and the queries a
refit asks of a plan (who takes part, who sits in which stage group). A small cache plus pure
functions: no I/O. What a plan must satisfy, and what reports must agree with, is in `checks`."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from syncd.daemon.registry import Member
from syncd.layout import Catalog, dtype_bytes
from syncd.plan import DestMember, Plan, SourceMember, make_fanout_plan, make_plan
from syncd.vocabulary import Role

PlanKey = tuple


def plan_key(members: Sequence[Member], bucket_bytes: int) -> PlanKey:
    """Everything a plan depends on: who sits where with which catalog, and the bucket size."""
    return (
        bucket_bytes,
        tuple(sorted((m.role, m.member_id, m.stage, m.catalog_hash, m.receive_by_layer) for m in members)),
    )


class PlanCache:
    def __init__(self, size: int = 4, max_buckets: int = 1_000_000, fanout: int = 0) -> None:
        self._size = size
        self._max_buckets = max_buckets
        self._fanout = fanout  # 0: every destination from the sources; k: relays to k (fan-out)
        self._lock = threading.Lock()
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()

    def get(self, members: Sequence[Member], catalog: Callable[[str], Catalog], bucket_bytes: int) -> Plan:
        """The plan for `members`; raises ValueError (from the planner) naming the tensor."""
        key = plan_key(members, bucket_bytes)
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
        sources = [
            SourceMember(m.member_id, m.stage, catalog(m.catalog_hash))
            for m in members
            if m.role == Role.TRAINER
        ]
        dests = [
            DestMember(m.member_id, catalog(m.catalog_hash), by_layer=m.receive_by_layer)
            for m in members
            if m.role == Role.GENERATOR
        ]
        if not sources or not dests:
            raise ValueError(f"a plan needs trainers and generators; have {len(sources)} and {len(dests)}")
        # Planning costs at least one bucket per `bucket_bytes` received: refuse absurd catalogs
        # (an 81-byte catalog can declare int8[2**62]) before spending minutes and gigabytes.
        buckets = sum(-(-_held_bytes(d.catalog) // bucket_bytes) for d in dests)
        if buckets > self._max_buckets:
            raise ValueError(
                f"the plan would need at least {buckets} buckets of {bucket_bytes} bytes, "
                f"more than the limit {self._max_buckets} (max_plan_buckets); raise bucket_bytes "
                "or check the generators' catalogs"
            )
        if self._fanout:  # relays in member-id order (replica 0 heads), whatever order they registered in
            dests.sort(key=lambda d: d.member_id)
            plan = make_fanout_plan(sources, dests, bucket_bytes=bucket_bytes, fanout=self._fanout)
        else:
            plan = make_plan(sources, dests, bucket_bytes=bucket_bytes)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


def _held_bytes(catalog: Catalog) -> int:
    return sum(math.prod(t.shape) * dtype_bytes(t.dtype) for t in catalog.tensors)


def plan_members(plan: Plan) -> tuple[str, ...]:
    return tuple(sorted({b.src for b in plan.buckets} | {b.dst for b in plan.buckets}))


def stage_membership(plan: Plan) -> dict[int, tuple[str, ...]]:
    """Per PP stage, the group members in rank order: the stage's senders, then its receivers.
    Senders first makes a trainer the group's rank 0 (it creates the rendezvous address). Relays
    (fan-out) send over the group of the stage they received from, as receivers of it."""
    senders: dict[int, set[str]] = {}
    receivers: dict[int, set[str]] = {}
    for b in plan.buckets:
        if b.relay is None:
            senders.setdefault(b.stage, set()).add(b.src)
        receivers.setdefault(b.stage, set()).add(b.dst)
    return {s: tuple(sorted(senders[s])) + tuple(sorted(receivers[s])) for s in sorted(senders)}
