"""syncd run as `python -m syncd`: refit history and the committed version survive a restart,
members re-register on their own, and syncd is ready to refit again."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from syncd_harness import MEMBERS, SyncdProcess, make_member, wait_until

from syncd.commands import Abort
from syncd.net import free_port


def test_restart_keeps_history_and_members_come_back(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    syncd = SyncdProcess(
        db,
        free_port(),
        free_port(),
        "--lease-seconds",
        "5",
        "--expected-trainers",
        "2",
        "--expected-generators",
        "2",
        "--bucket-bytes",
        "256",
    ).start()
    members = [make_member(syncd.target, member_id) for member_id in MEMBERS]
    http = httpx.Client(base_url=syncd.url, timeout=30)
    try:
        for m in members:
            m.client.start(m.handle)
        wait_until(lambda: http.get("/readyz").status_code == 200, what="ready")
        members[0].client.announce_version(11)
        refit_id = http.post("/v1/refits").json()["id"]
        wait_until(lambda: http.get(f"/v1/refits/{refit_id}").json()["state"] == "COMMITTED", what="commit")

        assert syncd.stop() == 0
        sessions = {m.member_id: m.client.session_id for m in members}
        syncd.start()
        wait_until(lambda: http.get("/readyz").status_code == 200, what="members to re-register")

        status = http.get("/v1/status").json()
        assert status["committed_version"] == 11 and status["announced_version"] == 11
        history = http.get("/v1/refits").json()["refits"]
        assert [(r["id"], r["state"], r["weight_version"]) for r in history] == [(refit_id, "COMMITTED", 11)]
        wait_until(
            lambda: all(m.client.session_id != sessions[m.member_id] for m in members), what="new sessions"
        )
        assert "weightsync_syncd_committed_weight_version 11.0" in http.get("/metrics").text

        members[0].client.announce_version(12)
        second = http.post("/v1/refits", json={"weight_version": 12}).json()["id"]
        assert second != refit_id
        wait_until(
            lambda: http.get(f"/v1/refits/{second}").json()["state"] == "COMMITTED", what="second commit"
        )
        assert all(m.committed == [11, 12] for m in members)
    finally:
        http.close()
        for m in members:
            m.client.close()
        syncd.stop()


def test_stopping_syncd_mid_refit_records_it_aborted(make_cluster) -> None:
    first = make_cluster()
    release = threading.Event()
    first.start_all(**{"trainer-0": {"on_execute": lambda _: release.wait(20)}})
    refit_id = first.refit(weight_version=1)["id"]
    wait_until(lambda: first.http.get("/v1/status").json()["state"] == "TRANSFERRING", what="transfer")
    first.daemon.stop()
    release.set()
    wait_until(lambda: all(m.of_type(Abort) for m in first.members.values()), what="Abort everywhere")

    second = make_cluster()  # same database file
    record = second.http.get(f"/v1/refits/{refit_id}").json()
    assert record["state"] == "ABORTED" and "shutting down" in record["error"]
    assert second.http.get("/v1/status").json()["state"] == "IDLE"


def test_a_refit_killed_with_syncd_keeps_the_phases_it_reached(tmp_path: Path) -> None:
    """kill -9 mid-transfer leaves a record naming TRANSFERRING."""
    db, ports = tmp_path / "state.db", (free_port(), free_port())
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
    release = threading.Event()
    members = [make_member(syncd.target, member_id) for member_id in MEMBERS]
    members[0].behaviour.on_execute = lambda _: release.wait(30)
    http = httpx.Client(base_url=syncd.url, timeout=30)
    try:
        for m in members:
            m.client.start(m.handle)
        wait_until(lambda: http.get("/readyz").status_code == 200, what="ready")
        members[0].client.announce_version(1)
        planned = http.get("/v1/plan").json()["total_bytes"]
        refit_id = http.post("/v1/refits", json={}).json()["id"]
        wait_until(
            lambda: http.get(f"/v1/refits/{refit_id}").json()["state"] == "TRANSFERRING", what="transfer"
        )
        syncd.kill()
        release.set()
        syncd = SyncdProcess(db, *ports, *args).start()
        record = http.get(f"/v1/refits/{refit_id}").json()
        assert record["state"] == "ABORTED" and "stopped during the refit" in record["error"]
        assert {"PREPARING", "TRANSFERRING"} <= set(record["phases"])
        assert (record["bytes"], record["planned_bytes"]) == (0, planned)  # nothing confirmed, the plan known
    finally:
        http.close()
        for m in members:
            m.client.close()
        syncd.stop()
