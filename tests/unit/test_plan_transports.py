"""The pure choice of each link's transport (`syncd.plan.transports`)."""

from __future__ import annotations

from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.transports import (
    Place,
    group_backend,
    ipc_group,
    link_transport,
    nccl_group_problem,
    plan_transports,
)
from tests.unit.test_dataplane_gloo import trainer_catalog, vllm_catalog


def test_same_host_is_shm_in_gloo_groups_with_a_known_host_and_the_setting_on():
    h1, h2 = Place("h1"), Place("h2")
    assert link_transport("gloo", "shm", h1, h1) == "shm"
    assert link_transport("gloo", "shm", h1, h2) == "gloo"
    assert link_transport("gloo", "shm", Place(""), Place("")) == "gloo"  # unknown hosts never match
    assert link_transport("gloo", "network", h1, h1) == "gloo"
    assert link_transport("nccl", "shm", h1, h1) == "nccl"
    assert link_transport("nccl", "shm", h1, h1, in_ipc_group=True) == "cuda_ipc"
    assert group_backend("auto", ["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend("auto", ["cuda:0", "cpu"]) == "gloo"
    assert group_backend("gloo", ["cuda:0"]) == "gloo"


def test_a_cuda_ipc_group_is_an_nccl_group_whose_members_all_share_memory():
    a, b = Place("h", "GPU-a"), Place("h", "GPU-b")
    assert ipc_group("nccl", "shm", [a, a, a])  # one GPU
    assert not ipc_group("nccl", "network", [a, a])
    assert not ipc_group("gloo", "shm", [a, a])
    assert not ipc_group("nccl", "shm", [a, b])  # two GPUs, not known to reach each other
    assert not ipc_group("nccl", "shm", [Place("h"), Place("h")])  # GPUs unknown
    assert not ipc_group("nccl", "shm", [a, Place("h2", "GPU-a")])  # a UUID never repeats across hosts
    ab, ba = Place("h", "GPU-a", frozenset({"GPU-b"})), Place("h", "GPU-b", frozenset({"GPU-a"}))
    assert ipc_group("nccl", "shm", [ab, ab, ba, ba])  # peer access both ways
    assert not ipc_group("nccl", "shm", [ab, b])  # one way only: the pair would not agree
    # GPUs a-b and b-c read each other, a-c do not: not every pair shares memory.
    bc = Place("h", "GPU-b", frozenset({"GPU-a", "GPU-c"}))
    cb = Place("h", "GPU-c", frozenset({"GPU-b"}))
    assert not ipc_group("nccl", "shm", [ab, bc, cb])


def test_one_plan_mixes_shared_memory_and_network_links():
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    plan = make_plan(sources, [DestMember("generator-0-0", vllm_catalog(0, 1))], bucket_bytes=256)
    members = (*(s.member_id for s in sources), "generator-0-0")
    hosts = {m: Place("b" if m in ("trainer-2", "trainer-3") else "a") for m in members}
    cpus = dict.fromkeys(members, "cpu")
    got = plan_transports(plan, {0: members}, hosts, cpus, "auto", "shm")
    assert got == {
        (0, "trainer-0", "generator-0-0"): "shm",
        (0, "trainer-1", "generator-0-0"): "shm",
        (0, "trainer-2", "generator-0-0"): "gloo",
        (0, "trainer-3", "generator-0-0"): "gloo",
    }
    assert set(plan_transports(plan, {0: members}, hosts, cpus, "auto", "network").values()) == {"gloo"}


def test_cuda_ipc_keeps_to_links_whose_bytes_move_as_they_are():
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    dests = [DestMember("generator-0-0", vllm_catalog(0, 1))]
    plan = make_plan(sources, dests, bucket_bytes=256)
    members = (*(s.member_id for s in sources), "generator-0-0")
    one_gpu = dict.fromkeys(members, Place("h", "GPU-a"))  # a colocated deployment
    gpus = dict.fromkeys(members, "cuda:0")
    got = plan_transports(plan, {0: members}, one_gpu, gpus, "auto", "shm")
    assert set(got.values()) == {"cuda_ipc"}
    # A generator installing as buckets arrive has no staging to copy into.
    by_layer = plan_transports(plan, {0: members}, one_gpu, gpus, "auto", "shm", {"generator-0-0"})
    assert set(by_layer.values()) == {"nccl"}
    # A trainer that converts (float32 to the generator's bfloat16): no CUDA IPC; the group has no
    # NCCL either, and the agent fails such a refit by name.
    converting = make_plan(
        sources, [DestMember("generator-0-0", vllm_catalog(0, 1, "bfloat16"))], bucket_bytes=256
    )
    assert set(plan_transports(converting, {0: members}, one_gpu, gpus, "auto", "shm").values()) == {"nccl"}


def test_an_nccl_group_shares_memory_whole_or_puts_each_member_on_a_gpu_of_its_own():
    a, b = Place("h", "GPU-a"), Place("h", "GPU-b")
    assert nccl_group_problem({"t": a, "g": a, "g2": a}, "shm") is None  # CUDA IPC: no NCCL
    assert nccl_group_problem({"t": a, "g": b}, "shm") is None  # NCCL, a GPU each
    problem = nccl_group_problem({"t": a, "g": a, "g2": b}, "shm")
    assert problem is not None and "t and g run on one GPU (GPU-a)" in problem
    assert nccl_group_problem({"t": a, "g": a}, "network") is not None  # NCCL between them: refused
    ab, ba = Place("h", "GPU-a", frozenset({"GPU-b"})), Place("h", "GPU-b", frozenset({"GPU-a"}))
    assert nccl_group_problem({"t": ab, "g": ab, "t2": ba, "g2": ba}, "shm") is None
