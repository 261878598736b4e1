"""syncd's choice of delta links (`syncd.daemon.delta_bases`): a generator gets a delta only when
it and every one of its senders hold the committed version in their current sessions; everyone
else gets a full refit in the same plan."""

from __future__ import annotations

from dataclasses import replace

from syncd.commands import StageGroup
from syncd.daemon.delta_bases import DeltaBases
from syncd.daemon.registry import Member
from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.fanout import make_fanout_plan

W = CanonicalTensor("w", (64, 8), "bfloat16")
CATALOG = Catalog((W,), (local_tensor("w", "bfloat16", Canon(W.name, W.shape)),))


def member(member_id: str, role: str, **kw) -> Member:
    return Member(member_id, role, {}, "cpu", "127.0.0.1", "hash", f"{member_id}-s1", 0.0, **kw)


MEMBERS = {
    m.member_id: m
    for m in (
        member("t", "trainer"),
        member("g1", "generator"),
        member("g2", "generator"),
        member("gi", "generator", receive_by_layer=True),
    )
}
PLAN = make_plan([SourceMember("t", 0, CATALOG)], [DestMember(g, CATALOG) for g in ("g1", "g2", "gi")])
GLOO = {0: StageGroup(0, "refit-1/stage0", "gloo", ("t", "g1", "g2", "gi"))}


def test_only_generators_holding_the_base_with_their_senders_get_deltas():
    bases = DeltaBases()
    assert bases.links(PLAN, MEMBERS, GLOO, None, 0.5).dsts == frozenset()  # nothing committed yet
    bases.committed({m: MEMBERS[m] for m in ("t", "g1", "gi")}, 1)  # g2 did not confirm version 1
    links = bases.links(PLAN, MEMBERS, GLOO, 1, 0.5)
    assert links.dsts == {"g1"} and links.base == 1  # g2 missed it; gi installs in place
    assert bases.links(PLAN, MEMBERS, GLOO, 1, 0.5, inplace=True).dsts == {"g1", "gi"}  # --delta-inplace
    assert bases.links(PLAN, MEMBERS, GLOO, 1, 0.5, full=True).dsts == frozenset()  # an operator's full refit
    assert bases.links(PLAN, MEMBERS, GLOO, 2, 0.5).dsts == frozenset()  # the base is another version
    nccl = {0: replace(GLOO[0], backend="nccl")}
    assert bases.links(PLAN, MEMBERS, nccl, 1, 0.5).dsts == frozenset()  # delta links run on gloo only


def test_a_restart_or_a_refit_that_did_not_commit_loses_the_base():
    bases = DeltaBases()
    bases.committed(MEMBERS, 1)
    restarted = {**MEMBERS, "g1": replace(MEMBERS["g1"], session_id="g1-s2")}
    assert bases.links(PLAN, restarted, GLOO, 1, 0.5).dsts == {"g2"}
    trainer_restarted = {**MEMBERS, "t": replace(MEMBERS["t"], session_id="t-s2")}
    assert bases.links(PLAN, trainer_restarted, GLOO, 1, 0.5).dsts == frozenset()  # its mirror is gone
    bases.forget(["g2"])  # took part in an aborted refit: its staging may be torn
    assert bases.links(PLAN, MEMBERS, GLOO, 1, 0.5).dsts == {"g1"}


def test_replicas_that_relay_take_deltas_together_or_not_at_all():
    """A chain t -> r0 -> r1 -> r2 (fan-out) and a replica of another layout, o: the chain takes
    deltas when all three replicas hold the base; one that does not (a restart) sends the whole
    chain full, while o, alone, still takes its delta."""
    other = Catalog((W,), (local_tensor("w", "float32", Canon(W.name, W.shape)),))  # another layout
    chain = ("r0", "r1", "r2")
    plan = make_fanout_plan(
        [SourceMember("t", 0, CATALOG)], [DestMember(g, CATALOG) for g in chain] + [DestMember("o", other)]
    )
    assert plan.relay_bytes > 0
    members = {m: member(m, "trainer" if m == "t" else "generator") for m in ("t", *chain, "o")}
    gloo = {0: StageGroup(0, "refit-1/stage0", "gloo", tuple(sorted(members)))}
    bases = DeltaBases()
    bases.committed(members, 1)
    assert bases.links(plan, members, gloo, 1, 0.5).dsts == {*chain, "o"}
    for restarted in chain:  # head, middle or tail of the chain
        moved = {**members, restarted: replace(members[restarted], session_id=f"{restarted}-s2")}
        assert bases.links(plan, moved, gloo, 1, 0.5).dsts == {"o"}, restarted
