"""What became of a weight version a trainer announced: the answer to the VersionStatus RPC.

A trainer that waits until its generators serve a version (`syncd.member.attach`'s `wait_s`,
trainer_svc's `--sync-refit`) asks this until the refit ends. The refit that answers is the
newest of the trainer's run that moves that version or a newer one (auto-refit moves the newest
announced version, so a refit of a newer one serves the wait too; a refit of an older version,
such as one syncd retries or a catch-up, says nothing of it). It has ended once it is ABORTED,
or COMMITTED with every member's Commit confirmed or given up on: only then do the generators
serve it (a member that did not confirm is listed as unconfirmed, with the cause in `error`).
Before any refit of it, `waiting_for` says why none started, so a trainer that gives up can say
whether syncd runs without `--auto-refit`, lacks a generator, or is busy with an older version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from syncd.daemon.store import RefitRecord
from syncd.states import TERMINAL
from syncd.weight_version import WeightVersion

# How far back in the refit history the refit of a version is looked for: a trainer asks while
# it waits for a version it just announced, so its refit is among the newest.
HISTORY_DEPTH = 20


@dataclass(frozen=True)
class VersionStatus:
    refit: RefitRecord | None  # the newest refit of the run that moves the version or a newer one
    waiting_for: str = ""  # no refit yet: why none started ("" when syncd knows no reason)

    @property
    def ended(self) -> bool:
        r = self.refit
        return r is not None and r.state in TERMINAL and r.finished_at is not None


def refit_of(
    records: Iterable[RefitRecord], run_id: str, version: WeightVersion, adapter: str = ""
) -> RefitRecord | None:
    """The newest of `records` (newest first) of run `run_id` that moves `version` or a newer one
    (of the named `adapter`'s versions; "": the base weights')."""
    return next(
        (r for r in records if (r.run_id, r.adapter) == (run_id, adapter) and r.weight_version >= version),
        None,
    )


def why_not_started(auto_refit: bool, problems: list[str], running: RefitRecord | None) -> str:
    """Why no refit of a version started yet: `problems` are why a refit could not start now,
    `running` the refit (of another version) that holds the one slot."""
    reasons = []
    if not auto_refit:
        reasons.append(
            "syncd runs without --auto-refit: a refit starts only when an operator asks "
            "(syncctl refit, POST /v1/refits)"
        )
    if running is not None:
        reasons.append(f"refit {running.id} of version {running.weight_version} is still {running.state}")
    if problems:
        reasons.append(f"not ready to refit: {'; '.join(problems)}")
    return "; ".join(reasons)
