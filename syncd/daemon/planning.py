"""Plans for the current membership, cached by topology and catalog hashes, and the checksum
comparison that VERIFYING runs on a plan. Pure functions plus a small cache: no I/O."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from syncd.commands import checksum_key
from syncd.daemon.registry import Member
from syncd.layout import Catalog, dtype_bytes, dtypes
from syncd.plan import DestMember, Plan, SourceMember, fp8_blocks, make_plan
from syncd.vocabulary import Role

PlanKey = tuple


def plan_key(members: Sequence[Member], bucket_bytes: int) -> PlanKey:
    """Everything a plan depends on: who sits where with which catalog, and the bucket size."""
    return (
        bucket_bytes,
        tuple(sorted((m.role, m.member_id, m.stage, m.catalog_hash, m.receive_by_layer) for m in members)),
    )


class PlanCache:
    def __init__(self, size: int = 4, max_buckets: int = 1_000_000) -> None:
        self._size = size
        self._max_buckets = max_buckets
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
        plan = make_plan(sources, dests, bucket_bytes=bucket_bytes)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


def dtype_mismatch(generator_id: str, generator: Catalog, trainers: Sequence[Catalog]) -> str | None:
    """Why `generator` cannot receive what the trainers send, dtype-wise, or None. Senders convert
    while packing where `dtypes.conversion` allows it (float32 -> bfloat16, say); any other pair is
    refused here, at registration, rather than when a refit runs. Blockwise-FP8 weights come from
    the sender's quantizer (`syncd.plan.fp8_blocks`); the planner checks their blocks."""
    sent = {c.name: c.dtype for catalog in trainers for c in catalog.canonical}
    for c in generator.canonical:
        want = sent.get(c.name)
        if want is None or fp8_blocks.quantizes(c.name, want, c.dtype):
            continue
        try:
            dtypes.conversion(want, c.dtype, tensor=c.name)
        except ValueError as e:
            return (
                f"{generator_id} holds {c.name} as {c.dtype} but the trainers send {want} ({e}): "
                f"start the generator with --dtype {want}"
            )
    return None


def _held_bytes(catalog: Catalog) -> int:
    return sum(math.prod(t.shape) * dtype_bytes(t.dtype) for t in catalog.tensors)


def plan_members(plan: Plan) -> tuple[str, ...]:
    return tuple(sorted({b.src for b in plan.buckets} | {b.dst for b in plan.buckets}))


def stage_membership(plan: Plan) -> dict[int, tuple[str, ...]]:
    """Per PP stage, the group members in rank order: the stage's senders, then its receivers.
    Senders first makes a trainer the group's rank 0 (it creates the rendezvous address)."""
    senders: dict[int, set[str]] = {}
    receivers: dict[int, set[str]] = {}
    for b in plan.buckets:
        senders.setdefault(b.stage, set()).add(b.src)
        receivers.setdefault(b.stage, set()).add(b.dst)
    return {s: tuple(sorted(senders[s])) + tuple(sorted(receivers[s])) for s in sorted(senders)}


def checksum_mismatch(plan: Plan, checksums: Mapping[str, Mapping[str, str]]) -> str | None:
    """Compare, unit by unit, what each receiver reported with what its sender reported.
    `checksums[member][key]`. Returns an error naming the first bad tensor region, or None."""
    problems = []
    for b in plan.buckets:
        sent, got = checksums.get(b.src, {}), checksums.get(b.dst, {})
        for u in b.units:
            key = checksum_key(u.canonical, u.canon)
            if key not in sent:
                problems.append(f"sender {b.src} reported no checksum for {key} (tensor {u.canonical})")
            elif key not in got:
                problems.append(f"receiver {b.dst} reported no checksum for {key} (tensor {u.canonical})")
            elif sent[key] != got[key]:
                problems.append(
                    f"checksum mismatch for tensor {u.canonical} region {u.canon}: sender {b.src} "
                    f"{sent[key]}, receiver {b.dst} {got[key]}"
                )
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
