"""Member reports are checked against the plan before any decision; a plan that
moves nothing commits nothing."""

from __future__ import annotations

import pytest
from syncd_harness import Cluster

from syncd.commands import Commit
from syncd.layout import Catalog
from syncd.member.client import MemberClient
from tests.polling import wait_until

PLAN_BYTES = 2 * 16 * 8 * 4 + 4 * 6 * 8 * 2


@pytest.mark.parametrize("reported", [0, -5, 2**63 - 1], ids=["zero", "negative", "int64-max"])
def test_receivers_reporting_other_bytes_than_the_plan_abort_before_commit(
    cluster: Cluster, reported: int
) -> None:
    cluster.start_all(**{g: {"reported_bytes": reported} for g in ("generator-0-0", "generator-0-1")})
    done = cluster.wait_refit(cluster.refit(weight_version=3)["id"])

    assert done["state"] == "ABORTED"
    assert f"reported {reported} bytes" in done["error"] and "its part of the plan moves" in done["error"]
    assert cluster.http.get("/v1/status").json()["committed_version"] is None
    assert not any(m.of_type(Commit) for m in cluster.members.values())
    # The slot is free: honest members commit the next refit.
    for g in ("generator-0-0", "generator-0-1"):
        cluster.members[g].behaviour.reported_bytes = None
    again = cluster.wait_refit(cluster.refit(weight_version=4)["id"])
    assert again["state"] == "COMMITTED" and again["bytes"] == PLAN_BYTES


def test_empty_catalogs_commit_nothing(make_cluster) -> None:
    cluster: Cluster = make_cluster(expected_trainers=1, expected_generators=1)
    empty = Catalog((), ())
    clients = [
        MemberClient(cluster.target, role="trainer", member_id="trainer-0", coords={"pp": 0}, catalog=empty),
        MemberClient(
            cluster.target, role="generator", member_id="generator-0-0", coords={"tp": 0}, catalog=empty
        ),
    ]
    commits: list[object] = []
    try:
        for c in clients:
            c.start(lambda cmd: commits.append(cmd) if isinstance(cmd, Commit) else None)
        wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="ready")
        clients[0].announce_version(42)
        done = cluster.wait_refit(cluster.refit()["id"])
    finally:
        for c in clients:
            c.close()
    assert done["state"] == "ABORTED" and "moves no bytes" in done["error"]
    assert cluster.http.get("/v1/status").json()["committed_version"] is None
    assert not commits
