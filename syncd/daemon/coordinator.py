"""The refit coordinator: the one object syncd's servers call about refits. A thin facade over
the parts it wires together:

- `admission` (`Admission`, `RefitSlot`): one refit at a time, what may register or start, and
  the answers to queries (current, get, history, readiness, the current plan);
- `refit_sequence` (`RefitSequence`): the phases of one refit on its own thread, and the abort;
- `auto_refit` (`AutoRefit`): refits syncd starts by itself (announcements, catch-up).

The refit state machine: IDLE -> PREPARING -> TRANSFERRING -> VERIFYING -> COMMITTED, and
ABORTED from any state before the commit decision (`refit_sequence` says how). Here only the
events that reach a running refit from outside: members' reports (`MemberClient.report`), lost
leases, an operator's abort, shutdown.
"""

from __future__ import annotations

import logging
import threading
import time

from syncd.commands import MemberReport, ProgressReport
from syncd.daemon.adapter_refits import AdapterRefits, AdapterVersions
from syncd.daemon.admission import Admission, RefitSlot
from syncd.daemon.auto_refit import AutoRefit
from syncd.daemon.digests import Digests
from syncd.daemon.errors import FailedPrecondition, Unavailable
from syncd.daemon.journal import Journal
from syncd.daemon.metrics import Metrics
from syncd.daemon.plan_cache import PlanCache
from syncd.daemon.progress import RefitProgress
from syncd.daemon.progress_board import ProgressBoard
from syncd.daemon.readiness import Readiness
from syncd.daemon.refit_run import Run
from syncd.daemon.refit_sequence import RefitSequence
from syncd.daemon.registry import Member, Registry, check_weight_version
from syncd.daemon.settings import Settings
from syncd.daemon.stage_groups import link_transports
from syncd.daemon.store import RefitRecord, Store
from syncd.daemon.survivors import find_lost, wait_for_lost
from syncd.daemon.version_status import HISTORY_DEPTH, VersionStatus, refit_of, why_not_started
from syncd.daemon.versions import Versions
from syncd.layout import Catalog
from syncd.layout.adapters import AdapterSpec
from syncd.plan import Plan
from syncd.states import RefitState
from syncd.vocabulary import LinkTransport, Role
from syncd.weight_version import WeightVersion

