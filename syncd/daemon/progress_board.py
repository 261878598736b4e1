"""Where syncd keeps the progress of its refits (`ProgressBoard`): one `TransferProgress` per
refit from the start of its transfer, the last `KEPT` of them after they ended, and the
`TransferModel` each committed full refit teaches.

The refit sequence calls `start` when TRANSFERRING starts and `concluded` once the refit's outcome
is recorded; the coordinator passes members' progress and TRANSFERRED reports; the HTTP API and
the metrics read `get` and `latest`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from syncd.commands import MemberReport, Phase, ProgressReport
from syncd.daemon.progress import EtaSource, RefitProgress, Share, TransferProgress
from syncd.daemon.store import RefitRecord, Store
from syncd.daemon.transfer_model import Observation, TransferModel
from syncd.plan import Plan
from syncd.states import TERMINAL, RefitState

KEPT = 16  # refits whose progress is kept after they ended


class ProgressBoard:
    def __init__(self, store: Store) -> None:
        self.model = TransferModel(store)
        self._lock = threading.Lock()
        self._refits: OrderedDict[str, TransferProgress] = OrderedDict()
        self._running: str | None = None

    def start(self, refit_id: str, plan: Plan) -> None:
        busiest = max((k.bytes for k in plan.links()), default=0)
        progress = TransferProgress(
            refit_id, plan, self.model.estimate_s(busiest), self.model.after_transfer_s()
        )
        with self._lock:
            self._refits[refit_id] = progress
            self._running = refit_id
            while len(self._refits) > KEPT:
                self._refits.popitem(last=False)

    def add(self, report: ProgressReport) -> None:
        progress = self._refits.get(report.refit_id)
        if progress is not None:
            progress.add(report)

    def reported(self, report: MemberReport) -> None:
        """A member's answer to a command: TRANSFERRED completes the links into it."""
        progress = self._refits.get(report.refit_id)
        if progress is not None and report.ok and report.phase == Phase.TRANSFERRED:
            progress.member_done(report.member_id)

    def concluded(self, record: RefitRecord) -> None:
        """The refit ended as `record` says; a committed full refit teaches the model."""
        with self._lock:
            progress = self._refits.get(record.id)
            if self._running == record.id:
                self._running = None
        if progress is None:
            return
        progress.conclude(record.state)
        transfer_s = record.phases.get(RefitState.TRANSFERRING)
        if record.state == RefitState.COMMITTED and record.mode == "full" and transfer_s:
            before = (RefitState.PREPARING, RefitState.TRANSFERRING)
            after_s = sum(s for phase, s in record.phases.items() if phase not in before)
            self.model.observe(Observation(progress.busiest_link_bytes, transfer_s, after_s))

    def get(self, record: RefitRecord) -> RefitProgress | None:
        """The progress of the refit `record` shows (its state), as far as syncd knows it: a refit
        still PREPARING has moved nothing of a plan not yet made; None for one that ended before
        this syncd started or `KEPT` refits ago."""
        progress = self._refits.get(record.id)
        if progress is not None:
            return progress.snapshot(record.state)
        if record.state in TERMINAL:
            return None
        return _preparing(record)

    def latest(self, current: RefitRecord | None) -> tuple[RefitProgress | None, bool]:
        """What the metrics show: the refit in flight (its transfer started, it has not ended;
        `current` is the running refit's record) and True, else the last one as it ended and
        False (None before any transfer)."""
        with self._lock:
            running = self._running
            last = next(reversed(self._refits.values()), None)
        if running is not None and current is not None and current.id == running:
            return self._refits[running].snapshot(current.state), True
        if last is None:
            return None, False
        return last.snapshot(last.state), False


def _preparing(record: RefitRecord) -> RefitProgress:
    return RefitProgress(
        refit_id=record.id,
        state=record.state,
        total=Share(0, 0, 0.0),
        eta_s=None,
        eta_source=EtaSource.NONE,
        elapsed_s=0.0,
        since_progress_s=0.0,
        stages={},
        members={},
        links=(),
        slowest=None,
        updated_at=time.time(),
    )
