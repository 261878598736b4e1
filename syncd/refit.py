"""The refit state machine: IDLE -> PREPARING -> TRANSFERRING -> VERIFYING -> COMMITTED, and
ABORTED from any state.

One refit runs at a time, in its own thread, as a straight sequence of phases (`_execute`). Each
phase sends commands through the members' Watch queues and waits for their reports with the
phase's timeout. Anything that goes wrong elsewhere (an error report, a lost lease, an operator
abort) calls `_Run.fail`, which wakes the waiting phase; the refit thread then sends Abort to every
member and records ABORTED with the cause. Members report with `MemberClient.report`.

Stage groups (one communicator per trainer PP stage) outlive a refit: they are reused while their
membership (member ids and sessions) is unchanged, renegotiated when it changes, and dropped after
an abort because members tear their communicators down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from syncd.commands import Abort, Commit, ExecutePlan, JoinGroup, Phase, StageGroup, Verify
from syncd.errors import FailedPrecondition, InvalidArgument, NotFound
from syncd.metrics import Metrics
from syncd.plan import Plan
from syncd.planning import PlanCache, checksum_mismatch, plan_members, stage_membership
from syncd.registry import ROLES, Member, Registry
from syncd.settings import Settings
from syncd.store import RefitRecord, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemberReport:
    member_id: str
    refit_id: str
    phase: str
    ok: bool = True
    error: str = ""
    bytes: int = 0
    checksums: Mapping[str, str] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    address: str = ""


@dataclass(frozen=True)
class Readiness:
    ready: bool
    expected: dict[str, int]
    registered: dict[str, int]
    reason: str


def _left(deadline: float) -> float:
    """Seconds until a phase's monotonic deadline: what a command gives its member to finish."""
    return max(deadline - time.monotonic(), 0.0)


class RefitAborted(Exception):
    """Ends the refit thread's phase sequence; the message is the recorded cause."""


class _Run:
    """The refit in progress. Other threads touch it only through `add` and `fail`."""

    def __init__(self, record: RefitRecord, involved: set[str]) -> None:
        self.record = record
        self.involved = involved
        self.phases: dict[str, float] = {}
        self.bytes = 0
        self.done = threading.Event()
        self._cond = threading.Condition()
        self._reports: dict[tuple[str, str], MemberReport] = {}
        self._abort_reason: str | None = None
        self._phase, self._phase_start = "PREPARING", time.monotonic()

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def version(self) -> int:
        return self.record.weight_version

    def add(self, report: MemberReport) -> None:
        if not report.ok:
            self.fail(f"member {report.member_id} failed {report.phase}: {report.error or 'no cause given'}")
            return
        with self._cond:
            self._reports[(report.phase, report.member_id)] = report
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """First cause wins; later ones are consequences of it."""
        with self._cond:
            if self._abort_reason is None:
                self._abort_reason = reason
                self._cond.notify_all()

    def enter(self, phase: str, timeout: float) -> float:
        """Close the current phase's timing, start `phase`; returns its deadline."""
        self.close_phase()
        self._phase, self._phase_start = phase, time.monotonic()
        return self._phase_start + timeout

    def close_phase(self) -> None:
        self.phases[self._phase] = round(time.monotonic() - self._phase_start, 6)

    def wait_for(self, phase: str, members: tuple[str, ...], deadline: float) -> dict[str, MemberReport]:
        """Block until every member reported `phase`; consume and return those reports."""
        with self._cond:
            while True:
                if self._abort_reason is not None:
                    raise RefitAborted(self._abort_reason)
                missing = [m for m in members if (phase, m) not in self._reports]
                if not missing:
                    return {m: self._reports.pop((phase, m)) for m in members}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RefitAborted(
                        f"timeout in {self._phase}: no {phase} report from {', '.join(missing)}"
                    )
                self._cond.wait(remaining)


