"""Admission and queries: the slot of the one refit that may run at a time (`RefitSlot`), what
may be admitted (a generator at registration, a refit at a trigger), and what syncd answers
about refits, plans and readiness.

A trigger reserves the slot while it checks and records the new refit, so two triggers never
both start one; the refit's sequence frees the slot once the refit's outcome is recorded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from syncd.daemon.adapter_refits import AdapterRefits, check_sender
from syncd.daemon.checks import dtype_mismatch, refit_problems
from syncd.daemon.errors import FailedPrecondition, NotFound, Unavailable
from syncd.daemon.fleet import Fleet
from syncd.daemon.journal import Journal
from syncd.daemon.plan_cache import PlanCache
from syncd.daemon.readiness import Readiness, behind, behind_reason
from syncd.daemon.refit_run import Run
from syncd.daemon.registry import ROLES, Member, Registry
from syncd.daemon.settings import Settings
from syncd.daemon.store import RefitRecord, Store, StoreUnavailable
from syncd.daemon.versions import Versions, WeightSet
from syncd.layout import Catalog
from syncd.layout.adapters import AdapterSpec
from syncd.plan import Plan
from syncd.states import RefitState
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion

log = logging.getLogger(__name__)

T = TypeVar("T")


class RefitSlot:
    """Holds the running refit, if any: one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run: Run | None = None
        self._starting = False  # a trigger is creating its record (outside the lock)

    def running(self) -> Run | None:
        with self._lock:
            return self._run

    def reserve(self, check: Callable[[], T]) -> T:
        """Reserve the slot if it is free and `check` (run under the slot's lock) raises nothing;
        returns what `check` returned. Raises FailedPrecondition, changing nothing, if busy."""
        with self._lock:
            if self._run is not None or self._starting:
                busy = self._run.id if self._run is not None else "a refit"
                raise FailedPrecondition(
                    f"refit {busy} is still running; one refit at a time: wait for it or abort it"
                )
            result = check()
            self._starting = True
            return result

    def fill(self, run: Run | None) -> None:
        """End a reservation: `run` now holds the slot, or (None) the trigger failed."""
        with self._lock:
            self._starting = False
            self._run = run

    def release(self, run: Run) -> None:
        """`run` ended and its outcome is recorded: another refit may start."""
        with self._lock:
            if self._run is run:
                self._run = None


