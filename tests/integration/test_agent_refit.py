"""Refits through a real syncd with real tensors: members join through `syncd.member.join`
(MemberClient + MemberAgent) over gloo, one communicator per trainer PP stage. No vLLM here:
generator endpoints stage and commit plain tensors (generator_svc's own tests cover vLLM)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from syncd.daemon.service import Daemon
from syncd.layout import Canon, CanonicalTensor, Catalog, Concat, Shard, Sharded, Stack, local_tensor
from syncd.member import join
from syncd.plan.simulate import materialize
from syncd.refit_wait import wait_final
from syncd.vocabulary import Role
from testkit.endpoints import GeneratorEndpoint, TrainerEndpoint
from tests.polling import wait_until
from tests.syncd_settings import syncd_settings

E, I, H = 4, 6, 8
EMBED = CanonicalTensor("model.embed_tokens.weight", (32, H), "float32")
GATE = CanonicalTensor("model.layers.0.mlp.experts.gate_proj.weight", (E, I, H), "float32")
UP = CanonicalTensor("model.layers.0.mlp.experts.up_proj.weight", (E, I, H), "float32")
HEAD = CanonicalTensor("lm_head.weight", (32, H), "float32")
ALL = (EMBED, GATE, UP, HEAD)


def trainer_catalog(stage: int) -> Catalog:
    if stage == 0:
        return Catalog((EMBED,), (local_tensor(EMBED.name, "float32", Canon(EMBED.name, EMBED.shape)),))
    fused = Stack(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape)))
    return Catalog(
        (GATE, UP, HEAD),
        (
            local_tensor("experts.gate_up_proj", "float32", fused),
            local_tensor(HEAD.name, "float32", Canon(HEAD.name, HEAD.shape)),
        ),
    )


def generator_catalog(tp: int) -> Catalog:
    def split(c, dim):
        return Sharded(Canon(c.name, c.shape), (Shard(dim),), (2,), (tp,))

    return Catalog(
        ALL,
        (
            local_tensor("embed", "float32", split(EMBED, 0)),
            local_tensor("w13_weight", "float32", Concat(1, (split(GATE, 1), split(UP, 1)))),
            local_tensor("lm_head", "float32", split(HEAD, 0)),
        ),
    )


@pytest.fixture
def cluster(tmp_path: Path):
    settings = syncd_settings(
        tmp_path,
        bucket_bytes=512,
        expected_trainers=2,
        expected_generators=2,
    )
    daemon = Daemon(settings)
    daemon.start()
    target = f"127.0.0.1:{daemon.grpc_port}"
    trainers = {s: TrainerEndpoint(trainer_catalog(s)) for s in range(2)}
    generators = {t: GeneratorEndpoint(generator_catalog(t)) for t in range(2)}
    members = [
        join(
            target,
            ep,
            role=Role.TRAINER,
            member_id=f"trainer-{s}",
            coords={"pp": s, "dp": 0, "ep": 0, "tp": 0},
            catalog=ep.catalog,
        )
        for s, ep in trainers.items()
    ]
    members += [
        join(
            target,
            ep,
            role=Role.GENERATOR,
            member_id=f"generator-0-{t}",
            coords={"replica": 0, "tp": t},
            catalog=ep.catalog,
        )
        for t, ep in generators.items()
    ]
    http = httpx.Client(base_url=f"http://127.0.0.1:{daemon.settings.http_port}", timeout=30)
    deadline = time.monotonic() + 30
    while not http.get("/readyz").json()["ready"]:
        assert time.monotonic() < deadline, http.get("/readyz").json()
        time.sleep(0.1)
    yield http, trainers, generators, members[0].client.announce_version
    for member in members:
        member.close()
    http.close()
    daemon.stop()


def _refit(http: httpx.Client, announce, version: int) -> dict:
    announce(version)  # the trainers hold `version`: syncd moves only announced versions
    r = http.post("/v1/refits", json={"weight_version": version})
    assert r.status_code == 202, r.text
    return dict(wait_final(lambda path: http.get(path).json(), r.json()["id"], 60, poll_s=0.05))


def _canonical(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}


def test_two_refits_in_a_row_deliver_every_byte_through_per_stage_groups(cluster):
    http, trainers, generators, announce = cluster
    for version in (1, 2):
        canonical = _canonical(version)
        for ep in trainers.values():
            ep.load(canonical)
        state = _refit(http, announce, version)
        assert state["state"] == "COMMITTED", state
        for ep in generators.values():
            assert ep.version == version
            expected = materialize(ep.catalog, canonical)
            for name, t in ep.params.items():
                np.testing.assert_array_equal(t.numpy(), expected[name], err_msg=name)
    plan = http.get("/v1/plan").json()
    assert {s["stage"] for s in plan["stages"]} == {0, 1}


def test_a_failed_sender_aborts_the_refit_and_the_next_refit_succeeds(cluster):
    http, trainers, generators, announce = cluster
    good = _canonical(1)
    for ep in trainers.values():
        ep.load(good)
    assert _refit(http, announce, 1)["state"] == "COMMITTED"

    broken = trainers[1]
    original_begin = broken.begin

    def crash_once(refit_id, version, buckets):
        broken.begin = original_begin
        raise RuntimeError("trainer-1 lost its GPU")

    broken.begin = crash_once
    for ep in trainers.values():
        ep.load(_canonical(2))
    state = _refit(http, announce, 2)
    assert state["state"] == "ABORTED" and "trainer-1 lost its GPU" in str(state), state
    # syncd decides ABORTED first and tells the members after: a receiver may still be in its
    # transfer loop when the refit reads ABORTED, and drops its staging when the Abort arrives.
    wait_until(
        lambda: all(ep.staging is None for ep in generators.values()), 30, "the abort to reach the generators"
    )
    for ep in generators.values():  # still serving the committed version, untouched
        assert ep.version == 1
        expected = materialize(ep.catalog, good)
        for name, t in ep.params.items():
            np.testing.assert_array_equal(t.numpy(), expected[name])

    state = _refit(http, announce, 3)
    assert state["state"] == "COMMITTED", state
    assert all(ep.version == 3 for ep in generators.values())
