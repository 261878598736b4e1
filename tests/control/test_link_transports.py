"""Which transport carries each link: members report their host (and GPU), syncd marks the links
between members of one host as shared memory (between members on one GPU, CUDA IPC) in the plan
view (`syncctl plan`), in each member's JoinGroup and (CUDA IPC) in its ExecutePlan, and the others
as the group's backend; one plan mixes both."""

from __future__ import annotations

import json

from syncd_harness import MEMBERS, Cluster
from test_syncctl import syncctl

from syncd.commands import ExecutePlan, JoinGroup

# trainer-0 (stage 0) shares a host with generator-0-0, trainer-1 (stage 1) with generator-0-1.
HOSTS = {"trainer-0": "host-a", "generator-0-0": "host-a", "trainer-1": "host-b", "generator-0-1": "host-b"}


def _shown_links(cluster: Cluster) -> dict[tuple[str, str], str]:
    shown = syncctl(cluster.url, "plan", "--json")
    assert shown.returncode == 0, shown.stderr
    return {(k["src"], k["dst"]): k["transport"] for k in json.loads(shown.stdout)["links"]}


def test_links_between_members_of_one_host_go_through_shared_memory(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    for member_id in MEMBERS:
        cluster.start_member(member_id, host_id=HOSTS[member_id])
    links = _shown_links(cluster)
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


def _assert_cuda_ipc_everywhere(cluster: Cluster) -> None:
    links = _shown_links(cluster)
    assert set(links.values()) == {"cuda_ipc"}, links
    assert " cuda_ipc " in syncctl(cluster.url, "plan").stdout

    refit = cluster.refit(weight_version=1)
    assert cluster.wait_refit(refit["id"])["state"] == "COMMITTED"
    for member_id, member in cluster.members.items():
        for join in member.of_type(JoinGroup):
            assert join.backend == "nccl" and set(join.links) == {"cuda_ipc"}, (member_id, join)
        (execute,) = member.of_type(ExecutePlan)
        mine = {(b.stage, b.src, b.dst) for b in execute.buckets}
        assert execute.ipc_links == mine, member_id


def test_links_between_members_on_one_gpu_go_through_cuda_ipc(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    for member_id in MEMBERS:  # a colocated deployment: trainers and generator workers on one GPU
        cluster.start_member(member_id, host_id="host-a", device="cuda:0", gpu_id="GPU-a")
    _assert_cuda_ipc_everywhere(cluster)


def test_members_on_gpus_that_read_each_others_memory_link_through_cuda_ipc(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    # Each trainer rank shares a GPU with a generator worker, and the two GPUs reach each other.
    gpus = {"trainer-0": "GPU-a", "generator-0-0": "GPU-a", "trainer-1": "GPU-b", "generator-0-1": "GPU-b"}
    others = {"GPU-a": ("GPU-b",), "GPU-b": ("GPU-a",)}
    for member_id, gpu in gpus.items():
        cluster.start_member(member_id, host_id="host-a", device="cuda:0", gpu_id=gpu, gpu_peers=others[gpu])
    _assert_cuda_ipc_everywhere(cluster)


def test_an_nccl_group_with_two_members_on_one_gpu_among_others_is_refused_by_name(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    gpus = {"trainer-0": "GPU-a", "generator-0-0": "GPU-a", "trainer-1": "GPU-b", "generator-0-1": "GPU-c"}
    for member_id in MEMBERS:
        cluster.start_member(member_id, host_id="host-a", device="cuda:0", gpu_id=gpus[member_id])
    assert set(_shown_links(cluster).values()) == {"nccl"}  # not every pair shares memory

    refit = cluster.refit(weight_version=1)
    done = cluster.wait_refit(refit["id"])
    assert done["state"] == "ABORTED", done
    assert "NCCL refuses two ranks on one GPU" in done["error"], done
    assert not any(m.of_type(JoinGroup) for m in cluster.members.values())  # refused before any join
