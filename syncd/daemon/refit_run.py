"""One refit in progress (`Run`), the reports members send it, and their validation.

Before the commit decision, any failure (an error report, a lost lease, an operator abort) ends
the refit: `Run.fail` wakes the waiting phase. After the decision the refit is COMMITTED whatever
happens; a member that fails or does not confirm Commit is noted as unconfirmed, never "settled"
as if the refit had failed.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping

from syncd.commands import MemberReport, Phase
from syncd.daemon.store import RefitRecord
from syncd.plan import Plan
from syncd.states import RefitState
from syncd.weight_version import WeightVersion


class RefitAborted(Exception):
    """Ends the refit thread's phase sequence; the message is the recorded cause."""


class Run:
    """The refit in progress. Other threads touch it only through `add`, `fail` and `decide`."""

    def __init__(self, record: RefitRecord, involved: set[str]) -> None:
        self.record = record
        self.involved = involved
        self.phases: dict[str, float] = {}
        self.bytes = 0  # received by generators, as they reported it
        self.planned_bytes = 0  # what the plan moves to generators, known from TRANSFERRING on
        self.full = False  # an operator asked for a full refit (no delta links)
        self.delta_generators: tuple[str, ...] = ()  # generators that received deltas
        self.delta_elements = 0  # their units' elements,
        self.changed_elements = 0  # and how many changed
        self.state = record.state
        self.done = threading.Event()
        self.concluded = False  # set once, under the coordinator's lock, by whoever ends the refit
        self._cond = threading.Condition()
        self._reports: dict[tuple[str, str], MemberReport] = {}
        self._abort_reason: str | None = None
        self._decided = False
        self._commit_notes: dict[str, str] = {}  # member -> why it did not confirm Commit
        self._phase, self._phase_start = RefitState.PREPARING, time.monotonic()

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def version(self) -> WeightVersion:
        return self.record.weight_version

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

    def decide(self) -> None:
        """The point of no return; raises RefitAborted if the refit failed before it."""
        with self._cond:
            if self._abort_reason is not None:
                raise RefitAborted(self._abort_reason)
            self._decided = True

    def note_unconfirmed(self, member_id: str, cause: str) -> None:
        with self._cond:
            self._commit_notes.setdefault(member_id, cause)
            self._cond.notify_all()

    def enter(self, phase: RefitState, timeout: float) -> float:
        """Close the current phase's timing, start `phase`; returns its deadline."""
        self.close_phase()
        self._phase, self._phase_start = phase, time.monotonic()
        return self._phase_start + timeout

    def close_phase(self) -> None:
        self.phases[self._phase] = round(time.monotonic() - self._phase_start, 6)

    def timings(self) -> dict[str, float]:
        """Closed phases plus the time spent so far in the current one."""
        return {**self.phases, self._phase: round(time.monotonic() - self._phase_start, 6)}

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


def transfer_report_problem(
    plan: Plan, reports: Mapping[str, MemberReport], delta_dsts: frozenset[str] = frozenset()
) -> str | None:
    """What is wrong with the members' TRANSFERRED reports, judged against the plan, or None.
    Every member must report exactly the bytes its part of the plan moves (at most those, on delta
    links: their size depends on what changed), and sane timings."""
    problems = []
    for member_id, report in sorted(reports.items()):
        buckets = plan.for_member(member_id)
        expected = sum(b.nbytes for b in buckets)
        delta = any(b.dst in delta_dsts for b in buckets)
        if report.bytes > expected if delta else report.bytes != expected:
            problems.append(
                f"member {member_id} reported {report.bytes} bytes, its part of the plan moves {expected}"
            )
        bad = {k: v for k, v in report.timings.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            problems.append(f"member {member_id} reported timings out of range: {bad}")
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
