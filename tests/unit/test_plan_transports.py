"""The pure choice of each link's transport (`syncd.plan.transports`)."""

from __future__ import annotations

from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.transports import group_backend, link_transport, plan_transports
from tests.unit.test_dataplane_gloo import trainer_catalog, vllm_catalog


def test_same_host_is_shm_only_in_gloo_groups_with_a_known_host_and_the_setting_on():
    assert link_transport("gloo", "shm", "h1", "h1") == "shm"
    assert link_transport("gloo", "shm", "h1", "h2") == "gloo"
    assert link_transport("gloo", "shm", "", "") == "gloo"  # unknown hosts never match
    assert link_transport("gloo", "network", "h1", "h1") == "gloo"
    assert link_transport("nccl", "shm", "h1", "h1") == "nccl"  # no CUDA IPC path yet
    assert group_backend("auto", ["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend("auto", ["cuda:0", "cpu"]) == "gloo"
    assert group_backend("gloo", ["cuda:0"]) == "gloo"


def test_one_plan_mixes_shared_memory_and_network_links():
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    plan = make_plan(sources, [DestMember("generator-0-0", vllm_catalog(0, 1))], bucket_bytes=256)
    members = (*(s.member_id for s in sources), "generator-0-0")
    hosts = {m: "b" if m in ("trainer-2", "trainer-3") else "a" for m in members}
    cpus = dict.fromkeys(members, "cpu")
    got = plan_transports(plan, {0: members}, hosts, cpus, "auto", "shm")
    assert got == {
        (0, "trainer-0", "generator-0-0"): "shm",
        (0, "trainer-1", "generator-0-0"): "shm",
        (0, "trainer-2", "generator-0-0"): "gloo",
        (0, "trainer-3", "generator-0-0"): "gloo",
    }
    assert set(plan_transports(plan, {0: members}, hosts, cpus, "auto", "network").values()) == {"gloo"}
