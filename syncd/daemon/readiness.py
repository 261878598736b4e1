"""Readiness: whether a refit could start now (`checks.refit_problems`), and whether the
generators serve the committed weights (`behind`). `/readyz` needs both; a trigger needs only the
first (a catch-up refit is how a generator that registered behind the committed version gets its
weights)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from syncd.daemon.registry import Member
from syncd.daemon.versions import WeightSet
from syncd.vocabulary import Role


@dataclass(frozen=True)
class Readiness:
    ready: bool
    expected: dict[Role, int]
    registered: dict[Role, int]
    reason: str  # why not ready; when ready, what is missing (refits go on without it), or empty
    missing: tuple[str, ...] = ()  # generator workers seen once and not registered now (`fleet`)


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
