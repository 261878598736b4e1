"""Which weight version each member's delta state holds, so that syncd plans delta links only where
both ends hold the same base: a sender's mirror (what it last sent) and a generator's staging.

A member holds a base from the commit of a refit it took part in (confirmed, same session) until it
takes part in a refit that does not commit, or registers anew (restart). Under another plan a
sender may be asked for regions it did not send last time; it sends those dense (its mirror knows
which regions it holds). An inplace generator (`receive_by_layer`) holds a base only under
`--delta-inplace`, which requires it to keep a checkpoint-format copy of its processed layers
(generator `--inplace-delta-base`); it applies the delta to its live layers with an undo log.
Anything else, a generator that missed a version, a new replica, an inplace generator without
`--delta-inplace` or a group that is not gloo, gets a full refit in the same plan. Replicas that
relay to each other (fan-out) go together: a relay forwards the sender's delta as it came and each
of its successors applies it to its own copy, so a chain (a relay tree) takes deltas only when
every replica in it holds the base, and goes full whole otherwise. The
whole-region checksums catch what this bookkeeping cannot see (a flipped bit).
"""

from __future__ import annotations

from collections.abc import Mapping

from syncd.commands import DeltaLinks, StageGroup
from syncd.daemon.registry import Member
from syncd.plan import Plan
from syncd.vocabulary import Backend
from syncd.weight_version import WeightVersion


class DeltaBases:
    def __init__(self) -> None:
        self._held: dict[str, tuple[str, int]] = {}  # member -> (session, version its delta state holds)

    def _holds(self, m: Member, version: int) -> bool:
        return self._held.get(m.member_id) == (m.session_id, version)

    def links(
        self,
        plan: Plan,
        members: Mapping[str, Member],
        groups: Mapping[int, StageGroup],
        base: WeightVersion | None,
        max_fraction: float,
        full: bool = False,
        inplace: bool = False,
    ) -> DeltaLinks:
        """The delta links of a refit from `base` (the committed version; None before the first):
        every generator whose senders and itself hold it, unless `full` forces a full refit;
        inplace generators only when `inplace` (syncd's `--delta-inplace`)."""
        senders: dict[str, set[str]] = {}
        gloo_stages = {s for s, g in groups.items() if g.backend == Backend.GLOO}
        refused: set[str] = set()
        for b in plan.buckets:
            senders.setdefault(b.dst, set()).add(b.src)
            if b.stage not in gloo_stages:
                refused.add(b.dst)
        if full or base is None:
            return DeltaLinks(None, frozenset(), max_fraction)
        # A relay's senders include its parent replica, so a replica takes deltas only where the
        # replicas before it hold the base too; `_whole_chains` then drops the chains of the rest.
        dsts = {
            g
            for g, srcs in senders.items()
            if g not in refused
            and (inplace or not members[g].receive_by_layer)
            and self._holds(members[g], base)
            and all(self._holds(members[s], base) for s in srcs)
        }
        dsts = _whole_chains(plan, dsts)
        return DeltaLinks(base if dsts else None, frozenset(dsts), max_fraction)

    def committed(self, members: Mapping[str, Member], version: WeightVersion) -> None:
        """`members` confirmed the commit of `version`: their delta state holds it."""
        for m in members.values():
            self._held[m.member_id] = (m.session_id, version)

    def forget(self, member_ids) -> None:
        """A refit these members took part in did not commit: their delta state is between versions."""
        for m in member_ids:
            self._held.pop(m, None)


def _whole_chains(plan: Plan, dsts: set[str]) -> set[str]:
    """`dsts` less every replica that relays to, or from, a replica not in it (transitively): the
    replicas one relay tree links go all as deltas or all full."""
    relay_links = {(b.src, b.dst) for b in plan.buckets if b.relay is not None}
    kept = set(dsts)
    changed = True
    while changed:
        changed = False
        for src, dst in relay_links:
            if (src in kept) != (dst in kept):
                kept.discard(src)
                kept.discard(dst)
                changed = True
    return kept
