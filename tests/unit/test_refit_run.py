"""One refit in progress (`syncd.daemon.refit_run.Run`): it changes only through its methods, the
first failure wins until the commit decision and none counts after it, it ends once, and its
record (`snapshot`) shows what it moved. Threads are real; waits use short deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from syncd.commands import MemberReport, Phase
from syncd.daemon.refit_run import RefitAborted, Run
from syncd.daemon.store import RefitRecord
from syncd.states import RefitState
from syncd.weight_version import WeightVersion


def new_run() -> Run:
    created = RefitRecord(
        id="refit-7",
        state=RefitState.PREPARING,
        weight_version=WeightVersion(3),
        created_at=1000.0,
        run_id="run-a",
    )
    return Run(created, {"t", "g1", "g2"})


def test_the_first_failure_wakes_the_waiting_phase_and_names_the_cause() -> None:
    run = new_run()
    deadline = run.enter(RefitState.TRANSFERRING, 30.0)
    threading.Timer(0.05, run.fail, ("member g1 lost mid-refit",)).start()
    with pytest.raises(RefitAborted, match=r"^member g1 lost mid-refit$"):
        run.wait_for(Phase.TRANSFERRED, ("t", "g1"), deadline)
    assert run.fail("a consequence") is True  # still before the decision, but the first cause stays
    with pytest.raises(RefitAborted, match=r"^member g1 lost mid-refit$"):
        run.decide(commit_timeout=5.0)


def test_an_error_report_fails_the_refit_and_a_missing_one_times_out_naming_the_member() -> None:
    run = new_run()
    deadline = run.enter(RefitState.VERIFYING, 0.05)
    run.add(MemberReport("t", "refit-7", Phase.VERIFIED))
    with pytest.raises(RefitAborted, match=r"^timeout in VERIFYING: no VERIFIED report from g1$"):
        run.wait_for(Phase.VERIFIED, ("t", "g1"), deadline)
    run.add(MemberReport("g1", "refit-7", Phase.VERIFIED, ok=False, error="disk full"))
    with pytest.raises(RefitAborted, match=r"^member g1 failed VERIFIED: disk full$"):
        run.wait_for(Phase.VERIFIED, ("g1",), time.monotonic() + 5)


def test_after_the_decision_failures_only_mark_members_unconfirmed() -> None:
    run = new_run()
    deadline = run.decide(commit_timeout=0.2)
    assert run.state == RefitState.PREPARING  # the state stays until the members confirmed
    assert run.fail("too late") is False
    run.add(MemberReport("t", "refit-7", Phase.COMMITTED))
    run.add(MemberReport("g1", "refit-7", Phase.COMMITTED, ok=False, error="install failed"))
    unconfirmed = run.wait_confirmations(("t", "g1", "g2"), deadline)
    assert unconfirmed == {
        "g1": "member g1 failed COMMITTED: install failed",
        "g2": "g2 did not confirm Commit within the commit timeout",
    }


def test_a_refit_ends_once_and_enters_no_phase_after_it() -> None:
    run = new_run()
    run.enter(RefitState.TRANSFERRING, 30.0)
    assert run.conclude(RefitState.ABORTED) is True
    assert run.concluded and run.state == RefitState.ABORTED
    assert run.conclude(RefitState.COMMITTED) is False
    assert run.state == RefitState.ABORTED
    with pytest.raises(RefitAborted, match="the refit already ended"):
        run.enter(RefitState.VERIFYING, 30.0)
    assert run.state == RefitState.ABORTED
    assert not run.wait_recorded(0.01)
    run.mark_recorded()
    assert run.wait_recorded(0.01)


def test_the_snapshot_shows_what_the_refit_moved() -> None:
    run = new_run()
    run.narrow_to(("t", "g1"))
    run.enter(RefitState.TRANSFERRING, 30.0)
    run.start_transfer(planned_bytes=2048)
    run.send_deltas_to(("g1",))
    run.transferred(received_bytes=512, delta_elements=1000, changed_elements=250)
    run.conclude(RefitState.COMMITTED)
    record = run.snapshot(error="", unconfirmed=("g2",), finished_at=1010.0)
    assert run.involved == {"t", "g1"}
    assert (record.id, record.state, record.weight_version, record.run_id) == (
        "refit-7",
        RefitState.COMMITTED,
        3,
        "run-a",
    )
    assert (record.created_at, record.finished_at, record.unconfirmed) == (1000.0, 1010.0, ("g2",))
    assert set(record.phases) == {RefitState.PREPARING, RefitState.TRANSFERRING}
    assert (record.bytes, record.planned_bytes, record.mode) == (512, 2048, "delta")
    assert (record.saved_bytes, record.changed_fraction) == (1536, 0.25)