__all__ = ["Coordinator", "Readiness"]

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, settings: Settings, registry: Registry, store: Store, metrics: Metrics) -> None:
        self.versions = Versions(store)
        self.digests = Digests(store)
        self._journal = Journal(store)
        self._slot = RefitSlot()
        plans = PlanCache(max_buckets=settings.max_plan_buckets, fanout=settings.fanout)
        self.progress = ProgressBoard(store)
        self._settings, self._registry = settings, registry
        # Adapter refits plan without fan-out: an adapter is small, and every generator takes it whole.
        adapter_plans = PlanCache(max_buckets=settings.max_plan_buckets)
        self.adapters = AdapterRefits(registry, adapter_plans, settings.bucket_bytes, AdapterVersions(store))
        self._pending_adapters: set[str] = set()  # auto-refits of adapters deferred
        self._admission = Admission(
            settings, registry, store, self._journal, plans, self.versions, self._slot, self.adapters
        )
        self._sequence = RefitSequence(
            settings,
            registry,
            store,
            self._journal,
            metrics,
            plans,
            self.versions,
            self.digests,
            refit_problems=self._admission.refit_problems,
            release=self._slot.release,
            progress=self.progress,
            adapters=self.adapters,
        )
        self._auto = AutoRefit(settings, registry, self.versions, self.trigger)
        if self.versions.committed is not None:
            metrics.committed_version.set(self.versions.committed.version)
        for name, state in self.adapters.versions.all().items():
            if state.committed is not None:
                metrics.adapter_version.labels(adapter=name).set(state.committed.version)
        registry.on_lost(self._on_member_lost)
        registry.on_registered(self._on_registered)

    # ---- queries (`admission`) ----

    def readiness(self) -> Readiness:
        return self._admission.readiness()

    def current_plan(self) -> Plan:
        return self._admission.current_plan()

    def link_transports(self, plan: Plan) -> dict[tuple[int, str, str], LinkTransport]:
        """What carries each link of `plan` among the registered members (`syncd.plan.transports`)."""
        return link_transports(
            plan, self._registry.members(), self._settings.backend, self._settings.same_host
        )

    def missing_generators(self) -> tuple[str, ...]:
        """Generator workers registered once and not now (`syncd.daemon.fleet`); cheap: no plan."""
        return self._admission.fleet.saw(self._registry.members()).missing

    def current(self) -> RefitRecord | None:
        return self._admission.current()

    def get(self, refit_id: str) -> RefitRecord:
        return self._admission.get(refit_id)

    def history(self, limit: int) -> list[RefitRecord]:
        return self._admission.history(limit)

    def version_status(self, member: Member, version: WeightVersion) -> VersionStatus:
        """What became of `version` of `member`'s training run (`syncd.daemon.version_status`)."""
        adapter = member.adapter.name if member.adapter is not None else ""
        found = refit_of(self.history(HISTORY_DEPTH), member.run_id, version, adapter)
        if found is not None:
            return VersionStatus(found)
        problems = self.adapters.problems(adapter) if adapter else self._admission.refit_problems()
        return VersionStatus(None, why_not_started(self._settings.auto_refit, problems, self.current()))

    # ---- commands from operators and members ----

    def admit(self, role: Role, member_id: str, catalog: Catalog, adapter: AdapterSpec | None = None) -> None:
        self._admission.admit(role, member_id, catalog, adapter)

    def announce(self, member: Member, version: int) -> None:
        if member.adapter is None:
            self._auto.announce(member, version)
            return
        if self.adapters.versions.announce(member, check_weight_version(member.member_id, version)):
            self._maybe_refit_adapter(member.adapter.name)

    def trigger_adapter(self, name: str, weight_version: WeightVersion | None = None) -> RefitRecord:
        """Start a refit of adapter `name`'s newest announced version into the generators' slots
        (`syncd.daemon.adapter_refits`); raises FailedPrecondition naming why it cannot start (a
        refit runs, no such adapter, a generator without slots or with too small ones)."""
        run = self._admission.start_adapter(name, weight_version)
        threading.Thread(target=self._run_refit, args=(run,), name=run.id, daemon=True).start()
        return run.created

    def _on_registered(self, member: Member) -> None:
        if member.adapter is not None:
            self.adapters.versions.registered(member)
            self._maybe_refit_adapter(member.adapter.name)
            return
        self._auto.on_registered(member)
        if member.lora_slots is not None:
            # A generator starts with empty slots: the committed adapters again (to every generator).
            for name, state in self.adapters.versions.all().items():
                if state.committed is not None:
                    self._maybe_refit_adapter(name, catch_up=True)

    def _maybe_refit_adapter(self, name: str, *, catch_up: bool = False) -> None:
        """Under auto-refit, a refit of the adapter's newest version when it is not the committed
        one; a catch-up always. One that cannot start now is retried when a refit ends."""
        if not (catch_up or (self._settings.auto_refit and self.adapters.versions.wants_refit(name))):
            return
        try:
            self.trigger_adapter(name)
        except (FailedPrecondition, Unavailable) as e:
            log.info("refit of adapter %r deferred: %s", name, e)
            self._pending_adapters.add(name)

    def _retry_adapters(self) -> None:
        pending, self._pending_adapters = self._pending_adapters, set()
        for name in sorted(pending):
            self._maybe_refit_adapter(name, catch_up=True)

    def trigger(
        self,
        weight_version: WeightVersion | None = None,
        allow_rollback: bool = False,
        full: bool = False,
        *,
        catch_up: bool = False,
    ) -> RefitRecord:
        """Start a refit of the trainers' newest announced version (`weight_version`, when given,
        must be that one; `full`: no delta links even where delta refits are on; `catch_up`: when
        that is the committed version, only to the replicas behind it); raises
        FailedPrecondition (changing nothing) if one runs, the version is not held or not ready,
        Unavailable if the store refuses to record it."""
        run = self._admission.start(weight_version, allow_rollback, full, catch_up=catch_up)
        threading.Thread(target=self._run_refit, args=(run,), name=run.id, daemon=True).start()
        return run.created

    def abort(self, refit_id: str, reason: str = "aborted by operator") -> RefitRecord:
        """Ends the refit here and now (members get Abort) and answers with what it recorded."""
        run = self._slot.running()
        if run is None or run.id != refit_id:
            record = self.get(refit_id)
            raise FailedPrecondition(f"refit {refit_id} already finished as {record.state}")
        if not run.fail(reason):
            raise FailedPrecondition(
                f"refit {refit_id} is committing (its commit decision is recorded); it cannot be aborted"
            )
        self._sequence.abort_everywhere(run, reason)
        return self.get(refit_id)

    def report(self, report: MemberReport) -> None:
        run = self._slot.running()
        if run is None or run.id != report.refit_id:
            log.info(
                "ignoring %s report from %s for refit %s (not running)",
                report.phase,
                report.member_id,
                report.refit_id,
            )
            return
        self.progress.reported(report)
        run.add(report)

    def report_progress(self, report: ProgressReport) -> None:
        """A member's bytes so far (`syncd.daemon.progress`); one of another refit is ignored."""
        run = self._slot.running()
        if run is not None and run.id == report.refit_id:
            self.progress.add(report)

    def refit_progress(self, record: RefitRecord) -> RefitProgress | None:
        """The progress of the refit `record` shows (`ProgressBoard.get`)."""
        return self.progress.get(record)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort the running refit (members get Abort while their sessions still exist), let a
        committing one finish, and write every record the store has not taken yet."""
        run = self._slot.running()
        if run is not None:
            if run.fail("syncd is shutting down"):
                self._sequence.abort_everywhere(run, "syncd is shutting down")
            run.wait_recorded(timeout)
        self._journal.close(timeout)

    def _run_refit(self, run: Run) -> None:
        self._sequence.execute(run)
        if run.adapter is not None:
            self._auto.after_refit()
            self._retry_adapters()
            return
        if run.state == RefitState.ABORTED and self._settings.refit_retries and not run.retry and run.planned:
            threading.Thread(
                target=self._retry_survivors, args=(run,), name=f"{run.id}-retry", daemon=True
            ).start()
        self._auto.after_refit()
        self._retry_adapters()

    def _retry_survivors(self, run: Run) -> None:
        """After an abort: once the lost members' leases ended, the same version once more over the
        replicas still alive (a retry is not retried; `syncd.daemon.survivors`)."""
        lost = wait_for_lost(run.planned, self._registry.members, self._settings.lease_seconds + 1)
        if lost.reason_not_to_retry is not None:
            log.info("refit %s is not retried: %s", run.id, lost.reason_not_to_retry)
            return
        log.warning(
            "refit %s (version %s) lost %s: retrying the trainers' newest version without %s",
            run.id,
            run.version,
            ", ".join(sorted(lost.members)),
            ", ".join(sorted(lost.excluded)),
        )
        retry = self._start_retry(run, lost.excluded)
        if retry is None:
            return
        self._sequence.execute(retry)
        if retry.state == RefitState.ABORTED and self._trainers_moved_on(retry):
            # The trainers stepped on while it ran (a trainer's wait for the aborted version ended
            # with the abort): the version they hold now, once more, over the same survivors.
            log.warning(
                "refit %s: the trainers moved on from version %s; retrying theirs", retry.id, retry.version
            )
            again = self._start_retry(retry, lost.excluded)
            if again is not None:
                self._sequence.execute(again)
        self._auto.after_refit()

    def _start_retry(self, run: Run, excluded: frozenset[str]) -> Run | None:
        try:
            # The newest version the trainers hold, not the aborted one: a trainer that went on
            # training during the settle time holds only its newest, and would refuse the old one.
            return self._admission.start(None, False, run.full, excluded)
        except (FailedPrecondition, Unavailable) as e:
            log.warning("refit %s: the retry over the survivors did not start: %s", run.id, e)
            return None

    def _trainers_moved_on(self, retry: Run) -> bool:
        """The retry aborted while the trainers announced (or, within the lease, announce) a newer
        version of the same run, and it lost no member: they refused the version it moved."""
        if find_lost(retry.planned, {m.member_id: m for m in self._registry.members()}).members:
            return False
        deadline = time.monotonic() + self._settings.lease_seconds
        while time.monotonic() < deadline:
            announced = self.versions.announced
            if (
                announced is not None
                and announced.run_id == retry.run_id
                and announced.version > retry.version
            ):
                return True
            time.sleep(0.1)
        return False

    def _on_member_lost(self, member: Member, reason: str) -> None:
        run = self._slot.running()
        if run is not None and member.member_id in run.involved:
            cause = f"member {member.member_id} lost mid-refit: {reason}"
            if not run.fail(cause):
                run.note_unconfirmed(member.member_id, cause)
