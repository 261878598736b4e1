"""Refits of named LoRA adapters into the generators' adapter slots (`syncd.layout.adapters`).

An adapter is a track of its own beside the base weights: its trainers (members registered with
an `AdapterSpec`) never take part in base refits, and its versions belong to the adapter, one
training run at a time as the base's do (`syncd.daemon.versions`): a new run of the adapter's
trainers supersedes its old one, announced versions only grow within a run, a refit moves the
newest one. A refit of adapter `a` moves only `a`'s factors, from its trainers to every generator
(each must take adapters into slots), through the same phases, checksums and commit decision as
a base refit (`syncd.daemon.refit_sequence`); committing it sets `a`'s committed version and
nothing else: the base version and every other adapter stay as they are.

What refuses a refit of `a`, by name (`AdapterRefits.problems`): no trainer of `a` registered;
its trainers disagree on its spec; a generator without slots (its engine runs without LoRA); a
generator whose slots take smaller ranks than `a`'s, or are all held by other adapters.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from syncd.daemon.errors import FailedPrecondition
from syncd.daemon.plan_cache import PlanCache
from syncd.daemon.registry import Member, Registry
from syncd.daemon.store import Store, StoreUnavailable
from syncd.daemon.versions import WeightSet
from syncd.layout import Catalog
from syncd.layout.adapters import AdapterSpec, adapter_rank, slot_catalog
from syncd.plan import Plan
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion

log = logging.getLogger(__name__)

META_KEY = "adapters"  # the store's meta row holding every adapter's versions (JSON)


@dataclass(frozen=True)
class AdapterState:
    """One adapter's versions: its trainers' current run, their newest announced version, and
    the version the generators' slots hold (with the run it belongs to)."""

    run_id: str = ""
    announced: WeightVersion | None = None
    committed: WeightSet | None = None


class AdapterVersions:
    """Every adapter's `AdapterState`, kept in memory and in the store's meta row `adapters`."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._states = _states_from_json(store.get_text(META_KEY))

    def get(self, name: str) -> AdapterState:
        with self._lock:
            return self._states.get(name, AdapterState())

    def all(self) -> dict[str, AdapterState]:
        with self._lock:
            return dict(self._states)

    def registered(self, member: Member) -> None:
        """A trainer of an adapter registered: a new run supersedes the adapter's current one; the
        version the trainer holds becomes the announced one."""
        assert member.adapter is not None
        name = member.adapter.name
        with self._lock:
            state = self._states.get(name, AdapterState())
            if member.run_id != state.run_id:
                state = replace(state, run_id=member.run_id, announced=None)
            if member.weight_version is not None:
                state = replace(state, announced=member.weight_version)
            self._put(name, state)

    def announce(self, member: Member, version: WeightVersion) -> bool:
        """Record `version` of the member's adapter run; True if it is the newest."""
        assert member.adapter is not None
        name = member.adapter.name
        with self._lock:
            state = self._states.get(name, AdapterState())
            if member.run_id != state.run_id:
                raise FailedPrecondition(
                    f"{member.member_id} belongs to run {member.run_id!r} of adapter {name!r}, "
                    f"superseded by run {state.run_id!r}; its versions cannot be moved"
                )
            if state.announced is not None and version <= state.announced:
                return False
            self._put(name, replace(state, announced=version))
        log.info("%s announced version %d of adapter %r", member.member_id, version, name)
        return True

    def to_move(self, name: str, requested: WeightVersion | None) -> WeightSet:
        """The adapter's weights a refit may move; raises FailedPrecondition naming why not."""
        state = self.get(name)
        if state.announced is None:
            raise FailedPrecondition(f"adapter {name!r}: its trainers announced no version to move")
        if requested is not None and requested != state.announced:
            raise FailedPrecondition(
                f"adapter {name!r}: version {requested} is not held by its trainers; they announced "
                f"{state.announced} as their newest, and trainers hold only their newest"
            )
        return WeightSet(state.run_id, state.announced)

    def wants_refit(self, name: str) -> bool:
        s = self.get(name)
        if s.announced is None:
            return False
        return s.committed is None or s.committed.run_id != s.run_id or s.announced > s.committed.version

    def committed_meta(self, name: str, weights: WeightSet) -> dict[str, str]:
        """The store's meta row as it is once `weights` of `name` are committed (written with the
        commit decision, `Store.decide_commit`)."""
        with self._lock:
            states = {
                **self._states,
                name: replace(self._states.get(name, AdapterState()), committed=weights),
            }
        return {META_KEY: _states_to_json(states)}

    def set_committed(self, name: str, weights: WeightSet) -> None:
        """After the commit decision reached the store (which wrote it with the decision)."""
        with self._lock:
            self._states[name] = replace(self._states.get(name, AdapterState()), committed=weights)

    def _put(self, name: str, state: AdapterState) -> None:
        """Under the lock: keep `state` and persist every adapter's."""
        self._states[name] = state
        try:
            self._store.set_meta({META_KEY: _states_to_json(self._states)})
        except StoreUnavailable as e:
            log.warning("adapter versions kept in memory only (%s): %s", name, e)


