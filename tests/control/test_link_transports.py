"""Which transport carries each link: members report their host, syncd marks the links between
members of one host as shared memory in the plan view (`syncctl plan`) and in each member's
JoinGroup, and the others as the group's backend; one plan mixes both."""

from __future__ import annotations

import json

from syncd_harness import MEMBERS, Cluster
from test_syncctl import syncctl

from syncd.commands import JoinGroup

# trainer-0 (stage 0) shares a host with generator-0-0, trainer-1 (stage 1) with generator-0-1.
HOSTS = {"trainer-0": "host-a", "generator-0-0": "host-a", "trainer-1": "host-b", "generator-0-1": "host-b"}


def test_links_between_members_of_one_host_go_through_shared_memory(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    for member_id in MEMBERS:
        cluster.start_member(member_id, host_id=HOSTS[member_id])
    shown = syncctl(cluster.url, "plan", "--json")
    assert shown.returncode == 0, shown.stderr
    links = {(k["src"], k["dst"]): k["transport"] for k in json.loads(shown.stdout)["links"]}
    assert links == {
        ("trainer-0", "generator-0-0"): "shm",
        ("trainer-0", "generator-0-1"): "gloo",
        ("trainer-1", "generator-0-0"): "gloo",
        ("trainer-1", "generator-0-1"): "shm",
    }
    table = syncctl(cluster.url, "plan").stdout
    assert "TRANSPORT" in table and " shm " in table and " gloo " in table

    refit = cluster.refit(weight_version=1)
    assert cluster.wait_refit(refit["id"])["state"] == "COMMITTED"
    for member_id, member in cluster.members.items():
        for join in member.of_type(JoinGroup):
            expected = tuple("shm" if HOSTS[m] == HOSTS[member_id] else "gloo" for m in join.members)
            assert join.links == expected, (member_id, join.stage, join.links)
