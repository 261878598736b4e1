"""Refits of named LoRA adapters into the generators' slots, with a real syncd and simulated
members: each adapter versioned on its own, only its factors planned, the base untouched, and
clear refusals (no such adapter, a generator without LoRA, a rank its slots cannot take)."""

from __future__ import annotations

import grpc
import pytest
from syncd_harness import Cluster, FakeMember, generator_catalog, wait_until
from test_syncctl import syncctl

from syncd.api import convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.commands import Commit, ExecutePlan
from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.layout.adapters import AdapterSpec, LoraSlots, parse_slot_tensor
from syncd.member.client import MemberClient
from syncd.member.refit_outcomes import wait_served

RANK, IN, OUT = 4, 8, 16
SLOTS = LoraSlots(max_rank=8, max_loras=2, dtype="bfloat16")


def adapter_catalog(rank: int = RANK) -> Catalog:
    """One adapted module's factors, float32 (the slots hold bfloat16: the sender converts)."""
    canon = (
        CanonicalTensor("model.layers.0.self_attn.q_proj.lora_A.weight", (rank, IN), "float32"),
        CanonicalTensor("model.layers.0.self_attn.q_proj.lora_B.weight", (OUT, rank), "float32"),
    )
    return Catalog(canon, tuple(local_tensor(c.name, c.dtype, Canon(c.name, c.shape)) for c in canon))


def spec(name: str, rank: int = RANK) -> AdapterSpec:
    return AdapterSpec(name, rank, 2.0 * rank, ("q_proj",))


def start(cluster: Cluster, member: FakeMember) -> FakeMember:
    member.client.start(member.handle)
    cluster.members[member.member_id] = member
    assert member.client.wait_registered()
    return member


def start_adapter_trainer(cluster: Cluster, name: str, rank: int = RANK, run_id: str = "run-1") -> FakeMember:
    client = MemberClient(
        cluster.target,
        role="trainer",
        member_id=f"adapter-{name}-0",
        coords={"pp": 0},
        catalog=adapter_catalog(rank),
        auth_token=cluster.daemon.settings.auth_token,
        run_id=run_id,
        adapter=spec(name, rank),
    )
    return start(cluster, FakeMember(client))


def start_generators(cluster: Cluster, slots: LoraSlots | None = SLOTS) -> list[FakeMember]:
    out = []
    for tp in (0, 1):
        client = MemberClient(
            cluster.target,
            role="generator",
            member_id=f"generator-0-{tp}",
            coords={"replica": 0, "tp": tp},
            catalog=generator_catalog(tp),
            auth_token=cluster.daemon.settings.auth_token,
            lora_slots=slots,
        )
        out.append(start(cluster, FakeMember(client)))
    return out


def post_refit(cluster: Cluster, **body: object) -> tuple[int, dict]:
    token = cluster.daemon.settings.auth_token
    r = cluster.http.post("/v1/refits", json=body, headers={"Authorization": f"Bearer {token}"})
    return r.status_code, r.json()


def announce(cluster: Cluster, trainer: FakeMember, version: int) -> str:
    """`trainer` announces `version` of its adapter; once syncd lists it, the adapter's name."""
    trainer.client.announce_version(version)
    name = trainer.member_id.split("-")[1]
    wait_until(
        lambda: any(
            a["name"] == name and a["announced_version"] == version
            for a in cluster.http.get("/v1/adapters").json()["adapters"]
        ),
        what=f"version {version} of adapter {name} announced",
    )
    return name


def refit_adapter(cluster: Cluster, trainer: FakeMember, version: int) -> dict:
    name = announce(cluster, trainer, version)
    status, started = post_refit(cluster, adapter=name)
    assert status == 202, started
    return cluster.wait_refit(started["id"])


@pytest.fixture
def slot_cluster(make_cluster) -> Cluster:
    """Base trainers and two generators with adapter slots; the base at version 1."""
    cluster = make_cluster()
    for member_id in ("trainer-0", "trainer-1"):
        cluster.start_member(member_id)
    start_generators(cluster)
    wait_until(lambda: cluster.http.get("/readyz").status_code == 200, what="syncd ready")
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"
    return cluster


