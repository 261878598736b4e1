"""The refit state machine: IDLE -> PREPARING -> TRANSFERRING -> VERIFYING -> COMMITTED, and
ABORTED from any state before the commit decision.

One refit runs at a time, in its own thread, as a straight sequence of phases (`_execute`). Each
phase sends commands through the members' Watch queues and waits for their reports with the
phase's timeout. Anything that goes wrong elsewhere (an error report, a lost lease) calls
`Run.fail`, which wakes the waiting phase; the refit thread then sends Abort to every member and
records ABORTED with the cause. An operator's abort ends the refit itself, at once, whatever the
refit thread is doing. Members report with `MemberClient.report`.

Transfer reports are checked against the plan (bytes per member, checksums of every unit) before
the commit decision. The decision is written to the store *before* any member is told to commit;
from then on the refit is COMMITTED, and members that do not confirm are listed as unconfirmed.
Outcomes are recorded through the `Journal`, so no refit waits for, or dies of, a store that
refuses writes.

Stage groups (one communicator per trainer PP stage) outlive a refit: they are reused while their
membership (member ids and sessions) is unchanged, renegotiated when it changes, and dropped after
an abort because members tear their communicators down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from syncd.commands import (
    Abort,
    Commit,
    DeltaLinks,
    ExecutePlan,
    JoinGroup,
    MemberReport,
    Phase,
    StageGroup,
    Verify,
)
from syncd.daemon.delta_bases import DeltaBases
from syncd.daemon.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from syncd.daemon.journal import Journal
from syncd.daemon.metrics import Metrics
from syncd.daemon.planning import PlanCache, checksum_mismatch, dtype_mismatch, plan_members, stage_membership
from syncd.daemon.readiness import Readiness, behind, behind_reason, refit_problems
from syncd.daemon.refit_run import RefitAborted, Run, transfer_report_problem
from syncd.daemon.registry import ROLES, Member, Registry, check_weight_version
from syncd.daemon.settings import Settings
from syncd.daemon.store import RefitRecord, Store, StoreUnavailable
from syncd.daemon.versions import Versions, WeightSet
from syncd.layout import Catalog
from syncd.plan import Plan
from syncd.states import RefitState
from syncd.vocabulary import Backend, Role
from syncd.weight_version import WeightVersion

__all__ = ["Coordinator", "Readiness"]

log = logging.getLogger(__name__)


def _left(deadline: float) -> float:
    """Seconds until a phase's monotonic deadline: what a command gives its member to finish."""
    return max(deadline - time.monotonic(), 0.0)


