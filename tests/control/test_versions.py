"""Weight versions belong to a training run. A restarted trainer job numbers
its steps from 1 again; syncd must move its versions (auto-refit too), never mix up two weight
sets under one label, refuse versions no trainer holds and roll back only when told to."""

from __future__ import annotations

import grpc
import pytest
from syncd_harness import Cluster, wait_until


def committed(cluster: Cluster) -> tuple:
    s = cluster.http.get("/v1/status").json()
    return s["committed_run"], s["committed_version"]


def test_a_restarted_trainer_job_is_refitted_by_auto_refit(make_cluster) -> None:
    cluster: Cluster = make_cluster(auto_refit=True)
    cluster.start_all(run_id="job-a")
    cluster.announce(3)
    wait_until(lambda: committed(cluster) == ("job-a", 3), what="job-a v3 committed")
    cluster.announce(2**63 - 1)  # a buggy announcement pins nothing beyond its own run
    wait_until(lambda: committed(cluster) == ("job-a", 2**63 - 1), what="the huge version committed")

    cluster.restart_trainers("job-b")  # resumed from an export: its steps count from 1 again
    cluster.announce(1)
    wait_until(lambda: committed(cluster) == ("job-b", 1), what="job-b v1 committed by auto-refit")
    assert cluster.members["generator-0-0"].committed == [3, 2**63 - 1, 1]

    # Two weight sets called "version 1" or "3" never share a label: each refit names its run.
    refits = cluster.http.get("/v1/refits").json()["refits"]
    assert [(r["run_id"], r["weight_version"], r["state"]) for r in refits] == [
        ("job-b", 1, "COMMITTED"),
        ("job-a", 2**63 - 1, "COMMITTED"),
        ("job-a", 3, "COMMITTED"),
    ]


def test_the_old_job_cannot_announce_after_a_new_job_registered(cluster: Cluster) -> None:
    cluster.start_all(run_id="job-a")
    old_rank = cluster.members["trainer-0"]
    cluster.members.pop("trainer-0")
    cluster.start_member("trainer-0", run_id="job-b")  # refused while job-a's rank holds the lease
    old_rank.client.close()
    assert cluster.members["trainer-0"].client.wait_registered()
    status = cluster.http.get("/v1/status").json()
    assert status["announced_run"] == "job-b" and status["announced_version"] is None

    with pytest.raises(grpc.RpcError) as refused:
        cluster.members["trainer-1"].client.announce_version(7)  # still job-a's rank
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "superseded" in refused.value.details()
    ready = cluster.http.get("/readyz")
    assert (
        ready.status_code == 503 and "trainer-1 belong to a superseded training run" in ready.json()["reason"]
    )


def test_triggers_of_versions_no_trainer_holds_are_refused(cluster: Cluster) -> None:
    cluster.start_all(run_id="job-a")
    cluster.announce(5)
    for version in (4, 6):
        r = cluster.http.post("/v1/refits", json={"weight_version": version})
        assert r.status_code == 409 and "not held by the trainers" in r.json()["error"]["message"], r.text
    assert cluster.http.get("/v1/refits").json()["refits"] == []
    assert cluster.wait_refit(cluster.refit(weight_version=5)["id"])["state"] == "COMMITTED"


def test_a_rollback_needs_the_explicit_flag(cluster: Cluster) -> None:
    cluster.start_all(run_id="job-a")
    assert cluster.wait_refit(cluster.refit(weight_version=5)["id"])["state"] == "COMMITTED"

    cluster.restart_trainers("job-a", weight_version=2)  # same job, resumed from an older checkpoint
    wait_until(lambda: cluster.http.get("/v1/status").json()["announced_version"] == 2, what="v2 held")
    refused = cluster.http.post("/v1/refits", json={})
    assert refused.status_code == 409 and "roll back" in refused.json()["error"]["message"]
    assert committed(cluster) == ("job-a", 5)

    rollback = cluster.refit(allow_rollback=True)
    assert cluster.wait_refit(rollback["id"])["state"] == "COMMITTED"
    assert committed(cluster) == ("job-a", 2)