class Coordinator:
    def __init__(self, settings: Settings, registry: Registry, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.registry = registry
        self.store = store
        self.metrics = metrics
        self.plans = PlanCache()
        self._lock = threading.Lock()
        self._run: _Run | None = None
        self._groups: dict[int, tuple[tuple, StageGroup]] = {}
        self._auto_pending = False
        self.committed_version = store.get_int("committed_version")
        self.announced_version = store.get_int("announced_version")
        if self.committed_version is not None:
            metrics.committed_version.set(self.committed_version)
        registry.on_lost(self._on_member_lost)

    # ---- queries ----

    def readiness(self) -> Readiness:
        counts = Counter(m.role for m in self.registry.members())
        expected = {"trainer": self.settings.expected_trainers,
                    "generator": self.settings.expected_generators}
        missing = [f"{counts[r]} of {expected[r]} {r}s registered" for r in ROLES if counts[r] < expected[r]]
        return Readiness(not missing, expected, {r: counts[r] for r in ROLES}, "; ".join(missing))

    def current(self) -> RefitRecord | None:
        with self._lock:
            run = self._run
        return None if run is None else self.store.get(run.id)

    def get(self, refit_id: str) -> RefitRecord:
        record = self.store.get(refit_id)
        if record is None:
            raise NotFound(f"no refit {refit_id!r}")
        return record

    def current_plan(self) -> Plan:
        try:
            return self.plans.get(self.registry.members(), self.registry.catalog, self.settings.bucket_bytes)
        except ValueError as e:
            raise FailedPrecondition(f"cannot plan for the registered members: {e}") from None

    # ---- commands from operators and members ----

    def trigger(self, weight_version: int | None = None) -> RefitRecord:
        """Start a refit; raises FailedPrecondition (changing nothing) if one runs or not ready."""
        with self._lock:
            if self._run is not None:
                raise FailedPrecondition(
                    f"refit {self._run.id} is still running; one refit at a time: wait for it or abort it"
                )
            version = self.announced_version if weight_version is None else weight_version
            if version is None:
                raise FailedPrecondition(
                    "no weight version to move: no trainer announced one and none was given"
                )
            readiness = self.readiness()
            if not readiness.ready:
                raise FailedPrecondition(f"not ready to refit: {readiness.reason}")
            record = RefitRecord(self.store.new_refit_id(), "PREPARING", version, time.time())
            self.store.save(record)
            run = self._run = _Run(record, {m.member_id for m in self.registry.members()})
        log.info("refit %s: moving weight version %d", run.id, version)
        threading.Thread(target=self._execute, args=(run,), name=run.id, daemon=True).start()
        return record

    def abort(self, refit_id: str, reason: str = "aborted by operator") -> RefitRecord:
        with self._lock:
            run = self._run
        if run is None or run.id != refit_id:
            record = self.get(refit_id)
            raise FailedPrecondition(f"refit {refit_id} already finished as {record.state}")
        run.fail(reason)
        run.done.wait(timeout=30)
        return self.get(refit_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort the running refit (members get Abort while their sessions still exist)."""
        with self._lock:
            run = self._run
        if run is not None:
            run.fail("syncd is shutting down")
            run.done.wait(timeout)

    def report(self, report: MemberReport) -> None:
        with self._lock:
            run = self._run
        if run is None or run.id != report.refit_id:
            log.info("ignoring %s report from %s for refit %s (not running)",
                     report.phase, report.member_id, report.refit_id)
            return
        run.add(report)

    def announce(self, member: Member, version: int) -> None:
        if member.role != "trainer":
            raise InvalidArgument(
                f"only trainers announce weight versions; {member.member_id} is a {member.role}"
            )
        with self._lock:
            if self.announced_version is None or version > self.announced_version:
                self.announced_version = version
                self.store.set_int("announced_version", version)
        log.info("%s announced weight version %d", member.member_id, version)
        if self.settings.auto_refit and (self.committed_version is None or version > self.committed_version):
            self._auto_trigger()

    def _auto_trigger(self) -> None:
        try:
            self.trigger()
        except FailedPrecondition as e:
            log.info("auto-refit deferred: %s", e)
            self._auto_pending = True

    def _on_member_lost(self, member: Member, reason: str) -> None:
        with self._lock:
            run = self._run
        if run is not None and member.member_id in run.involved:
            run.fail(f"member {member.member_id} lost mid-refit: {reason}")

    # ---- the refit thread ----

    def _execute(self, run: _Run) -> None:
        try:
            plan, groups = self._prepare(run)
            transferred = self._transfer(run, plan, groups)
            self._verify(run, plan, transferred)
            self._commit(run, plan)
            self._finish(run, "COMMITTED", "")
        except RefitAborted as e:
            self._abort_everywhere(run, str(e))
        except Exception as e:  # a bug must still end the refit and free the slot
            log.exception("refit %s crashed", run.id)
            self._abort_everywhere(run, f"internal error in syncd: {e!r}")
        if self._auto_pending:
            self._auto_pending = False
            if self.announced_version is not None and self.announced_version != self.committed_version:
                self._auto_trigger()

    def _prepare(self, run: _Run) -> tuple[Plan, dict[int, StageGroup]]:
        deadline = run.enter("PREPARING", self.settings.prepare_timeout)
        readiness = self.readiness()
        if not readiness.ready:
            raise RefitAborted(f"members missing: {readiness.reason}")
        members = {m.member_id: m for m in self.registry.members()}
        try:
            plan = self.plans.get(list(members.values()), self.registry.catalog, self.settings.bucket_bytes)
        except ValueError as e:
            raise RefitAborted(f"cannot plan: {e}") from None
        run.involved = set(plan_members(plan))
        groups: dict[int, StageGroup] = {}
        for stage, ids in stage_membership(plan).items():
            key = tuple((i, members[i].session_id) for i in ids)
            cached = self._groups.get(stage)
            if cached is not None and cached[0] == key:
                groups[stage] = cached[1]
                continue
            self._groups.pop(stage, None)
            group = StageGroup(stage, f"{run.id}/stage{stage}", self._backend([members[i] for i in ids]), ids)
            self._negotiate(run, group, deadline)
            self._groups[stage] = (key, group)
            groups[stage] = group
        return plan, groups

    def _backend(self, members: list[Member]) -> str:
        if self.settings.backend != "auto":
            return self.settings.backend
        return "nccl" if all(m.device.startswith("cuda") for m in members) else "gloo"

    def _negotiate(self, run: _Run, group: StageGroup, deadline: float) -> None:
        """Rank 0 creates the address and reports it before blocking in init; syncd relays it.
        Groups are negotiated one after another: a generator in several groups then never waits
        in one group's init while its peers wait in another's."""
        def join(rank: int, address: str) -> JoinGroup:
            return JoinGroup(run.id, group.group_id, group.stage, rank, len(group.members), group.backend,
                             address, group.members, _left(deadline))

        root = group.members[0]
        self._send(run, root, join(0, ""))
        address = run.wait_for(Phase.GROUP_ADDRESS, (root,), deadline)[root].address
        if not address:
            raise RefitAborted(f"{root} reported an empty address for group {group.group_id}")
        for rank, member_id in enumerate(group.members[1:], start=1):
            self._send(run, member_id, join(rank, address))
        run.wait_for(Phase.JOINED, group.members, deadline)
        log.info("group %s joined: %s (%s)", group.group_id, ", ".join(group.members), group.backend)

    def _transfer(self, run: _Run, plan: Plan, groups: dict[int, StageGroup]) -> dict[str, MemberReport]:
        deadline = self._enter(run, "TRANSFERRING", self.settings.transfer_timeout)
        ids = plan_members(plan)
        for m in ids:
            mine = tuple(g for g in groups.values() if m in g.members)
            self._send(run, m, ExecutePlan(run.id, run.version, plan.for_member(m), mine, _left(deadline)))
        reports = run.wait_for(Phase.TRANSFERRED, ids, deadline)
        run.bytes = sum(reports[m].bytes for m in {b.dst for b in plan.buckets})
        return reports

    def _verify(self, run: _Run, plan: Plan, transferred: dict[str, MemberReport]) -> None:
        deadline = self._enter(run, "VERIFYING", self.settings.verify_timeout)
        ids = plan_members(plan)
        for m in ids:
            self._send(run, m, Verify(run.id, run.version, _left(deadline)))
        verified = run.wait_for(Phase.VERIFIED, ids, deadline)
        checksums = {m: {**transferred[m].checksums, **verified[m].checksums} for m in ids}
        problem = checksum_mismatch(plan, checksums)
        if problem is not None:
            raise RefitAborted(f"verification failed: {problem}")

    def _commit(self, run: _Run, plan: Plan) -> None:
        # State stays VERIFYING until every member committed; the timing is kept as COMMITTING.
        deadline = run.enter("COMMITTING", self.settings.commit_timeout)
        ids = plan_members(plan)
        for m in ids:
            self._send(run, m, Commit(run.id, run.version, _left(deadline)))
        run.wait_for(Phase.COMMITTED, ids, deadline)

    def _enter(self, run: _Run, state: str, timeout: float) -> float:
        deadline = run.enter(state, timeout)
        self.store.save(self._record(run, state, ""))
        log.info("refit %s: %s", run.id, state)
        return deadline

    def _send(self, run: _Run, member_id: str, command: object) -> None:
        if not self.registry.send(member_id, command):  # type: ignore[arg-type]
            raise RefitAborted(f"member {member_id} is gone")

    def _abort_everywhere(self, run: _Run, reason: str) -> None:
        log.warning("refit %s aborted: %s", run.id, reason)
        self._groups.clear()
        for m in self.registry.members():
            self.registry.send(m.member_id, Abort(run.id, reason))
        self._finish(run, "ABORTED", reason)

    def _record(self, run: _Run, state: str, error: str, finished: float | None = None) -> RefitRecord:
        return RefitRecord(run.id, state, run.version, run.record.created_at, finished, error,
                           dict(run.phases), run.bytes)

    def _finish(self, run: _Run, state: str, error: str) -> None:
        run.close_phase()
        record = self._record(run, state, error, time.time())
        self.store.save(record)
        if state == "COMMITTED":
            self.store.set_int("committed_version", run.version)
            self.committed_version = run.version
            self.metrics.committed_version.set(run.version)
            self.metrics.bytes_moved.inc(run.bytes)
        self.metrics.refits.labels(outcome=state.lower()).inc()
        self.metrics.refit_duration.observe(record.finished_at - record.created_at)  # type: ignore[operator]
        for phase, seconds in run.phases.items():
            self.metrics.phase_duration.labels(phase=phase).observe(seconds)
        with self._lock:
            self._run = None
        run.done.set()
        log.info("refit %s %s%s", run.id, state, f": {error}" if error else "")
