"""One refit in progress (`Run`) and the reports members send it.

Before the commit decision, any failure (an error report, a lost lease, an operator abort) ends
the refit: `Run.fail` wakes the waiting phase. After the decision the refit is COMMITTED whatever
happens; a member that fails or does not confirm Commit is noted as unconfirmed, never "settled"
as if the refit had failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from syncd.commands import MemberReport, Phase
from syncd.daemon.registry import Member
from syncd.daemon.store import RefitRecord
from syncd.layout.adapters import AdapterSpec
from syncd.states import RefitState
from syncd.weight_version import WeightVersion


def seconds_left(deadline: float) -> float:
    """Seconds until a phase's monotonic deadline (`Run.enter`): what a command gives its member
    to finish."""
    return max(deadline - time.monotonic(), 0.0)


class RefitAborted(Exception):
    """Ends the refit thread's phase sequence; the message is the recorded cause."""


class Run:
    """The refit in progress. Its fields change only through its methods: the refit thread moves
    it through its phases (`enter`, `narrow_to`, `start_transfer`, `send_deltas_to`,
    `transferred`, `decide`), other threads touch it through `add`, `fail` and
    `note_unconfirmed`, and whoever ends the refit calls `conclude` once, then `mark_recorded`
    once its outcome is recorded. `snapshot` shows it as a `RefitRecord`."""

    def __init__(
        self,
        record: RefitRecord,
        involved: set[str],
        full: bool = False,
        excluded: frozenset[str] = frozenset(),
        *,
        missing: tuple[str, ...] = (),
        retry: bool = False,
        serving: frozenset[str] = frozenset(),
        adapter: AdapterSpec | None = None,
    ) -> None:
        """`excluded`: registered members left out (a retry's lost replicas, `survivors`, or the
        other workers of a missing one, `fleet`); `missing`: generators seen once and not
        registered when it was triggered; `retry`: it retries a refit that lost replicas;
        `serving`: a catch-up's generators that serve its version already (not reached either)."""
        self._created = record
        self._adapter = adapter  # a refit of this named adapter (`syncd.daemon.adapter_refits`)
        self._involved = frozenset(involved)
        self._full = full  # an operator asked for a full refit (no delta links)
        self._excluded = excluded | serving
        self._left_out = tuple(sorted(set(missing) | excluded))  # the generators it goes without
        self._retry = retry
        self._planned: dict[str, Member] = {}  # the plan's members as PREPARING found them
        self._phases: dict[str, float] = {}
        self._bytes = 0  # received by generators, as they reported it
        self._planned_bytes = 0  # what the plan moves to generators, known from TRANSFERRING on
        self._delta_generators: tuple[str, ...] = ()  # generators that received deltas
        self._delta_elements = 0  # their units' elements,
        self._changed_elements = 0  # and how many changed
        self._state = record.state
        self._recorded = threading.Event()
        self._concluded = False
        self._cond = threading.Condition()
        self._reports: dict[tuple[Phase, str], MemberReport] = {}  # (phase, member)
        self._abort_reason: str | None = None
        self._decided = False
        self._commit_notes: dict[str, str] = {}  # member -> why it did not confirm Commit
        self._phase = RefitState.PREPARING
        self._phase_start = time.monotonic()

    @property
    def created(self) -> RefitRecord:
        """The record the store made when the refit was triggered."""
        return self._created

    @property
    def id(self) -> str:
        return self._created.id

    @property
    def version(self) -> WeightVersion:
        return self._created.weight_version

    @property
    def run_id(self) -> str:
        """The training run of the weights it moves."""
        return self._created.run_id

    @property
    def adapter(self) -> AdapterSpec | None:
        """The named adapter it moves into the generators' slots; None: the base weights."""
        return self._adapter

    @property
    def state(self) -> RefitState:
        return self._state

    @property
    def involved(self) -> frozenset[str]:
        """The members an abort or a lost lease concerns: every registered member until the plan
        is made, then the plan's members."""
        return self._involved

    @property
    def full(self) -> bool:
        return self._full

    @property
    def excluded(self) -> frozenset[str]:
        return self._excluded

    @property
    def retry(self) -> bool:
        return self._retry

    @property
    def planned(self) -> Mapping[str, Member]:
        """The plan's members (sessions included) when it was made: what a retry compares with."""
        return self._planned

    @property
    def delta_generators(self) -> tuple[str, ...]:
        return self._delta_generators

    @property
    def concluded(self) -> bool:
        with self._cond:
            return self._concluded

    def narrow_to(self, members: tuple[str, ...], registered: Mapping[str, Member] | None = None) -> None:
        """The plan is made: only its members take part from now on (`registered`: as they are)."""
        self._involved = frozenset(members)
        if registered is not None:
            self._planned = {m: registered[m] for m in members}

    def start_transfer(self, planned_bytes: int) -> None:
        """What the plan moves to generators (recorded with TRANSFERRING, so a refit cut short,
        syncd killed, still says what it was moving)."""
        self._planned_bytes = planned_bytes

    def send_deltas_to(self, generators: tuple[str, ...]) -> None:
        """These generators receive only what changed since the version they hold."""
        self._delta_generators = generators

    def transferred(self, received_bytes: int, delta_elements: int, changed_elements: int) -> None:
        """What the generators reported receiving, once the reports agree with the plan."""
        self._bytes = received_bytes
        self._delta_elements, self._changed_elements = delta_elements, changed_elements

    def add(self, report: MemberReport) -> None:
        if not report.ok:
            cause = f"member {report.member_id} failed {report.phase}: {report.error or 'no cause given'}"
            if report.phase == Phase.COMMITTED:
                self.note_unconfirmed(report.member_id, cause)
            else:
                self.fail(cause)
            return
        with self._cond:
            self._reports[(report.phase, report.member_id)] = report
            self._cond.notify_all()

    def fail(self, reason: str) -> bool:
        """First cause wins; later ones are consequences of it. False (nothing changes) once the
        commit decision is made."""
        with self._cond:
            if self._decided:
                return False
            if self._abort_reason is None:
                self._abort_reason = reason
                self._cond.notify_all()
            return True

    def decide(self, commit_timeout: float) -> float:
        """The point of no return: starts the COMMITTING phase's clock (the state stays VERIFYING
        until the members confirmed) and returns its deadline; raises RefitAborted if the refit
        failed before it."""
        deadline = self._start_phase(RefitState.COMMITTING, commit_timeout)
        with self._cond:
            if self._abort_reason is not None:
                raise RefitAborted(self._abort_reason)
            self._decided = True
        return deadline

    def note_unconfirmed(self, member_id: str, cause: str) -> None:
        with self._cond:
            if (Phase.COMMITTED, member_id) in self._reports:
                return  # it confirmed: what befalls it after (it left, its lease ran out) is its own
            self._commit_notes.setdefault(member_id, cause)
            self._cond.notify_all()

    def enter(self, state: RefitState, timeout: float) -> float:
        """Move to `state`, closing the current phase's timing; returns the new phase's deadline.
        Raises RefitAborted once the refit ended (an operator's abort concludes it from another
        thread), so a concluded refit never shows a running state again."""
        with self._cond:
            if self._concluded:
                raise RefitAborted("the refit already ended")
            deadline = self._start_phase(state, timeout)
            self._state = state
        return deadline

    def conclude(self, state: RefitState) -> bool:
        """End the refit in its final `state`: True for the first caller, False (nothing changes)
        for any later one."""
        with self._cond:
            if self._concluded:
                return False
            self._concluded = True
            self._close_phase()
            self._state = state
        return True

    def mark_recorded(self) -> None:
        """The concluded refit's outcome is recorded (in memory at least): `wait_recorded` returns."""
        self._recorded.set()

    def wait_recorded(self, timeout: float) -> bool:
        return self._recorded.wait(timeout)

    def snapshot(
        self,
        state: RefitState | None = None,
        *,
        error: str = "",
        unconfirmed: tuple[str, ...] = (),
        finished_at: float | None = None,
    ) -> RefitRecord:
        """The refit as a record, in its current state unless `state` says otherwise; an unfinished
        one counts the time spent so far in its current phase."""
        return RefitRecord(
            id=self.id,
            state=self._state if state is None else state,
            weight_version=self.version,
            created_at=self._created.created_at,
            finished_at=finished_at,
            error=error,
            phases=self._timings() if finished_at is None else dict(self._phases),
            bytes=self._bytes,
            unconfirmed=unconfirmed,
            run_id=self.run_id,
            planned_bytes=self._planned_bytes,
            delta_generators=self._delta_generators,
            delta_elements=self._delta_elements,
            changed_elements=self._changed_elements,
            left_out=self._left_out,
            adapter=self._created.adapter,
        )

    def _start_phase(self, phase: RefitState, timeout: float) -> float:
        self._close_phase()
        self._phase, self._phase_start = phase, time.monotonic()
        return self._phase_start + timeout

    def _close_phase(self) -> None:
        self._phases[self._phase] = round(time.monotonic() - self._phase_start, 6)

    def _timings(self) -> dict[str, float]:
        """Closed phases plus the time spent so far in the current one."""
        return {**self._phases, self._phase: round(time.monotonic() - self._phase_start, 6)}

    def wait_for(self, phase: Phase, members: tuple[str, ...], deadline: float) -> dict[str, MemberReport]:
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

    def wait_confirmations(self, members: tuple[str, ...], deadline: float) -> dict[str, str]:
        """After the decision: wait until every member confirmed Commit, failed it or the deadline
        passed; returns member -> cause for those that did not confirm."""
        with self._cond:
            while True:
                pending = [
                    m
                    for m in members
                    if (Phase.COMMITTED, m) not in self._reports and m not in self._commit_notes
                ]
                remaining = deadline - time.monotonic()
                if not pending or remaining <= 0:
                    for m in pending:
                        self._commit_notes[m] = f"{m} did not confirm Commit within the commit timeout"
                    return {m: self._commit_notes[m] for m in members if m in self._commit_notes}
                self._cond.wait(remaining)
