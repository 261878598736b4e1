"""Whatever fails, including the store, every refit ends and the refit slot
comes back; health and abort answer at once even while work is stuck."""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from syncd_harness import Cluster, wait_until

from syncd.commands import ExecutePlan


def hold_write_lock(db: str) -> sqlite3.Connection:
    """What a backup or an operator's `sqlite3` shell does: take SQLite's write lock and keep it."""
    holder = sqlite3.connect(db, timeout=10, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_refit_ends_and_slot_returns_while_the_store_is_locked(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    locked = threading.Event()
    holder: list[sqlite3.Connection] = []

    def lock_then_fail(_: ExecutePlan) -> None:
        holder.append(hold_write_lock(cluster.daemon.settings.db))
        locked.set()
        raise RuntimeError("transport broke")  # the member reports TRANSFERRED failed

    cluster.start_all(**{"generator-0-0": {"on_execute": lock_then_fail}})
    refit_id = cluster.refit(weight_version=1)["id"]
    wait_until(locked.is_set, what="the store to be locked")

    # Recording ABORTED cannot be written yet; the refit still ends and the slot is free.
    done = cluster.wait_refit(refit_id)
    assert done["state"] == "ABORTED" and "transport broke" in done["error"]
    wait_until(lambda: cluster.http.get("/v1/status").json()["state"] == "IDLE", what="slot free")

    holder[0].rollback()
    holder[0].close()
    cluster.members["generator-0-0"].behaviour.on_execute = None
    second = cluster.refit(weight_version=2)
    assert cluster.wait_refit(second["id"])["state"] == "COMMITTED"
    # The first outcome reached the database once the lock was gone.
    rows = (
        sqlite3.connect(cluster.daemon.settings.db)
        .execute("SELECT id, state FROM refits ORDER BY seq")
        .fetchall()
    )
    assert rows == [(refit_id, "ABORTED"), (second["id"], "COMMITTED")]


def test_health_and_abort_answer_while_many_aborts_are_outstanding(cluster: Cluster) -> None:
    release = threading.Event()
    cluster.start_all(**{"trainer-0": {"on_execute": lambda _: release.wait(30)}})
    # The store is locked for the whole test: nothing syncd does may wait behind it.
    refit_id = cluster.refit(weight_version=1)["id"]
    wait_until(lambda: cluster.http.get("/v1/status").json()["state"] == "TRANSFERRING", what="transfer")
    holder = hold_write_lock(cluster.daemon.settings.db)
    try:
        with httpx.Client(base_url=cluster.url, timeout=60) as client, ThreadPoolExecutor(60) as pool:
            aborts = [pool.submit(client.post, f"/v1/refits/{refit_id}/abort") for _ in range(50)]
            # A Kubernetes probe gives up after a few seconds; syncd must answer within them.
            with httpx.Client(base_url=cluster.url, timeout=5) as probe:
                assert probe.get("/healthz").status_code == 200
                assert probe.get("/metrics").status_code == 200
            answers = [f.result() for f in aborts]
        states = {(a.status_code, a.json().get("state")) for a in answers}
        assert (200, "ABORTED") in states
        assert states <= {(200, "ABORTED"), (409, None)}
    finally:
        holder.rollback()
        holder.close()
        release.set()
