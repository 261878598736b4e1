"""A lost generator replica does not freeze the fleet: refits go on over the replicas there while
every layout keeps enough of them, the missing ones are reported, the retry of a refit that lost
one commits even when the trainers step on meanwhile, and a replica that comes back behind is
caught up on its own."""

from __future__ import annotations

import threading

from syncd_harness import SECOND_REPLICA, Cluster, wait_until

from syncd.commands import ExecutePlan

TWO_REPLICAS = 4  # generator workers: two replicas of TP 2


def start_two_replicas(cluster: Cluster, **behaviour_by_member: dict) -> None:
    for member_id in SECOND_REPLICA:
        cluster.start_member(member_id, **behaviour_by_member.get(member_id, {}))
    cluster.start_all(**behaviour_by_member)


def missing_metric(cluster: Cluster) -> float:
    for line in cluster.http.get("/metrics").text.splitlines():
        if line.startswith("weightsync_syncd_missing_generators "):
            return float(line.split()[1])
    raise AssertionError("no weightsync_syncd_missing_generators in /metrics")


def test_refits_go_on_without_a_missing_replica_which_is_caught_up_when_it_returns(make_cluster) -> None:
    cluster = make_cluster(expected_generators=TWO_REPLICAS)
    start_two_replicas(cluster)
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"

    cluster.members.pop("generator-1-0").client.close()  # a bad NIC, a preempted node
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["missing_generators"] == ["generator-1-0"]
    assert "generator-1-0" in ready.json()["reason"] and "refits go on" in ready.json()["reason"]
    status = cluster.http.get("/v1/status").json()
    assert status["readiness"]["missing_generators"] == ["generator-1-0"]
    assert missing_metric(cluster) == 1

    done = cluster.wait_refit(cluster.refit(weight_version=2)["id"])
    assert done["state"] == "COMMITTED", done
    # Its replica's other worker is left out with it: half a replica never installs a version.
    assert done["left_out"] == ["generator-1-0", "generator-1-1"]
    assert cluster.members["generator-0-0"].committed == [1, 2]
    assert cluster.members["generator-1-1"].committed == [1]

    hold = threading.Event()
    back = cluster.start_member("generator-1-0", on_execute=lambda _: hold.wait(30))
    wait_until(lambda: back.of_type(ExecutePlan), what="the catch-up refit to reach it")
    assert cluster.http.get("/readyz").status_code == 503  # it serves nothing committed yet
    hold.set()
    wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="caught up")
    assert back.committed == [2] and cluster.members["generator-1-1"].committed == [1, 2]
    ready = cluster.http.get("/readyz").json()
    assert (ready["reason"], ready["missing_generators"]) == ("", [])
    assert missing_metric(cluster) == 0


def test_too_few_replicas_of_a_layout_stop_refits_naming_the_minimum(make_cluster) -> None:
    cluster = make_cluster(expected_generators=TWO_REPLICAS, min_replicas_per_layout=2)
    start_two_replicas(cluster)
    cluster.members.pop("generator-1-1").client.close()
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 503
    assert "--min-replicas-per-layout 2" in ready.json()["reason"]
    assert ready.json()["missing_generators"] == ["generator-1-1"]
    cluster.announce(1)
    refused = cluster.http.post("/v1/refits", json={"weight_version": 1})
    assert refused.status_code == 409 and "--min-replicas-per-layout 2" in refused.text


def test_a_refit_waits_for_a_generator_that_never_registered(make_cluster) -> None:
    """Before the fleet was whole once, a missing generator has not arrived yet: as at start-up,
    refits wait for it."""
    cluster = make_cluster(expected_generators=TWO_REPLICAS)
    for member_id in ("trainer-0", "trainer-1", "generator-0-0", "generator-0-1"):
        cluster.start_member(member_id)
    wait_until(lambda: "2 of 4 generators registered" in cluster.http.get("/readyz").text, what="503")
    assert cluster.http.get("/readyz").json()["missing_generators"] == []
