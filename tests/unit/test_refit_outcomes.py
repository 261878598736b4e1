"""A trainer's wait for a refit of its version (`syncd.member.refit_outcomes`): which aborts end it.
Another thread plays syncd's commands a moment after the wait began."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from syncd.member.refit_outcomes import RefitOutcomes
from syncd.weight_version import WeightVersion

V1, V2 = WeightVersion(1), WeightVersion(2)


def _later(*steps: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(0.2, lambda: [step() for step in steps])
    timer.start()
    return timer


def test_an_abort_of_an_older_version_does_not_end_the_wait_for_a_newer_one() -> None:
    outcomes = RefitOutcomes()
    # syncd retries version 1 after losing a replica; this rank holds 2 and refuses it; then a
    # refit of version 2 commits.
    timer = _later(
        lambda: outcomes.began(V1),
        outcomes.aborted,
        lambda: outcomes.began(V2),
        lambda: outcomes.committed(V2),
    )
    assert outcomes.wait(V2, 30) == "committed"
    timer.join()


def test_an_abort_of_the_version_or_of_an_unknown_one_ends_the_wait() -> None:
    for began in (V2, None):
        outcomes = RefitOutcomes()
        steps = [outcomes.aborted] if began is None else [partial(outcomes.began, V2), outcomes.aborted]
        timer = _later(*steps)  # None: aborted before this rank began its part
        assert outcomes.wait(V2, 30) == "aborted", began
        timer.join()


def test_aborts_before_the_call_do_not_count_and_a_newer_commit_answers() -> None:
    outcomes = RefitOutcomes()
    outcomes.aborted()
    assert outcomes.wait(V1, 0.05) == "timeout"
    outcomes.committed(V2)
    assert outcomes.wait(V1, 0.05) == "committed"
