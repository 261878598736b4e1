"""A lost generator replica does not freeze the fleet: refits go on over the replicas there while
every layout keeps enough of them, the missing ones are reported, the retry of a refit that lost
one commits even when the trainers step on meanwhile, and a replica that comes back behind is
caught up on its own."""

from __future__ import annotations

import threading

from syncd_harness import SECOND_REPLICA, Cluster, wait_until

from syncd.commands import Abort, ExecutePlan

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
    # The replica that kept serving version 2 is not refitted again: the catch-up reaches only
    # the replica behind.
    assert cluster.members["generator-0-0"].committed == [1, 2]
    catch_up = cluster.http.get("/v1/refits").json()["refits"][0]
    assert (catch_up["weight_version"], catch_up["state"], catch_up["left_out"]) == (2, "COMMITTED", [])
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


def test_the_survivors_retry_commits_when_the_trainers_step_on_meanwhile(make_cluster) -> None:
    """A trainer whose wait for a version ends with that version's abort trains on; syncd's retry
    over the survivors then moves the trainers' newest version, and commits."""
    cluster = make_cluster(expected_generators=TWO_REPLICAS)
    held = [1]  # the version the trainer ranks hold

    def trainer_execute(cmd: ExecutePlan) -> None:
        if cmd.weight_version != held[0]:
            raise ValueError(
                f"refit {cmd.refit_id} moves weight version {cmd.weight_version}, "
                f"but this rank holds version {held[0]}"
            )

    def step_on(cmd: Abort) -> None:
        """The trainer's wait ended with the abort: its next step is done, and announced, only
        once syncd's retry has begun (the race a real trainer loses)."""
        if held[0] == 2:
            held[0] = 3
            threading.Timer(0.5, cluster.announce, args=(3,)).start()

    trainer = {"on_execute": trainer_execute}
    start_two_replicas(
        cluster,
        **{
            "trainer-0": {**trainer, "on_abort": step_on},
            "trainer-1": trainer,
        },
    )
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"
    cluster.members["generator-1-0"].behaviour.die_on_execute = True  # cut off mid-refit
    held[0] = 2
    first = cluster.refit(weight_version=2)["id"]
    aborted = cluster.wait_refit(first)
    assert aborted["state"] == "ABORTED" and "generator-1-0" in aborted["error"], aborted

    def committed_retry() -> dict | None:
        refits = cluster.http.get("/v1/refits").json()["refits"]
        return next((r for r in refits if r["state"] == "COMMITTED" and r["weight_version"] > 1), None)

    wait_until(lambda: committed_retry() is not None, timeout=60, what="a retry over the survivors to commit")
    retry = committed_retry()
    assert retry is not None and retry["weight_version"] == 3, retry
    assert retry["left_out"] == ["generator-1-0", "generator-1-1"]
    assert cluster.members["generator-0-0"].committed == [1, 3]
