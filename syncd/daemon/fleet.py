"""The generator fleet as syncd has seen it: which replicas are missing now, and whether refits may
go on over the ones that are there.

A replica lost to a bad NIC, a preempted node or a partition must not stop the others learning.
So once every expected generator has registered (the fleet was whole: before that, a missing one
has not arrived yet, and refits wait for it as at start-up), a refit goes on without the missing
replicas while every *layout* still has at least `min_replicas` whole replicas registered. A
replica's layout is its workers' catalogs (identical catalogs: the same model cut the same way); a
replica is whole when every worker syncd has seen of it is registered, and only whole replicas
take part (the other TP ranks of a replica that lost one would install half a version).

Lifecycle: `Fleet.saw` is called with the registered members before each decision (`Admission`);
what it remembers is in memory only: after a restart of syncd the fleet must be whole once again.
A missing replica that registers again behind the committed version is caught up by syncd's
catch-up refit (`syncd.daemon.auto_refit`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from syncd.daemon.registry import Member
from syncd.vocabulary import Role


@dataclass(frozen=True)
class FleetView:
    """The generators as they are now, against what syncd has seen of them."""

    missing: tuple[str, ...]  # generator workers seen once, not registered now
    left_out: tuple[str, ...]  # registered workers of a replica that lost another one
    problems: tuple[str, ...]  # why refits cannot go on without the missing ones (empty: they can)

    @property
    def degraded(self) -> bool:
        return bool(self.missing)

    def reason(self) -> str:
        """For readiness: which replicas are missing and what refits do meanwhile."""
        if not self.missing:
            return ""
        without = ", ".join(self.missing + self.left_out)
        if self.problems:
            return f"missing {without}: {'; '.join(self.problems)}"
        return f"degraded: missing {without}; refits go on over the other replicas"


def _replica(member: Member) -> int:
    return int(member.coords.get("replica", 0))


class Fleet:
    def __init__(self, expected_generators: int, min_replicas: int) -> None:
        self._expected, self._min = expected_generators, min_replicas
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, str]] = {}  # generator worker -> (replica, catalog hash)
        self._was_whole = False

    def saw(self, members: Sequence[Member]) -> FleetView:
        """Remember the registered generators; say what is missing and whether refits go on."""
        generators = [m for m in members if m.role == Role.GENERATOR]
        with self._lock:
            for m in generators:
                self._seen[m.member_id] = (_replica(m), m.catalog_hash)
            if len(generators) >= self._expected:
                self._was_whole = True
            if not self._was_whole:
                return FleetView((), (), ())
            return self._view({m.member_id for m in generators})

    def _view(self, registered: set[str]) -> FleetView:
        missing = sorted(m for m in self._seen if m not in registered)
        if not missing:
            return FleetView((), (), ())
        workers: dict[int, list[str]] = defaultdict(list)
        for member_id, (replica, _) in self._seen.items():
            workers[replica].append(member_id)
        broken = {self._seen[m][0] for m in missing}
        left_out = sorted(m for m in registered if m in self._seen and self._seen[m][0] in broken)
        layouts: dict[tuple[str, ...], int] = defaultdict(int)  # layout -> whole replicas registered
        for replica, ids in workers.items():
            layout = tuple(sorted(self._seen[m][1] for m in ids))
            layouts[layout] += replica not in broken
        problems = tuple(
            f"a generator layout ({len(layout)} worker{'s' if len(layout) > 1 else ''}) has {n} whole "
            f"replica{'s' if n != 1 else ''} registered, fewer than --min-replicas-per-layout {self._min}"
            for layout, n in sorted(layouts.items())
            if n < self._min
        )
        return FleetView(tuple(missing), tuple(left_out), problems)
