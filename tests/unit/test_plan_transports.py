"""The pure choice of each link's transport (`syncd.plan.transports`)."""

from __future__ import annotations

from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.transports import Place, group_backend, link_transport, nccl_group_problem, plan_transports
from tests.unit.test_dataplane_gloo import trainer_catalog, vllm_catalog


def test_same_host_is_shm_in_gloo_groups_and_cuda_ipc_on_one_gpu_with_the_setting_on():
    h1, h2 = Place("h1"), Place("h2")
    assert link_transport("gloo", "shm", h1, h1) == "shm"
    assert link_transport("gloo", "shm", h1, h2) == "gloo"
    assert link_transport("gloo", "shm", Place(""), Place("")) == "gloo"  # unknown hosts never match
    assert link_transport("gloo", "network", h1, h1) == "gloo"
    a, b = Place("h1", "GPU-a"), Place("h1", "GPU-b")
    assert link_transport("nccl", "shm", a, a) == "cuda_ipc"
    assert link_transport("nccl", "shm", a, b) == "nccl"  # another GPU of the host
    assert link_transport("nccl", "shm", h1, h1) == "nccl"  # GPUs unknown
    assert (
        link_transport("nccl", "shm", a, Place("h2", "GPU-a")) == "nccl"
    )  # a UUID never repeats across hosts
    assert link_transport("nccl", "network", a, a) == "nccl"
    assert group_backend("auto", ["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend("auto", ["cuda:0", "cpu"]) == "gloo"
    assert group_backend("gloo", ["cuda:0"]) == "gloo"


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
    one_gpu = dict.fromkeys(members, Place("h", "GPU-a"))
    gpus = dict.fromkeys(members, "cuda:0")
    got = plan_transports(plan, {0: members}, one_gpu, gpus, "auto", "shm")
    assert set(got.values()) == {"cuda_ipc"}
    # A generator installing as buckets arrive has no staging to copy into.
    by_layer = plan_transports(plan, {0: members}, one_gpu, gpus, "auto", "shm", {"generator-0-0"})
    assert set(by_layer.values()) == {"nccl"}
    # A trainer that converts (float32 to the generator's bfloat16) sends through NCCL.
    converting = make_plan(
        sources, [DestMember("generator-0-0", vllm_catalog(0, 1, "bfloat16"))], bucket_bytes=256
    )
    assert set(plan_transports(converting, {0: members}, one_gpu, gpus, "auto", "shm").values()) == {"nccl"}


def test_an_nccl_group_may_share_one_gpu_whole_or_not_at_all():
    a, b = Place("h", "GPU-a"), Place("h", "GPU-b")
    assert nccl_group_problem({"t": a, "g": a, "g2": a}, "shm") is None  # all CUDA IPC: no NCCL
    assert nccl_group_problem({"t": a, "g": b}, "shm") is None  # NCCL, a GPU each
    problem = nccl_group_problem({"t": a, "g": a, "g2": b}, "shm")
    assert problem is not None and "t and g run on one GPU (GPU-a)" in problem
    assert nccl_group_problem({"t": a, "g": a}, "network") is not None  # NCCL between them: refused