class Coordinator:
    def __init__(self, settings: Settings, registry: Registry, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.registry = registry
        self.store = store
        self.journal = Journal(store)
        self.metrics = metrics
        self.plans = PlanCache(max_buckets=settings.max_plan_buckets)
        self._lock = threading.Lock()
        self._run: Run | None = None
        self._starting = False  # a trigger is creating its record (outside the lock)
        self._groups: dict[int, tuple[tuple, StageGroup]] = {}
        self._auto_pending = False
        self.versions = Versions(store)
        self.delta_bases = DeltaBases()
        if self.versions.committed is not None:
            metrics.committed_version.set(self.versions.committed.version)
        registry.on_lost(self._on_member_lost)
        registry.on_registered(self._on_registered)

    # ---- queries ----

    def readiness(self) -> Readiness:
        """For /readyz: a refit could start and every generator serves the committed version."""
        members = self.registry.members()
        problems = self._refit_problems(members)
        lagging = behind(members, self.versions.committed)
        if lagging:
            problems.append(behind_reason(lagging, self.versions.committed))  # type: ignore[arg-type]
        counts = Counter(m.role for m in members)
        return Readiness(not problems, self._expected(), {r: counts[r] for r in ROLES}, "; ".join(problems))

    def _expected(self) -> dict[str, int]:
        return {
            Role.TRAINER: self.settings.expected_trainers,
            Role.GENERATOR: self.settings.expected_generators,
        }

    def _refit_problems(self, members: list[Member] | None = None) -> list[str]:
        return refit_problems(
            self.registry.members() if members is None else members,
            self._expected(),
            self.versions.run_id,
            self.registry.catalog,
            self.current_plan,
        )

    def current(self) -> RefitRecord | None:
        with self._lock:
            run = self._run
        return None if run is None else self._record(run, run.state, "")

    def get(self, refit_id: str) -> RefitRecord:
        with self._lock:
            run = self._run
        if run is not None and run.id == refit_id:
            return self._record(run, run.state, "")
        record = self.journal.get(refit_id)
        if record is None:
            raise NotFound(f"no refit {refit_id!r}")
        return record

    def history(self, limit: int) -> list[RefitRecord]:
        with self._lock:
            run = self._run
        records = self.journal.history(limit)
        if run is None:
            return records
        return [self._record(run, run.state, "") if r.id == run.id else r for r in records]

    def admit(self, role: str, member_id: str, catalog: Catalog) -> None:
        """Refuse, at registration, a generator that could never receive the trainers' weights."""
        if role != Role.GENERATOR:
            return
        trainers = [
            self.registry.catalog(m.catalog_hash) for m in self.registry.members() if m.role == Role.TRAINER
        ]
        problem = dtype_mismatch(member_id, catalog, trainers)
        if problem is not None:
            raise FailedPrecondition(problem)

    def current_plan(self) -> Plan:
        try:
            return self.plans.get(self.registry.members(), self.registry.catalog, self.settings.bucket_bytes)
        except ValueError as e:
            raise FailedPrecondition(f"cannot plan for the registered members: {e}") from None

    # ---- commands from operators and members ----

    def trigger(
        self, weight_version: WeightVersion | None = None, allow_rollback: bool = False, full: bool = False
    ) -> RefitRecord:
        """Start a refit of the trainers' newest announced version (`weight_version`, when given,
        must be that one; `full`: no delta links even where delta refits are on); raises
        FailedPrecondition (changing nothing) if one runs, the version is not held or not ready,
        Unavailable if the store refuses to record it."""
        with self._lock:
            if self._run is not None or self._starting:
                busy = self._run.id if self._run is not None else "a refit"
                raise FailedPrecondition(
                    f"refit {busy} is still running; one refit at a time: wait for it or abort it"
                )
            problems = self._refit_problems()
            if problems:
                raise FailedPrecondition(f"not ready to refit: {'; '.join(problems)}")
            weights = self.versions.to_move(weight_version, allow_rollback)
            self._starting = True
        try:
            record = self.store.create(RefitState.PREPARING, weights.version, weights.run_id, time.time())
        except StoreUnavailable as e:
            raise Unavailable(f"cannot record a new refit: {e}") from None
        finally:
            with self._lock:
                self._starting = False
        with self._lock:
            run = self._run = Run(record, {m.member_id for m in self.registry.members()})
            run.full = full
        log.info("refit %s: moving weight version %s", run.id, weights.label)
        threading.Thread(target=self._execute, args=(run,), name=run.id, daemon=True).start()
        return record

    def abort(self, refit_id: str, reason: str = "aborted by operator") -> RefitRecord:
        """Ends the refit here and now (members get Abort) and answers with what it recorded."""
        with self._lock:
            run = self._run
        if run is None or run.id != refit_id:
            record = self.get(refit_id)
            raise FailedPrecondition(f"refit {refit_id} already finished as {record.state}")
        if not run.fail(reason):
            raise FailedPrecondition(
                f"refit {refit_id} is committing (its commit decision is recorded); it cannot be aborted"
            )
        self._abort_everywhere(run, reason)
        return self.get(refit_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort the running refit (members get Abort while their sessions still exist), let a
        committing one finish, and write every record the store has not taken yet."""
        with self._lock:
            run = self._run
        if run is not None:
            if run.fail("syncd is shutting down"):
                self._abort_everywhere(run, "syncd is shutting down")
            run.done.wait(timeout)
        self.journal.close(timeout)

    def report(self, report: MemberReport) -> None:
        with self._lock:
            run = self._run
        if run is None or run.id != report.refit_id:
            log.info(
                "ignoring %s report from %s for refit %s (not running)",
                report.phase,
                report.member_id,
                report.refit_id,
            )
            return
        run.add(report)

    def announce(self, member: Member, version: int) -> None:
        if member.role != Role.TRAINER:
            raise InvalidArgument(
                f"only trainers announce weight versions; {member.member_id} is a {member.role}"
            )
        self.versions.announce(member, check_weight_version(member.member_id, version))
        self._maybe_auto_refit()

    def _on_registered(self, member: Member) -> None:
        if member.role == Role.TRAINER:
            self.versions.trainer_registered(member)
        self._maybe_auto_refit()  # a deferred auto-refit may be possible now

    def _maybe_auto_refit(self) -> None:
        if (self.settings.auto_refit and self.versions.wants_refit()) or self._wants_catch_up():
            self._auto_trigger()

    def _wants_catch_up(self) -> bool:
        """A generator registered behind the committed version and the trainers hold weights to
        bring it up to date: the committed ones, or under auto-refit any newest ones."""
        committed, announced = self.versions.committed, self.versions.announced
        if committed is None or announced is None or not behind(self.registry.members(), committed):
            return False
        return self.settings.auto_refit or announced == committed

    def _auto_trigger(self) -> None:
        try:
            self.trigger()
        except (FailedPrecondition, Unavailable) as e:
            log.info("auto-refit deferred: %s", e)
            self._auto_pending = True

    def _on_member_lost(self, member: Member, reason: str) -> None:
        with self._lock:
            run = self._run
        if run is not None and member.member_id in run.involved:
            cause = f"member {member.member_id} lost mid-refit: {reason}"
            if not run.fail(cause):
                run.note_unconfirmed(member.member_id, cause)

    # ---- the refit thread ----

    def _execute(self, run: Run) -> None:
        try:
            plan, groups = self._prepare(run)
            transferred = self._transfer(run, plan, groups)
            self._verify(run, plan, transferred)
            commit_deadline = self._decide(run, plan)
        except RefitAborted as e:
            self._abort_everywhere(run, str(e))
        except Exception as e:  # a bug must still end the refit and free the slot
            log.exception("refit %s crashed", run.id)
            run.fail(f"internal error in syncd: {e!r}")
            self._abort_everywhere(run, f"internal error in syncd: {e!r}")
        else:
            self._commit(run, plan, commit_deadline)
        if self._auto_pending:
            self._auto_pending = False
            self._maybe_auto_refit()

    def _prepare(self, run: Run) -> tuple[Plan, dict[int, StageGroup]]:
        deadline = run.enter(RefitState.PREPARING, self.settings.prepare_timeout)
        problems = self._refit_problems()
        if problems:
            raise RefitAborted(f"not ready to refit: {'; '.join(problems)}")
        members = {m.member_id: m for m in self.registry.members()}
        try:
            plan = self.plans.get(list(members.values()), self.registry.catalog, self.settings.bucket_bytes)
        except ValueError as e:
            raise RefitAborted(f"cannot plan: {e}") from None
        if not plan.buckets:
            raise RefitAborted("the plan moves no bytes: the registered catalogs hold no tensors to move")
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
        return Backend.NCCL if all(m.device.startswith("cuda") for m in members) else Backend.GLOO

    def _negotiate(self, run: Run, group: StageGroup, deadline: float) -> None:
        """Rank 0 creates the address and reports it before blocking in init; syncd relays it.
        Groups are negotiated one after another: a generator in several groups then never waits
        in one group's init while its peers wait in another's."""

        def join(rank: int, address: str) -> JoinGroup:
            return JoinGroup(
                run.id,
                group.group_id,
                group.stage,
                rank,
                len(group.members),
                group.backend,
                address,
                group.members,
                _left(deadline),
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

    def _transfer(self, run: Run, plan: Plan, groups: dict[int, StageGroup]) -> dict[str, MemberReport]:
        # Recorded with TRANSFERRING, so a refit cut short (syncd killed) still says what it was moving.
        run.planned_bytes = plan.total_bytes
        delta = self._delta_links(run, plan, groups)
        if delta is not None:
            run.delta_generators = tuple(sorted(delta.dsts))
        deadline = self._enter(run, RefitState.TRANSFERRING, self.settings.transfer_timeout)
        ids = plan_members(plan)
        for m in ids:
            mine = tuple(g for g in groups.values() if m in g.members)
            self._send(
                run, m, ExecutePlan(run.id, run.version, plan.for_member(m), mine, _left(deadline), delta)
            )
        reports = run.wait_for(Phase.TRANSFERRED, ids, deadline)
        problem = transfer_report_problem(plan, reports, frozenset(run.delta_generators))
        if problem is not None:
            raise RefitAborted(f"transfer reports disagree with the plan: {problem}")
        run.bytes = sum(reports[m].bytes for m in {b.dst for b in plan.buckets})
        run.delta_elements = sum(reports[m].delta_elements for m in run.delta_generators)
        run.changed_elements = sum(reports[m].changed_elements for m in run.delta_generators)
        return reports

    def _delta_links(self, run: Run, plan: Plan, groups: dict[int, StageGroup]) -> DeltaLinks | None:
        """None while delta refits are off; else which generators get deltas against the committed
        version (`syncd.daemon.delta_bases`)."""
        if not self.settings.delta_refits:
            return None
        committed = self.versions.committed
        base = committed.version if committed is not None and committed.run_id == run.record.run_id else None
        members = {m.member_id: m for m in self.registry.members()}
        if not all(m in members for m in plan_members(plan)):
            raise RefitAborted("a member of the plan left before the transfer")
        return self.delta_bases.links(plan, members, groups, base, self.settings.delta_max_fraction, run.full)

    def _verify(self, run: Run, plan: Plan, transferred: dict[str, MemberReport]) -> None:
        deadline = self._enter(run, RefitState.VERIFYING, self.settings.verify_timeout)
        ids = plan_members(plan)
        for m in ids:
            self._send(run, m, Verify(run.id, run.version, _left(deadline)))
        verified = run.wait_for(Phase.VERIFIED, ids, deadline)
        checksums = {m: {**transferred[m].checksums, **verified[m].checksums} for m in ids}
        problem = checksum_mismatch(plan, checksums)
        if problem is not None:
            raise RefitAborted(f"verification failed: {problem}")

    def _decide(self, run: Run, plan: Plan) -> float:
        """Write the commit decision durably; only then may any member hear of it. Returns the
        commit deadline. The state stays VERIFYING until the members confirmed or the deadline
        passed; the time is kept as the COMMITTING phase."""
        deadline = run.enter(RefitState.COMMITTING, self.settings.commit_timeout)
        run.decide()
        decision = self._record(run, RefitState.COMMITTED, "", unconfirmed=plan_members(plan))
        try:
            self.store.decide_commit(decision)
        except StoreUnavailable as e:
            raise RefitAborted(f"could not record the commit decision, so nobody committed: {e}") from None
        self.versions.set_committed(WeightSet(run.record.run_id, run.version))
        self.metrics.committed_version.set(run.version)
        return deadline

    def _commit(self, run: Run, plan: Plan, deadline: float) -> None:
        ids = plan_members(plan)
        for m in ids:
            if not self.registry.send(m, Commit(run.id, run.version, _left(deadline), run.record.run_id)):
                run.note_unconfirmed(m, f"member {m} is gone")
        unconfirmed = run.wait_confirmations(ids, deadline)
        for m in ids:
            if m not in unconfirmed:
                self.registry.set_weight_version(m, run.version)
        if self.settings.delta_refits:
            members = {m.member_id: m for m in self.registry.members()}
            self.delta_bases.forget(unconfirmed)
            self.delta_bases.committed(
                {m: members[m] for m in ids if m not in unconfirmed and m in members}, run.version
            )
        self._conclude(run, RefitState.COMMITTED, "; ".join(unconfirmed.values()), tuple(unconfirmed))

    def _enter(self, run: Run, state: str, timeout: float) -> float:
        deadline = run.enter(state, timeout)
        run.state = state
        self.journal.record(self._record(run, state, ""))
        log.info("refit %s: %s", run.id, state)
        return deadline

    def _send(self, run: Run, member_id: str, command: object) -> None:
        if run.concluded:
            raise RefitAborted("the refit already ended")
        if not self.registry.send(member_id, command):  # type: ignore[arg-type]
            raise RefitAborted(f"member {member_id} is gone")

    def _abort_everywhere(self, run: Run, reason: str) -> None:
        """Idempotent: whoever ends the refit first sends Abort and records it."""
        with self._lock:
            if run.concluded:
                return
            self._groups.clear()
        self.delta_bases.forget(run.involved)
        log.warning("refit %s aborted: %s", run.id, reason)
        for m in self.registry.members():
            self.registry.send(m.member_id, Abort(run.id, reason))
        self._conclude(run, RefitState.ABORTED, reason)

    def _record(
        self,
        run: Run,
        state: str,
        error: str,
        unconfirmed: tuple[str, ...] = (),
        finished: float | None = None,
    ) -> RefitRecord:
        return RefitRecord(
            run.id,
            state,
            run.version,
            run.record.created_at,
            finished,
            error,
            run.timings() if finished is None else dict(run.phases),
            run.bytes,
            unconfirmed,
            run.record.run_id,
            run.planned_bytes,
            run.delta_generators,
            run.delta_elements,
            run.changed_elements,
        )

    def _conclude(self, run: Run, state: str, error: str, unconfirmed: tuple[str, ...] = ()) -> None:
        """End the refit once: free the slot and record the outcome (in memory at once, in the
        store when it accepts it)."""
        with self._lock:
            if run.concluded:
                return
            run.concluded = True
            run.close_phase()
            run.state = state
            record = self._record(run, state, error, unconfirmed, time.time())
            self.journal.record(record)
            if self._run is run:
                self._run = None
        if state == RefitState.COMMITTED:
            self.metrics.bytes_moved.inc(run.bytes)
            self.metrics.delta_saved_bytes.inc(record.saved_bytes)
            self.metrics.refit_mode.labels(mode=record.mode).inc()
            if record.changed_fraction is not None:
                self.metrics.changed_fraction.set(record.changed_fraction)
        self.metrics.refits.labels(outcome=state.lower()).inc()
        self.metrics.refit_duration.observe(record.finished_at - record.created_at)  # type: ignore[operator]
        for phase, seconds in run.phases.items():
            self.metrics.phase_duration.labels(phase=phase).observe(seconds)
        run.done.set()
        log.info("refit %s %s%s", run.id, state, f": {error}" if error else "")
