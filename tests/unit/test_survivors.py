"""What syncd's retry over survivors leaves out (`syncd.daemon.survivors.find_lost`)."""

from __future__ import annotations

from dataclasses import replace

from syncd.daemon.registry import Member
from syncd.daemon.survivors import find_lost


def _member(member_id: str, role: str, replica: int = 0, session: str = "s1") -> Member:
    coords = {"replica": replica, "tp": int(member_id[-1])} if role == "generator" else {"pp": 0}
    return Member(member_id, role, coords, "cpu", "", "sha256:x", session, 0.0)


PLANNED = {
    m.member_id: m
    for m in [
        _member("trainer-0", "trainer"),
        *(_member(f"generator-{r}-{t}", "generator", r) for r in range(3) for t in range(2)),
    ]
}


def test_a_replica_that_lost_a_worker_is_left_out_whole():
    registered = {k: v for k, v in PLANNED.items() if k != "generator-1-0"}
    lost = find_lost(PLANNED, registered)
    assert lost.members == {"generator-1-0"}
    assert lost.excluded == {"generator-1-0", "generator-1-1"}  # its other TP rank would be torn
    assert lost.reason_not_to_retry is None


def test_a_restarted_member_counts_as_lost():
    registered = {**PLANNED, "generator-2-1": replace(PLANNED["generator-2-1"], session_id="s2")}
    lost = find_lost(PLANNED, registered)
    assert lost.members == {"generator-2-1"} and lost.excluded == {"generator-2-0", "generator-2-1"}


def test_no_retry_without_a_loss_a_trainer_or_a_replica_left():
    assert find_lost(PLANNED, PLANNED).reason_not_to_retry == "no member was lost"
    without_trainer = {k: v for k, v in PLANNED.items() if k != "trainer-0"}
    assert "trainer ranks trainer-0" in find_lost(PLANNED, without_trainer).reason_not_to_retry
    only_trainer = {"trainer-0": PLANNED["trainer-0"]}
    assert find_lost(PLANNED, only_trainer).reason_not_to_retry == "no generator replica is left"
