"""Weight versions and the training runs they belong to.

A trainer numbers its versions (optimizer steps) from 1 in every run, so a version number alone
does not name a weight set: (run_id, version) does. Rules:

- The trainers' current run is the run of the newest trainer registration. A new run supersedes
  the old one: the old run's versions are no longer held by anyone and cannot be moved, and its
  ranks can no longer announce.
- Within a run, announced versions only grow (an older or repeated announcement changes nothing);
  a rank that registers holding a version makes that version the run's announced one.
- A refit moves the current run's newest announced version: the trainers hold only their newest
  weights. Moving a version older than the committed one of the same run (a rollback) needs an
  explicit `allow_rollback`.
- Auto-refit wants a refit whenever the newest announced weights are not the committed ones,
  including after a trainer restart (a new run's version 1 after the old run's version 3).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from syncd.daemon.errors import FailedPrecondition
from syncd.daemon.registry import Member
from syncd.daemon.store import Store, StoreUnavailable
from syncd.weight_version import WeightVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSet:
    run_id: str
    version: WeightVersion

    @property
    def label(self) -> str:
        """One label per weight set, e.g. `2f9c...:3`; `:3` when the run has no id."""
        return f"{self.run_id}:{self.version}"


class Versions:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.run_id: str | None = store.get_text("announced_run")
        self.announced = _weight_set(store.get_text("announced_run"), store.get_int("announced_version"))
        self.committed = _weight_set(
            store.get_text("committed_run") or "", store.get_int("committed_version")
        )

    def trainer_registered(self, member: Member) -> None:
        """A trainer rank registered: a new run supersedes the current one; the version the rank
        holds becomes the announced one."""
        with self._lock:
            if member.run_id != self.run_id:
                log.warning(
                    "training run %r supersedes run %r (registered by %s): the old run's versions "
                    "are no longer held",
                    member.run_id,
                    self.run_id,
                    member.member_id,
                )
                self.run_id, self.announced = member.run_id, None
                self._persist({"announced_run": member.run_id, "announced_version": None})
            held = member.weight_version
            if held is not None and (self.announced is None or held != self.announced.version):
                # What the rank holds now, even if older (a job resumed from an earlier checkpoint
                # under the same run id): trainers can only send what they hold.
                self.announced = WeightSet(member.run_id, held)
                self._persist({"announced_run": member.run_id, "announced_version": str(held)})

    def announce(self, member: Member, version: WeightVersion) -> bool:
        """Record `version` of the member's run; True if it is the run's newest."""
        with self._lock:
            if member.run_id != self.run_id:
                raise FailedPrecondition(
                    f"{member.member_id} belongs to training run {member.run_id!r}, superseded by run "
                    f"{self.run_id!r}; its versions cannot be moved"
                )
            if self.announced is not None and version <= self.announced.version:
                return False
            self.announced = WeightSet(member.run_id, version)
            self._persist({"announced_run": member.run_id, "announced_version": str(version)})
        log.info("%s announced weight version %d of run %r", member.member_id, version, member.run_id)
        return True

    def to_move(self, requested: WeightVersion | None, allow_rollback: bool) -> WeightSet:
        """The weight set a refit may move; raises FailedPrecondition naming why not."""
        with self._lock:
            announced, committed = self.announced, self.committed
        if announced is None:
            raise FailedPrecondition(
                f"no weight version to move: no trainer of the current run {self.run_id!r} announced one"
            )
        if requested is not None and requested != announced.version:
            raise FailedPrecondition(
                f"weight version {requested} is not held by the trainers: their run {announced.run_id!r} "
                f"announced {announced.version} as its newest version, and trainers hold only their newest"
            )
        if (
            committed is not None
            and committed.run_id == announced.run_id
            and announced.version < committed.version
            and not allow_rollback
        ):
            raise FailedPrecondition(
                f"moving version {announced.version} would roll back from the committed version "
                f"{committed.version} of the same run; set allow_rollback to do it anyway"
            )
        return announced

    def wants_refit(self) -> bool:
        """Auto-refit: the newest announced weights are not the committed ones (and newer, within a run)."""
        with self._lock:
            a, c = self.announced, self.committed
        if a is None:
            return False
        return c is None or c.run_id != a.run_id or a.version > c.version

    def set_committed(self, weights: WeightSet) -> None:
        """After the commit decision reached the store (which wrote these values with it)."""
        with self._lock:
            self.committed = weights

    def _persist(self, values: dict[str, str | None]) -> None:
        try:
            self._store.set_meta(values)
        except StoreUnavailable as e:
            log.warning("versions kept in memory only (%s): %s", values, e)


def _weight_set(run_id: str | None, version: int | None) -> WeightSet | None:
    return None if version is None else WeightSet(run_id or "", WeightVersion(version))
