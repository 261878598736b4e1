"""A member that stops leaves syncd (`MemberClient.close` -> Leave): its session ends at once, as a
lost lease would end it, and its id can register again without waiting the lease out.

The leases here outlast every test, so nothing that follows a Leave can be the lease's doing."""

from __future__ import annotations

import threading

from syncd_harness import wait_until

from syncd.commands import Commit, ExecutePlan, Phase

LONG_LEASE_S = 600.0


def _members(cluster) -> list[str]:
    return [m["member_id"] for m in cluster.http.get("/v1/members").json()["members"]]


def test_a_member_that_leaves_is_gone_at_once_and_its_id_registers_again(make_cluster) -> None:
    cluster = make_cluster(lease_seconds=LONG_LEASE_S)
    cluster.start_all()
    cluster.members.pop("generator-0-1").client.close()  # returns once syncd took the Leave
    assert "generator-0-1" not in _members(cluster)
    assert 'weightsync_syncd_members{role="generator"} 1.0' in cluster.http.get("/metrics").text
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 503 and "generator" in ready.json()["reason"]

    # Before Leave, its old session held the id until the lease ran out (AlreadyExists until then).
    assert cluster.start_member("generator-0-1").client.wait_registered(timeout=20)
    wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="syncd ready again")
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"
    assert cluster.members["generator-0-1"].committed == [1]


def test_a_member_that_leaves_mid_refit_aborts_it_naming_the_member(make_cluster) -> None:
    cluster = make_cluster(lease_seconds=LONG_LEASE_S)
    executing, release = threading.Event(), threading.Event()

    def stall(_: ExecutePlan) -> None:
        executing.set()
        release.wait(30)

    cluster.start_all(**{"generator-0-0": {"on_execute": stall}})
    refit_id = cluster.refit(weight_version=1)["id"]
    try:
        wait_until(executing.is_set, what="the transfer to start")
        leaver = cluster.members.pop("generator-0-1")
        leaver.client.close()
        done = cluster.wait_refit(refit_id)
    finally:
        release.set()
    assert done["state"] == "ABORTED"
    assert "generator-0-1" in done["error"] and "it left" in done["error"], done["error"]
    assert not leaver.committed
    assert cluster.http.get("/v1/status").json()["committed_version"] is None


def test_a_member_that_leaves_after_confirming_commit_leaves_the_refit_clean(make_cluster) -> None:
    """A synchronous trainer's last step: it confirms Commit and exits while a generator has yet to."""
    cluster = make_cluster(lease_seconds=LONG_LEASE_S)
    holding, release = threading.Event(), threading.Event()

    def confirm_late(cmd: Commit) -> None:
        holding.set()
        release.wait(30)
        late = cluster.members["generator-0-0"]
        late.committed.append(cmd.weight_version)
        late.client.report(cmd.refit_id, Phase.COMMITTED)

    cluster.start_all(**{"generator-0-0": {"on_commit": confirm_late}})
    refit_id = cluster.refit(weight_version=1)["id"]
    try:
        wait_until(holding.is_set, what="the generator holding its confirmation")
        trainer = cluster.members.pop("trainer-0")
        wait_until(lambda: trainer.client.committed_version == 1, what="trainer-0's confirmation")
        trainer.client.close()
    finally:
        release.set()
    done = cluster.wait_refit(refit_id)
    assert (done["state"], done["error"], done["unconfirmed"]) == ("COMMITTED", "", [])
