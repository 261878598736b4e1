"""Which refit answers a trainer's "what became of my version" (`syncd.daemon.version_status`),
and why none started."""

from __future__ import annotations

from syncd.daemon.store import RefitRecord
from syncd.daemon.version_status import VersionStatus, refit_of, why_not_started
from syncd.states import RefitState
from syncd.weight_version import WeightVersion


def _refit(n: int, version: int, run: str = "run", state: RefitState = RefitState.COMMITTED) -> RefitRecord:
    finished = None if state not in (RefitState.COMMITTED, RefitState.ABORTED) else 1.0 + n
    return RefitRecord(
        id=f"refit-{n}",
        state=state,
        weight_version=WeightVersion(version),
        created_at=float(n),
        finished_at=finished,
        run_id=run,
    )


def test_the_newest_refit_of_the_run_that_moves_the_version_or_a_newer_one_answers() -> None:
    newest_first = [
        _refit(5, 2, state=RefitState.ABORTED),  # a retry of an older version: says nothing of 3
        _refit(4, 4, run="old"),  # another run's version 4
        _refit(3, 3),
        _refit(2, 2),
    ]
    assert refit_of(newest_first, "run", WeightVersion(3)) == newest_first[2]
    assert refit_of(newest_first, "run", WeightVersion(2)) == newest_first[0]
    assert refit_of(newest_first, "run", WeightVersion(6)) is None
    assert refit_of([_refit(6, 5), *newest_first], "run", WeightVersion(3)).id == "refit-6"


def test_a_refit_has_ended_once_its_outcome_is_final() -> None:
    assert VersionStatus(_refit(1, 1)).ended
    assert not VersionStatus(_refit(1, 1, state=RefitState.TRANSFERRING)).ended
    decided = RefitRecord(  # the commit decision, recorded before the generators installed
        id="refit-1", state=RefitState.COMMITTED, weight_version=WeightVersion(1), created_at=0.0
    )
    assert not VersionStatus(decided).ended
    assert not VersionStatus(None, "why").ended


def test_why_no_refit_started_names_every_reason() -> None:
    assert why_not_started(True, [], None) == ""
    no_auto = why_not_started(False, [], None)
    assert no_auto.startswith("syncd runs without --auto-refit")
    running = _refit(7, 2, state=RefitState.TRANSFERRING)
    both = why_not_started(True, ["0 of 1 generators registered"], running)
    expected = "refit refit-7 of version 2 is still TRANSFERRING; not ready to refit: 0 of 1 generators"
    assert both == f"{expected} registered"
