"""Readiness: whether a refit could start now, and whether the generators serve the committed
weights. `/readyz` needs both; a trigger needs only the first (a catch-up refit is how a generator
that registered behind the committed version gets its weights)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from syncd.daemon.errors import FailedPrecondition
from syncd.daemon.planning import dtype_mismatch
from syncd.daemon.registry import ROLES, Member
from syncd.daemon.versions import WeightSet
from syncd.layout import Catalog
from syncd.vocabulary import Role


@dataclass(frozen=True)
class Readiness:
    ready: bool
    expected: dict[str, int]
    registered: dict[str, int]
    reason: str


def refit_problems(
    members: Sequence[Member],
    expected: dict[str, int],
    run_id: str | None,
    catalog: Callable[[str], Catalog],
    plan: Callable[[], object],
) -> list[str]:
    """Why a refit could not start now (empty: it could)."""
    counts = Counter(m.role for m in members)
    problems = [f"{counts[r]} of {expected[r]} {r}s registered" for r in ROLES if counts[r] < expected[r]]
    stale = sorted(m.member_id for m in members if m.role == Role.TRAINER and m.run_id != run_id)
    if stale:
        problems.append(
            f"trainers {', '.join(stale)} belong to a superseded training run (the current run is {run_id!r})"
        )
    trainers = [catalog(m.catalog_hash) for m in members if m.role == Role.TRAINER]
    problems += [
        p
        for m in members
        if m.role == Role.GENERATOR
        if (p := dtype_mismatch(m.member_id, catalog(m.catalog_hash), trainers))
    ]
    if not problems:  # ready means a refit could start now: GET /v1/plan must agree
        try:
            plan()
        except FailedPrecondition as e:
            problems.append(str(e))
    return problems


def behind(members: Sequence[Member], committed: WeightSet | None) -> list[Member]:
    """Generators that do not report serving the committed version (a restarted generator serves
    its start-up checkpoint until a refit reaches it)."""
    if committed is None:
        return []
    return [m for m in members if m.role == Role.GENERATOR and m.weight_version != committed.version]


def behind_reason(generators: Sequence[Member], committed: WeightSet) -> str:
    serving = ", ".join(
        f"{m.member_id} serves {'an unknown version' if m.weight_version is None else m.weight_version}"
        for m in generators
    )
    return f"{serving}; committed is {committed.label}: waiting for a catch-up refit"
