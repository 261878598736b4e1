"""What a sending member learns of the refits it takes part in, for a trainer that waits on them.

A trainer rank announces each step's version and may block until a refit of it ends
(`wait_refit`). An abort ends that wait only when the aborted refit moved that version or a newer
one, or a version the member never learned (the abort came before the member began its part):
syncd may retry an older version after losing a replica (`syncd.daemon.survivors`), and the
trainer, which has moved on, refuses it; that abort says nothing of the version the trainer waits
for. Held by the sender endpoint (`syncd.member.sender`) that our trainer and `attach` share.
"""

from __future__ import annotations

import threading

from syncd.weight_version import WeightVersion


class RefitOutcomes:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._committed = WeightVersion(0)  # newest weight version a refit committed
        self._moving: WeightVersion | None = None  # the version of the refit in progress, once begun
        self._aborted: list[WeightVersion | None] = []  # per abort, the version it moved (None: unknown)

    def began(self, weight_version: WeightVersion) -> None:
        """This member began its part of a refit of `weight_version` (called before any check)."""
        with self._changed:
            self._moving = weight_version

    def committed(self, weight_version: WeightVersion) -> None:
        with self._changed:
            self._committed = max(self._committed, weight_version)
            self._moving = None
            self._changed.notify_all()

    def aborted(self) -> None:
        with self._changed:
            self._aborted.append(self._moving)
            self._moving = None
            self._changed.notify_all()

    def wait(self, version: WeightVersion, timeout_s: float) -> str:
        """Block until a refit of `version` (or newer) committed ("committed"), or a refit that
        could have moved it aborted after the call ("aborted"); "timeout" after `timeout_s`."""
        with self._changed:
            seen = len(self._aborted)

            def ended() -> bool:
                return self._committed >= version or any(
                    v is None or v >= version for v in self._aborted[seen:]
                )

            if not self._changed.wait_for(ended, timeout_s):
                return "timeout"
            return "committed" if self._committed >= version else "aborted"