def test_two_adapters_refitted_alternately_each_keep_their_own_version_and_the_base(slot_cluster):
    cluster = slot_cluster
    a, b = start_adapter_trainer(cluster, "a"), start_adapter_trainer(cluster, "b")
    adapter_bytes = (RANK * IN + OUT * RANK) * 2  # bfloat16 in the slots
    for trainer, version in ((a, 1), (b, 1), (a, 2)):
        done = refit_adapter(cluster, trainer, version)
        name = trainer.member_id.split("-")[1]
        assert done["state"] == "COMMITTED", done["error"]
        assert (done["adapter"], done["weight_version"]) == (name, version)
        # Only the adapter's factors moved, to both generators: the refit's bytes are the adapter's.
        assert done["bytes"] == done["planned_bytes"] == 2 * adapter_bytes
        for g in ("generator-0-0", "generator-0-1"):
            execute = cluster.members[g].of_type(ExecutePlan)[-1]
            assert execute.adapter == spec(name)
            assert {parse_slot_tensor(u.dst_tensor) for bk in execute.buckets for u in bk.units} == {
                (name, c.name) for c in adapter_catalog().canonical
            }
            commit = cluster.members[g].of_type(Commit)[-1]
            assert (commit.adapter, commit.weight_version) == (name, version)
            assert cluster.members[g].client.weight_version == 1  # it still serves base version 1
        other = b if trainer is a else a
        assert not any(e.refit_id == done["id"] for e in other.of_type(ExecutePlan))

    adapters = {x["name"]: x for x in cluster.http.get("/v1/adapters").json()["adapters"]}
    assert (adapters["a"]["committed_version"], adapters["b"]["committed_version"]) == (2, 1)
    assert adapters["a"]["rank"] == RANK and adapters["a"]["trainers"] == ["adapter-a-0"]
    status = cluster.http.get("/v1/status").json()
    assert status["committed_version"] == 1  # the base never moved
    metrics = cluster.http.get("/metrics").text
    assert f'weightsync_syncd_adapter_moved_bytes_total{{adapter="a"}} {4.0 * adapter_bytes}' in metrics
    assert 'weightsync_syncd_adapter_committed_version{adapter="a"} 2.0' in metrics
    assert 'weightsync_syncd_adapter_committed_version{adapter="b"} 1.0' in metrics
    # A base refit still plans the base trainers only.
    plan = cluster.http.get("/v1/plan").json()
    assert {k["src"] for k in plan["links"]} == {"trainer-0", "trainer-1"}
    assert cluster.wait_refit(cluster.refit(weight_version=2)["id"])["state"] == "COMMITTED"
    members = {m["member_id"]: m for m in cluster.http.get("/v1/members").json()["members"]}
    assert members["adapter-a-0"]["adapter"] == "a" and members["generator-0-0"]["lora_slots"]


def test_an_unknown_adapter_is_refused_naming_the_registered_ones(slot_cluster):
    start_adapter_trainer(slot_cluster, "a")
    status, body = post_refit(slot_cluster, adapter="nope")
    assert status == 409
    assert "no trainer of adapter 'nope'" in body["error"]["message"]
    assert "adapters registered: a" in body["error"]["message"]


def test_an_adapter_without_an_announced_version_is_refused(slot_cluster):
    start_adapter_trainer(slot_cluster, "a")
    status, body = post_refit(slot_cluster, adapter="a")
    assert status == 409 and "announced no version" in body["error"]["message"]


def test_generators_without_lora_refuse_adapter_refits_by_name(make_cluster):
    cluster = make_cluster()
    start_generators(cluster, slots=None)
    trainer = start_adapter_trainer(cluster, "a")
    announce(cluster, trainer, 1)
    status, body = post_refit(cluster, adapter="a")
    assert status == 409
    message = body["error"]["message"]
    assert "generator generator-0-0 takes no adapters into slots" in message and "--enable-lora" in message


