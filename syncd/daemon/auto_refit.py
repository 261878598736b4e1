"""When syncd starts a refit by itself: the auto-refit policy.

Two reasons start one. Under `auto_refit`, the trainers announced weights that are not the
committed ones (`Versions.wants_refit`). Always, a generator registered behind the committed
version while the trainers hold weights to bring it up to date (a catch-up refit): the committed
weights, or under auto-refit any newest ones. A trigger that cannot start now (a refit runs, a
member is missing) is deferred, and tried again when the running refit ends or a member
registers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from syncd.daemon.errors import FailedPrecondition, InvalidArgument, Unavailable
from syncd.daemon.readiness import behind
from syncd.daemon.registry import Member, Registry, check_weight_version
from syncd.daemon.settings import Settings
from syncd.daemon.versions import Versions
from syncd.vocabulary import Role

log = logging.getLogger(__name__)


class AutoRefit:
    def __init__(
        self, settings: Settings, registry: Registry, versions: Versions, trigger: Callable[..., object]
    ) -> None:
        """`trigger(catch_up=...)` starts a refit of the newest announced version (`catch_up`: to
        the generators behind the committed version only), raising FailedPrecondition or
        Unavailable when it cannot."""
        self._settings = settings
        self._registry = registry
        self._versions = versions
        self._trigger = trigger
        self._pending = False  # a trigger was deferred

    def announce(self, member: Member, version: int) -> None:
        """A trainer announced a weight version it holds."""
        if member.role != Role.TRAINER:
            raise InvalidArgument(
                f"only trainers announce weight versions; {member.member_id} is a {member.role}"
            )
        self._versions.announce(member, check_weight_version(member.member_id, version))
        self._maybe_refit()

    def on_registered(self, member: Member) -> None:
        if member.role == Role.TRAINER:
            self._versions.trainer_registered(member)
        self._maybe_refit()  # a deferred auto-refit may be possible now

    def after_refit(self) -> None:
        """A refit ended: retry a deferred trigger."""
        if self._pending:
            self._pending = False
            self._maybe_refit()

    def _maybe_refit(self) -> None:
        wanted = self._settings.auto_refit and self._versions.wants_refit()
        if wanted or self._wants_catch_up():
            try:
                # A catch-up alone moves the committed weights to the replicas behind only.
                self._trigger(catch_up=not wanted)
            except (FailedPrecondition, Unavailable) as e:
                log.info("auto-refit deferred: %s", e)
                self._pending = True

    def _wants_catch_up(self) -> bool:
        """A generator registered behind the committed version and the trainers hold weights to
        bring it up to date: the committed ones, or under auto-refit any newest ones."""
        committed, announced = self._versions.committed, self._versions.announced
        if committed is None or announced is None or not behind(self._registry.members(), committed):
            return False
        return self._settings.auto_refit or announced == committed
