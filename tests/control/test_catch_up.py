"""Catch-up, syncd side: a generator that registers behind the committed version (restarted,
serving its start-up checkpoint) makes syncd not ready and is caught up by a refit of the weights
the trainers hold, without waiting for the next training step."""

from __future__ import annotations

import threading

from syncd_harness import Cluster, wait_until

from syncd.commands import ExecutePlan


def test_a_restarted_generator_is_held_not_ready_then_caught_up(cluster: Cluster) -> None:
    cluster.start_all()
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"

    hold = threading.Event()
    cluster.members.pop("generator-0-1").client.close()  # restarts, serving its --model checkpoint
    back = cluster.start_member("generator-0-1", on_execute=lambda _: hold.wait(30))
    wait_until(
        lambda: cluster.http.get("/v1/status").json()["state"] == "TRANSFERRING", what="catch-up refit"
    )
    # Registration tells the member it is behind (generator_svc's /readyz is built on this).
    assert (back.client.weight_version, back.client.committed_version) == (None, 1)
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 503
    assert (
        "generator-0-1 serves an unknown version" in ready.json()["reason"]
        and "catch-up" in ready.json()["reason"]
    )

    hold.set()
    wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="caught up")
    assert cluster.members["generator-0-1"].committed == [1]
    assert (back.client.weight_version, back.client.committed_version) == (1, 1)
    refits = cluster.http.get("/v1/refits").json()["refits"]
    assert [(r["weight_version"], r["state"]) for r in refits] == [(1, "COMMITTED"), (1, "COMMITTED")]


def test_a_generator_that_reports_the_committed_version_needs_no_catch_up(cluster: Cluster) -> None:
    cluster.start_all()
    assert cluster.wait_refit(cluster.refit(weight_version=4)["id"])["state"] == "COMMITTED"
    cluster.members.pop("generator-0-1").client.close()
    back = cluster.start_member("generator-0-1", weight_version=4)  # it kept serving version 4
    assert back.client.wait_registered()
    wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="ready")
    assert not back.of_type(ExecutePlan)
    assert len(cluster.http.get("/v1/refits").json()["refits"]) == 1
