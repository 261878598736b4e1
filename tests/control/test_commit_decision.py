"""The commit decision is written before any member hears Commit, survives syncd being
killed, and a member that does not confirm Commit is recorded as unconfirmed, not as a failure."""

from __future__ import annotations

from pathlib import Path

import httpx
from syncd_harness import MEMBERS, Cluster, SyncdProcess, make_member, wait_until

from syncd.commands import Abort, Commit
from syncd.net import free_port


def test_syncd_killed_after_sending_commit_comes_back_committed(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    ports = (free_port(), free_port())
    args = (
        "--lease-seconds",
        "5",
        "--expected-trainers",
        "2",
        "--expected-generators",
        "2",
        "--bucket-bytes",
        "256",
    )
    syncd = SyncdProcess(db, *ports, *args).start()
    members = [make_member(syncd.target, member_id) for member_id in MEMBERS]

    def install_then_kill_syncd(cmd: Commit) -> None:
        generator.committed.append(cmd.weight_version)  # the generator now runs the new weights
        generator.behaviour.on_commit = None  # once: later Commits (a catch-up) are confirmed
        syncd.kill()  # before anyone confirmed: syncd never learns that Commit arrived

    generator = members[2]
    generator.behaviour.on_commit = install_then_kill_syncd
    http = httpx.Client(base_url=syncd.url, timeout=30)
    try:
        for m in members:
            m.client.start(m.handle)
        wait_until(lambda: http.get("/readyz").status_code == 200, what="ready")
        members[0].client.announce_version(2)
        refit_id = http.post("/v1/refits", json={"weight_version": 2}).json()["id"]
        wait_until(lambda: generator.committed == [2], what="the generator to install v2")

        syncd = SyncdProcess(db, *ports, *args).start()
        status = http.get("/v1/status").json()
        assert status["committed_version"] == 2, "syncd must not deny the version generators run"
        record = http.get(f"/v1/refits/{refit_id}").json()
        assert record["state"] == "COMMITTED"
        assert set(record["unconfirmed"]) == set(MEMBERS) and "stopped" in record["error"]
    finally:
        http.close()
        for m in members:
            m.client.close()
        syncd.stop()


def test_member_silent_on_commit_is_unconfirmed_not_aborted(make_cluster) -> None:
    cluster: Cluster = make_cluster(commit_timeout=2)
    cluster.start_all(**{"generator-0-1": {"on_commit": lambda cmd: None}})
    done = cluster.wait_refit(cluster.refit(weight_version=5)["id"])

    assert done["state"] == "COMMITTED"
    assert done["unconfirmed"] == ["generator-0-1"]
    assert "generator-0-1" in done["error"] and "did not confirm" in done["error"]
    assert cluster.http.get("/v1/status").json()["committed_version"] == 5
    assert cluster.members["generator-0-0"].committed == [5]
    assert not any(m.of_type(Abort) for m in cluster.members.values()), "no Abort after a commit decision"


def test_abort_after_the_commit_decision_is_refused(make_cluster) -> None:
    cluster: Cluster = make_cluster(commit_timeout=30)
    answer: list[httpx.Response] = []

    def abort_while_committing(cmd: Commit) -> None:
        answer.append(cluster.http.post(f"/v1/refits/{cmd.refit_id}/abort"))
        cluster.members["generator-0-0"].committed.append(cmd.weight_version)
        cluster.members["generator-0-0"].client.report(cmd.refit_id, "COMMITTED")

    cluster.start_all(**{"generator-0-0": {"on_commit": abort_while_committing}})
    done = cluster.wait_refit(cluster.refit(weight_version=6)["id"])
    assert answer[0].status_code == 409 and "commit decision" in answer[0].json()["error"]["message"]
    assert done["state"] == "COMMITTED" and done["unconfirmed"] == []
