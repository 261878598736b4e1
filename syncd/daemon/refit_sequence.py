"""The phases of one refit, in order, on the refit's own thread: prepare (plan and stage groups),
transfer, verify, decide, commit; and the abort that ends it from any state before the decision.

Each phase sends commands through the members' Watch queues and waits for their reports with the
phase's timeout. Anything that goes wrong elsewhere (an error report, a lost lease) calls
`Run.fail`, which wakes the waiting phase; the refit thread then sends Abort to every member and
records ABORTED with the cause. An operator's abort ends the refit itself, at once, whatever the
refit thread is doing (`abort_everywhere`, from the operator's thread).

Transfer reports are checked against the plan (bytes per member, checksums of every unit:
`syncd.daemon.checks`) before the commit decision. The decision is written to the store *before*
any member is told to commit; from then on the refit is COMMITTED, and members that do not
confirm are listed as unconfirmed. Outcomes are recorded through the `Journal`, so no refit waits
for, or dies of, a store that refuses writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from syncd.commands import (
    Abort,
    Command,
    Commit,
    DeltaLinks,
    ExecutePlan,
    MemberReport,
    Phase,
    StageGroup,
    Verify,
)
from syncd.daemon.adapter_refits import AdapterRefits
from syncd.daemon.checks import checksum_mismatch, plan_problem, transfer_report_problem
from syncd.daemon.delta_bases import DeltaBases
from syncd.daemon.digests import Digests, VersionDigest, digest_of
from syncd.daemon.journal import Journal
from syncd.daemon.metrics import Metrics
from syncd.daemon.plan_cache import PlanCache, plan_members
from syncd.daemon.progress_board import ProgressBoard
from syncd.daemon.refit_run import RefitAborted, Run, seconds_left
from syncd.daemon.registry import Member, Registry
from syncd.daemon.settings import Settings
from syncd.daemon.stage_groups import StageGroups, link_transports
from syncd.daemon.store import Store, StoreUnavailable
from syncd.daemon.survivors import stall_timeouts
from syncd.daemon.versions import Versions, WeightSet
from syncd.plan import Plan
from syncd.plan.fanout import received_bytes
from syncd.states import RefitState
from syncd.vocabulary import LinkTransport

log = logging.getLogger(__name__)


class RefitSequence:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        store: Store,
        journal: Journal,
        metrics: Metrics,
        plans: PlanCache,
        versions: Versions,
        digests: Digests,
        *,
        refit_problems: Callable[..., list[str]],
        release: Callable[[Run], None],
        progress: ProgressBoard | None = None,
        adapters: AdapterRefits | None = None,
    ) -> None:
        """`refit_problems`: why a refit could not start now (checked again in PREPARING);
        `release`: frees the one-refit slot once a refit's outcome is recorded; `progress`: where
        each refit's transfer progress is kept (a board of its own when not given); `adapters`:
        what refits of named adapters plan from (`syncd.daemon.adapter_refits`)."""
        self._settings = settings
        self._registry = registry
        self._store = store
        self._journal = journal
        self._metrics = metrics
        self._plans = plans
        self._versions = versions
        self._digests = digests
        self._refit_problems = refit_problems
        self._adapters = adapters
        self._release = release
        self._progress = progress if progress is not None else ProgressBoard(store)
        self._groups = StageGroups(settings.backend, self._send, settings.same_host)
        self._delta_bases = DeltaBases()

    def execute(self, run: Run) -> None:
        """Run `run` to its end, COMMITTED or ABORTED; never raises."""
        try:
            plan, groups = self._prepare(run)
            transferred = self._transfer(run, plan, groups)
            digest = self._verify(run, plan, transferred)
            commit_deadline = self._decide(run, plan, digest)
        except RefitAborted as e:
            self.abort_everywhere(run, str(e))
        except Exception as e:  # a bug must still end the refit and free the slot
            log.exception("refit %s crashed", run.id)
            run.fail(f"internal error in syncd: {e!r}")
            self.abort_everywhere(run, f"internal error in syncd: {e!r}")
        else:
            self._commit(run, plan, commit_deadline)

    def _prepare(self, run: Run) -> tuple[Plan, dict[int, StageGroup]]:
        deadline = run.enter(RefitState.PREPARING, self._settings.prepare_timeout)
        members, plan = self._adapter_plan(run) if run.adapter is not None else self._base_plan(run)
        problem = plan_problem(plan)
        if problem is not None:
            raise RefitAborted(problem)
        run.narrow_to(plan_members(plan), members)
        return plan, self._groups.for_plan(run, plan, members, deadline)

    def _base_plan(self, run: Run) -> tuple[dict[str, Member], Plan]:
        problems = self._refit_problems(excluded=run.excluded)
        if problems:
            raise RefitAborted(f"not ready to refit: {'; '.join(problems)}")
        members = {m.member_id: m for m in self._registry.members() if m.member_id not in run.excluded}
        try:
            plan = self._plans.get(
                list(members.values()), self._registry.catalog, self._settings.bucket_bytes
            )
        except ValueError as e:
            raise RefitAborted(f"cannot plan: {e}") from None
        return members, plan

    def _adapter_plan(self, run: Run) -> tuple[dict[str, Member], Plan]:
        """A named adapter's trainers to the generators' slots (`syncd.daemon.adapter_refits`)."""
        assert run.adapter is not None and self._adapters is not None
        name = run.adapter.name
        problems = self._adapters.problems(name, run.excluded)
        if problems:
            raise RefitAborted(f"cannot refit adapter {name!r}: {'; '.join(problems)}")
        members = {m.member_id: m for m in self._adapters.members(name, run.excluded)}
        try:
            return members, self._adapters.plan(name, run.excluded)
        except ValueError as e:
            raise RefitAborted(f"cannot plan adapter {name!r}: {e}") from None

    def _transfer(self, run: Run, plan: Plan, groups: dict[int, StageGroup]) -> dict[str, MemberReport]:
        run.start_transfer(plan.total_bytes)
        delta = None if run.adapter is not None else self._delta_links(run, plan, groups)
        if delta is not None:
            run.send_deltas_to(tuple(sorted(delta.dsts)))
        deadline = self._enter(run, RefitState.TRANSFERRING, self._settings.transfer_timeout)
        self._progress.start(run.id, plan)
        ids = plan_members(plan)
        stalls = stall_timeouts(plan, self._settings.stall_timeout)
        ipc = self._ipc_links(plan)
        for m in ids:
            mine = tuple(g for g in groups.values() if m in g.members)
            self._send(
                run,
                m,
                ExecutePlan(
                    run.id,
                    run.version,
                    plan.for_member(m),
                    mine,
                    seconds_left(deadline),
                    delta,
                    stalls[m],
                    frozenset(k for k in ipc if m in k[1:]),
                    adapter=run.adapter,
                ),
            )
        reports = run.wait_for(Phase.TRANSFERRED, ids, deadline)
        problem = transfer_report_problem(plan, reports, frozenset(run.delta_generators))
        if problem is not None:
            raise RefitAborted(f"transfer reports disagree with the plan: {problem}")
        run.transferred(
            # A relay's report counts what it forwarded too (its part of the plan): not received.
            received_bytes(plan, {m: r.bytes for m, r in reports.items()}),
            sum(reports[m].delta_elements for m in run.delta_generators),
            sum(reports[m].changed_elements for m in run.delta_generators),
        )
        return reports

    def _ipc_links(self, plan: Plan) -> frozenset[tuple[int, str, str]]:
        """The links of `plan` that go through CUDA IPC (`syncd.plan.transports`)."""
        transports = link_transports(
            plan, self._registry.all_members(), self._settings.backend, self._settings.same_host
        )
        return frozenset(k for k, t in transports.items() if t == LinkTransport.CUDA_IPC)

    def _delta_links(self, run: Run, plan: Plan, groups: dict[int, StageGroup]) -> DeltaLinks | None:
        """None while delta refits are off; else which generators get deltas against the committed
        version (`syncd.daemon.delta_bases`)."""
        if not self._settings.delta_refits:
            return None
        committed = self._versions.committed
        base = committed.version if committed is not None and committed.run_id == run.run_id else None
        members = {m.member_id: m for m in self._registry.members()}
        if not all(m in members for m in plan_members(plan)):
            raise RefitAborted("a member of the plan left before the transfer")
        return self._delta_bases.links(
            plan,
            members,
            groups,
            base,
            self._settings.delta_max_fraction,
            run.full,
            inplace=self._settings.delta_inplace,
        )

    def _verify(
        self, run: Run, plan: Plan, transferred: dict[str, MemberReport]
    ) -> dict[str, dict[str, str]]:
        """Compare every receiver's checksums with its senders'; returns the version's digest
        (`syncd.daemon.digests`)."""
        deadline = self._enter(run, RefitState.VERIFYING, self._settings.verify_timeout)
        ids = plan_members(plan)
        for m in ids:
            self._send(run, m, Verify(run.id, run.version, seconds_left(deadline)))
        verified = run.wait_for(Phase.VERIFIED, ids, deadline)
        checksums = {m: {**transferred[m].checksums, **verified[m].checksums} for m in ids}
        problem = checksum_mismatch(plan, checksums)
        if problem is not None:
            raise RefitAborted(f"verification failed: {problem}")
        return digest_of(plan, checksums)

    def _decide(self, run: Run, plan: Plan, digest: dict[str, dict[str, str]]) -> float:
        """Write the commit decision durably; only then may any member hear of it. Returns the
        commit deadline. The state stays VERIFYING until the members confirmed or the deadline
        passed; the time is kept as the COMMITTING phase."""
        deadline = run.decide(self._settings.commit_timeout)
        decision = run.snapshot(RefitState.COMMITTED, unconfirmed=plan_members(plan))
        weights = WeightSet(run.run_id, run.version)
        adapter = run.adapter.name if run.adapter is not None else None
        meta = None
        if adapter is not None:
            assert self._adapters is not None
            meta = self._adapters.versions.committed_meta(adapter, weights)
        try:
            self._store.decide_commit(decision, meta)
        except StoreUnavailable as e:
            raise RefitAborted(f"could not record the commit decision, so nobody committed: {e}") from None
        if adapter is not None:  # the adapter's version only: the base and other adapters stay
            assert self._adapters is not None
            self._adapters.versions.set_committed(adapter, weights)
            self._metrics.adapter_version.labels(adapter=adapter).set(run.version)
            return deadline
        self._versions.set_committed(WeightSet(run.run_id, run.version))
        self._digests.committed(VersionDigest(run.run_id, run.version, digest))
        self._metrics.committed_version.set(run.version)
        return deadline

    def _commit(self, run: Run, plan: Plan, deadline: float) -> None:
        ids = plan_members(plan)
        adapter = run.adapter.name if run.adapter is not None else ""
        for m in ids:
            commit = Commit(run.id, run.version, seconds_left(deadline), run.run_id, adapter)
            if not self._registry.send(m, commit):
                run.note_unconfirmed(m, f"member {m} is gone")
        unconfirmed = run.wait_confirmations(ids, deadline)
        if adapter:  # members' weight versions are the base's; the adapter's is syncd's record
            self._conclude(run, RefitState.COMMITTED, "; ".join(unconfirmed.values()), tuple(unconfirmed))
            return
        for m in ids:
            if m not in unconfirmed:
                self._registry.set_weight_version(m, run.version)
        if self._settings.delta_refits:
            members = {m.member_id: m for m in self._registry.members()}
            self._delta_bases.forget(unconfirmed)
            self._delta_bases.committed(
                {m: members[m] for m in ids if m not in unconfirmed and m in members}, run.version
            )
        self._conclude(run, RefitState.COMMITTED, "; ".join(unconfirmed.values()), tuple(unconfirmed))

    def _enter(self, run: Run, state: RefitState, timeout: float) -> float:
        deadline = run.enter(state, timeout)
        self._journal.record(run.snapshot())
        log.info("refit %s: %s", run.id, state)
        return deadline

    def _send(self, run: Run, member_id: str, command: Command) -> None:
        if run.concluded:
            raise RefitAborted("the refit already ended")
        if not self._registry.send(member_id, command):
            raise RefitAborted(f"member {member_id} is gone")

    def abort_everywhere(self, run: Run, reason: str) -> None:
        """Idempotent: whoever ends the refit first sends Abort and records it."""
        if run.concluded:
            return
        self._groups.clear()
        self._delta_bases.forget(run.involved)
        log.warning("refit %s aborted: %s", run.id, reason)
        for m in self._registry.all_members():  # an adapter's trainers too
            self._registry.send(m.member_id, Abort(run.id, reason))
        self._conclude(run, RefitState.ABORTED, reason)

    def _conclude(self, run: Run, state: RefitState, error: str, unconfirmed: tuple[str, ...] = ()) -> None:
        """End the refit once: record the outcome (in memory at once, in the store when it accepts
        it), then free the slot."""
        if not run.conclude(state):
            return
        finished_at = time.time()
        record = run.snapshot(error=error, unconfirmed=unconfirmed, finished_at=finished_at)
        # The metrics first: whoever sees the outcome recorded then finds it counted too.
        if state == RefitState.COMMITTED:
            self._metrics.bytes_moved.inc(record.bytes)
            self._metrics.delta_saved_bytes.inc(record.saved_bytes)
            self._metrics.refit_mode.labels(mode=record.mode).inc()
            if record.adapter:
                self._metrics.adapter_bytes.labels(adapter=record.adapter).inc(record.bytes)
            if record.changed_fraction is not None:
                self._metrics.changed_fraction.set(record.changed_fraction)
        self._metrics.refits.labels(outcome=state.lower()).inc()
        self._metrics.refit_duration.observe(finished_at - record.created_at)
        for phase, seconds in record.phases.items():
            self._metrics.phase_duration.labels(phase=phase).observe(seconds)
        self._journal.record(record)
        self._release(run)
        self._progress.concluded(record)  # after: its model may write to the store
        run.mark_recorded()
        log.info("refit %s %s%s", run.id, state, f": {error}" if error else "")