def test_an_adapter_of_a_larger_rank_than_the_slots_is_refused(make_cluster):
    cluster = make_cluster()
    start_generators(cluster, slots=LoraSlots(max_rank=2, max_loras=2, dtype="bfloat16"))
    trainer = start_adapter_trainer(cluster, "a", rank=RANK)
    announce(cluster, trainer, 1)
    status, body = post_refit(cluster, adapter="a")
    assert status == 409
    assert f"adapter 'a' has rank {RANK}" in body["error"]["message"]
    assert "take ranks up to 2 (--max-lora-rank)" in body["error"]["message"]


def test_an_adapter_trainer_whose_factors_disagree_with_its_rank_is_refused_at_registration(cluster):
    request = pb.RegisterRequest(
        role=pb.ROLE_TRAINER,
        member_id="adapter-a-0",
        coords={"pp": 0},
        catalog_hash=adapter_catalog(RANK).content_hash,
        catalog=convert.catalog_to_pb(adapter_catalog(RANK)),
        adapter=convert.adapter_to_pb(spec("a", rank=8)),
    )
    with grpc.insecure_channel(cluster.target) as channel:
        token = cluster.daemon.settings.auth_token
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.SyncdStub(channel).Register(request, metadata=metadata, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "declares rank 8 but its factors have rank 4" in refused.value.details()


def test_syncctl_refits_an_adapter_and_shows_its_versions_and_bytes(slot_cluster):
    cluster = slot_cluster
    trainer = start_adapter_trainer(cluster, "a")
    announce(cluster, trainer, 1)
    token = cluster.daemon.settings.auth_token
    done = syncctl(cluster.url, "refit", "--adapter", "a", "--wait", token=token)
    assert done.returncode == 0, done.stderr
    assert "COMMITTED (adapter a version 1)" in done.stdout
    assert done.stdout.rstrip().endswith("384 B")  # (4*8 + 16*4) bfloat16 values to each of 2 generators
    history = syncctl(cluster.url, "history").stdout
    assert "a@run-1:1" in history.splitlines()[1]
    adapters = syncctl(cluster.url, "adapters").stdout.splitlines()
    assert adapters[0].split() == ["ADAPTER", "RANK", "TARGETS", "TRAINERS", "ANNOUNCED", "COMMITTED"]
    assert adapters[1].split() == ["a", "4", "q_proj", "adapter-a-0", "run-1:1", "run-1:1"]


def test_auto_refit_moves_each_announced_adapter_version_and_its_trainer_hears_it_served(make_cluster):
    cluster = make_cluster(auto_refit=True)
    start_generators(cluster)
    a, b = start_adapter_trainer(cluster, "a"), start_adapter_trainer(cluster, "b")
    for trainer, version in ((a, 1), (b, 1), (a, 2)):
        trainer.client.announce_version(version)
        outcome = wait_served(trainer.client, version, 30)
        assert outcome.served and outcome.version.step == version, outcome
    adapters = {x["name"]: x for x in cluster.http.get("/v1/adapters").json()["adapters"]}
    assert (adapters["a"]["committed_version"], adapters["b"]["committed_version"]) == (2, 1)
    refits = cluster.http.get("/v1/refits").json()["refits"]
    assert [(r["adapter"], r["weight_version"], r["state"]) for r in reversed(refits)] == [
        ("a", 1, "COMMITTED"),
        ("b", 1, "COMMITTED"),
        ("a", 2, "COMMITTED"),
    ]


def test_a_generator_that_registers_again_gets_every_committed_adapter_again(slot_cluster):
    cluster = slot_cluster
    a = start_adapter_trainer(cluster, "a")
    assert refit_adapter(cluster, a, 1)["state"] == "COMMITTED"
    old = cluster.members.pop("generator-0-1")
    old.client.close()  # it leaves; a restarted engine's slots are empty
    client = MemberClient(
        cluster.target,
        role="generator",
        member_id="generator-0-1",
        coords={"replica": 0, "tp": 1},
        catalog=generator_catalog(1),
        auth_token=cluster.daemon.settings.auth_token,
        lora_slots=SLOTS,
    )
    again = start(cluster, FakeMember(client))
    commits = wait_until(
        lambda: [c for c in again.of_type(Commit) if c.adapter == "a"], what="adapter a again"
    )
    assert commits[0].weight_version == 1  # type: ignore[index]