class AdapterRefits:
    """What a refit of a named adapter needs from the registry: its members, its problems, its plan."""

    def __init__(self, registry: Registry, plans: PlanCache, bucket_bytes: int, versions: AdapterVersions):
        self._registry = registry
        self._plans = plans
        self._bucket_bytes = bucket_bytes
        self.versions = versions

    def spec(self, name: str) -> AdapterSpec:
        """The spec its trainers registered; FailedPrecondition naming the known adapters if none did."""
        senders = self._registry.adapter_senders(name)
        if not senders:
            known = sorted({m.adapter.name for m in self._registry.adapter_senders() if m.adapter})
            raise FailedPrecondition(
                f"no trainer of adapter {name!r} is registered (adapters registered: "
                f"{', '.join(known) or 'none'})"
            )
        assert senders[0].adapter is not None
        return senders[0].adapter

    def problems(self, name: str, excluded: frozenset[str] = frozenset()) -> list[str]:
        """Why a refit of adapter `name` could not start now (empty: it could)."""
        try:
            spec = self.spec(name)
        except FailedPrecondition as e:
            return [str(e)]
        senders = self._registry.adapter_senders(name)
        problems = [
            f"trainers of adapter {name!r} disagree on its spec: {m.member_id} has {m.adapter}, "
            f"{senders[0].member_id} {spec}"
            for m in senders
            if m.adapter != spec
        ]
        generators = [m for m in self._registry.members() if m.role == Role.GENERATOR]
        if not generators:
            problems.append("no generator is registered")
        held = {n for n, s in self.versions.all().items() if s.committed is not None} - {name}
        for g in generators:
            if g.member_id in excluded:
                continue
            problems += _slot_problems(g, spec, held)
        if not problems:
            try:
                self.plan(name, excluded)
            except ValueError as e:
                problems.append(f"cannot plan adapter {name!r}: {e}")
        return problems

    def members(self, name: str, excluded: frozenset[str] = frozenset()) -> list[Member]:
        """The adapter's trainers and every generator (slots or not: `problems` refuses those
        without), as the plan sees them."""
        live = [m for m in self._registry.all_members() if m.member_id not in excluded]
        senders = [m for m in live if m.adapter is not None and m.adapter.name == name]
        return senders + [m for m in live if m.role == Role.GENERATOR]

    def plan(self, name: str, excluded: frozenset[str] = frozenset()) -> Plan:
        """From the adapter's trainers to every generator's slot catalog (`slot_catalog`); raises
        ValueError (from the planner or the catalogs) naming what is wrong."""
        members = self.members(name, excluded)
        senders = [m for m in members if m.role == Role.TRAINER]
        if not senders:
            raise ValueError(f"no trainer of adapter {name!r} is registered")
        sender_catalog = self._registry.catalog(senders[0].catalog_hash)
        slot_catalogs: dict[str, Catalog] = {}
        planned: list[Member] = list(senders)
        for g in members:
            if g.role == Role.GENERATOR and g.lora_slots is not None:
                catalog = slot_catalog(name, sender_catalog, g.lora_slots.dtype)
                slot_catalogs[catalog.content_hash] = catalog
                planned.append(replace(g, catalog_hash=catalog.content_hash, receive_by_layer=False))
        lookup = _with(slot_catalogs, self._registry.catalog)
        return self._plans.get(planned, lookup, self._bucket_bytes)


def check_sender(member_id: str, spec: AdapterSpec, catalog: Catalog) -> None:
    """Refuse, at registration, an adapter trainer whose catalog is not its adapter's factors."""
    try:
        spec.validate()
        rank = adapter_rank(catalog)
    except ValueError as e:
        raise FailedPrecondition(f"adapter trainer {member_id}: {e}") from None
    if rank != spec.rank:
        raise FailedPrecondition(
            f"adapter trainer {member_id}: adapter {spec.name!r} declares rank {spec.rank} but its "
            f"factors have rank {rank}"
        )


def _slot_problems(g: Member, spec: AdapterSpec, held: set[str]) -> list[str]:
    slots = g.lora_slots
    if slots is None:
        return [
            (
                f"generator {g.member_id} takes no adapters into slots (its engine runs without "
                "LoRA, or at a tensor-parallel size above 1: start it with --enable-lora at tp 1)"
            )
        ]
    if spec.rank > slots.max_rank:
        return [
            (
                f"adapter {spec.name!r} has rank {spec.rank}, but generator {g.member_id}'s slots "
                f"take ranks up to {slots.max_rank} (--max-lora-rank)"
            )
        ]
    if len(held) >= slots.max_loras:
        return [
            (
                f"generator {g.member_id} has {slots.max_loras} adapter slots (--max-loras), all "
                f"held by adapters {', '.join(sorted(held))}"
            )
        ]
    return []


def _with(extra: dict[str, Catalog], catalog: Callable[[str], Catalog]) -> Callable[[str], Catalog]:
    return lambda h: extra[h] if h in extra else catalog(h)


def _states_to_json(states: dict[str, AdapterState]) -> str:
    return json.dumps(
        {
            name: {
                "run_id": s.run_id,
                "announced": s.announced,
                "committed_run": s.committed.run_id if s.committed else None,
                "committed": s.committed.version if s.committed else None,
            }
            for name, s in sorted(states.items())
        }
    )


def _states_from_json(text: str | None) -> dict[str, AdapterState]:
    out = {}
    for name, s in json.loads(text or "{}").items():
        committed = None
        if s.get("committed") is not None:
            committed = WeightSet(s.get("committed_run") or "", WeightVersion(s["committed"]))
        announced = WeightVersion(s["announced"]) if s.get("announced") is not None else None
        out[name] = AdapterState(s.get("run_id", ""), announced, committed)
    return out