class Admission:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        store: Store,
        journal: Journal,
        plans: PlanCache,
        versions: Versions,
        slot: RefitSlot,
        adapters: AdapterRefits | None = None,
    ) -> None:
        self._settings = settings
        self._adapters = adapters
        self._registry = registry
        self._store = store
        self._journal = journal
        self._plans = plans
        self._versions = versions
        self._slot = slot
        self.fleet = Fleet(settings.expected_generators, settings.min_replicas_per_layout)

    def admit(self, role: Role, member_id: str, catalog: Catalog, adapter: AdapterSpec | None = None) -> None:
        """Refuse, at registration, a generator that could never receive the trainers' weights, and
        an adapter's trainer whose catalog is not that adapter's factors."""
        if adapter is not None:
            check_sender(member_id, adapter, catalog)
            return
        if role != Role.GENERATOR:
            return
        trainers = [
            self._registry.catalog(m.catalog_hash) for m in self._registry.members() if m.role == Role.TRAINER
        ]
        problem = dtype_mismatch(member_id, catalog, trainers)
        if problem is not None:
            raise FailedPrecondition(problem)

    def start(
        self,
        weight_version: WeightVersion | None,
        allow_rollback: bool,
        full: bool,
        excluded: frozenset[str] = frozenset(),
        *,
        catch_up: bool = False,
    ) -> Run:
        """Check and record a new refit and give it the slot; the caller runs it. Raises
        FailedPrecondition (changing nothing) if one runs, the version is not held or a refit
        could not start now, Unavailable if the store refuses to record it. `excluded`: a retry
        over survivors leaves these members out (`syncd.daemon.survivors`); `catch_up`: a refit
        of the committed version goes to the replicas behind it only (`up_to_date`)."""

        def may_start() -> tuple[WeightSet, tuple[str, ...], frozenset[str], frozenset[str]]:
            members = self._registry.members()
            problems = self.refit_problems(members, excluded=excluded)
            if problems:
                raise FailedPrecondition(f"not ready to refit: {'; '.join(problems)}")
            fleet = self.fleet.saw(members)  # without the missing replicas, if any (`fleet`)
            left_out = excluded or frozenset(fleet.left_out)
            weights = self._versions.to_move(weight_version, allow_rollback)
            serving = up_to_date(members, weights) if catch_up and weights == self._versions.committed else ()
            return weights, fleet.missing, left_out, frozenset(serving)

        weights, missing, left_out, serving = self._slot.reserve(may_start)
        run: Run | None = None
        try:
            record = self._store.create(RefitState.PREPARING, weights.version, weights.run_id, time.time())
            involved = {m.member_id for m in self._registry.members()}
            run = Run(
                record, involved, full, left_out, missing=missing, retry=bool(excluded), serving=serving
            )
        except StoreUnavailable as e:
            raise Unavailable(f"cannot record a new refit: {e}") from None
        finally:
            self._slot.fill(run)
        log.info("refit %s: moving weight version %s", run.id, weights.label)
        return run

    def start_adapter(self, name: str, weight_version: WeightVersion | None) -> Run:
        """Check and record a refit of adapter `name` (`syncd.daemon.adapter_refits`) and give it
        the slot, as `start` does for the base weights; raises FailedPrecondition naming why not."""
        adapters = self._adapters
        if adapters is None:
            raise FailedPrecondition("this syncd runs without adapter refits")

        def may_start() -> tuple[WeightSet, AdapterSpec, set[str]]:
            spec = adapters.spec(name)
            problems = adapters.problems(name)
            if problems:
                raise FailedPrecondition(f"cannot refit adapter {name!r}: {'; '.join(problems)}")
            weights = adapters.versions.to_move(name, weight_version)
            return weights, spec, {m.member_id for m in adapters.members(name)}

        weights, spec, involved = self._slot.reserve(may_start)
        run: Run | None = None
        try:
            record = self._store.create(
                RefitState.PREPARING, weights.version, weights.run_id, time.time(), adapter=name
            )
            run = Run(record, involved, full=True, adapter=spec)
        except StoreUnavailable as e:
            raise Unavailable(f"cannot record a new refit: {e}") from None
        finally:
            self._slot.fill(run)
        log.info("refit %s: moving version %s of adapter %r", run.id, weights.label, name)
        return run

    # ---- queries ----

    def refit_problems(
        self, members: list[Member] | None = None, excluded: frozenset[str] = frozenset()
    ) -> list[str]:
        """Why a refit could not start now (empty: it could). A retry over survivors (`excluded`
        members left out) needs the trainers and one generator, not every expected generator."""
        members = self._registry.members() if members is None else members
        fleet = self.fleet.saw(members)
        if not excluded and (not fleet.degraded or fleet.problems):
            return refit_problems(
                members, self._expected(), self._versions.run_id, self._registry.catalog, self.current_plan
            ) + list(fleet.problems)
        # Without some generators: a retry over the survivors, or a refit over the replicas there
        # while every layout keeps enough of them (`fleet`).
        excluded = excluded or frozenset(fleet.left_out)
        live = [m for m in members if m.member_id not in excluded]
        expected: dict[Role, int] = {Role.TRAINER: self._settings.expected_trainers, Role.GENERATOR: 1}
        return refit_problems(
            live, expected, self._versions.run_id, self._registry.catalog, lambda: self.plan_for(live)
        )

    def readiness(self) -> Readiness:
        """For /readyz: a refit could start and every generator serves the committed version."""
        members = self._registry.members()
        problems = self.refit_problems(members)
        committed = self._versions.committed
        lagging = behind(members, committed)
        if committed is not None and lagging:
            problems.append(behind_reason(lagging, committed))
        counts = Counter(m.role for m in members)
        fleet = self.fleet.saw(members)
        # Refits go on without missing replicas: ready, and the reason says what is missing.
        reason = "; ".join(problems) if problems else fleet.reason()
        return Readiness(not problems, self._expected(), {r: counts[r] for r in ROLES}, reason, fleet.missing)

    def _expected(self) -> dict[Role, int]:
        return {
            Role.TRAINER: self._settings.expected_trainers,
            Role.GENERATOR: self._settings.expected_generators,
        }

    def current_plan(self) -> Plan:
        members = self._registry.members()
        left_out = set(self.fleet.saw(members).left_out)  # workers of a replica missing another
        return self.plan_for([m for m in members if m.member_id not in left_out])

    def plan_for(self, members: list[Member]) -> Plan:
        try:
            return self._plans.get(members, self._registry.catalog, self._settings.bucket_bytes)
        except ValueError as e:
            raise FailedPrecondition(f"cannot plan for the registered members: {e}") from None

    def current(self) -> RefitRecord | None:
        run = self._slot.running()
        return None if run is None else run.snapshot()

    def get(self, refit_id: str) -> RefitRecord:
        run = self._slot.running()
        if run is not None and run.id == refit_id:
            return run.snapshot()
        record = self._journal.get(refit_id)
        if record is None:
            raise NotFound(f"no refit {refit_id!r}")
        return record

    def history(self, limit: int) -> list[RefitRecord]:
        run = self._slot.running()
        records = self._journal.history(limit)
        if run is None:
            return records
        return [run.snapshot() if r.id == run.id else r for r in records]


def up_to_date(members: list[Member], committed: WeightSet) -> list[str]:
    """The generator workers a catch-up of `committed` need not reach: those of replicas whose every
    worker serves it (a replica takes a version whole, all its workers at once)."""
    replicas: dict[int, list[Member]] = {}
    for m in members:
        if m.role == Role.GENERATOR:
            replicas.setdefault(int(m.coords.get("replica", 0)), []).append(m)
    return [
        m.member_id
        for workers in replicas.values()
        if all(w.weight_version == committed.version for w in workers)
        for m in workers
    ]
