"""Delta refits through a real syncd over gRPC and gloo: bfloat16 trainer ranks with the trainer's
own catalogs (ep 2 x tp 2) and generator ranks in vLLM's layout, whose staging keeps the committed
version as a real generator's does. syncd plans a delta for each generator that holds the
committed version and a full refit for any other, in the same plan; the whole-region checksums
catch a base that is not what syncd believes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from generator_svc.worker.catalog import TP, build_catalog
from syncd.daemon.service import Daemon
from syncd.member import join
from syncd.member.client import MemberClient
from syncd.plan.simulate import materialize
from syncd.refit_wait import wait_final
from syncd.states import TERMINAL
from syncd.vocabulary import Role
from testkit.endpoints import GeneratorEndpoint, TrainerEndpoint
from tests.integration.test_fp8_refit import vllm_specs
from tests.polling import wait_until
from tests.syncd_settings import syncd_settings
from trainer_svc import catalog as trainer_catalog
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import ParallelDims

ARGS = ModelArgs(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
)
DIMS = ParallelDims(pp=1, ep=2, tp=2)


class StagedGenerator(GeneratorEndpoint):
    """Staging that outlives a refit, as `generator_svc.worker.staging` does: after a commit it holds the
    committed version, which a delta is applied onto; `changed` is what the delta touched."""

    def __init__(self, catalog):
        super().__init__(catalog)
        self.staging = {name: t.clone() for name, t in self.params.items()}
        self.changed: frozenset[str] | None = None

    def begin(self, refit_id, version, buckets):
        self.changed = None
        return self.staging

    def verify(self, refit_id):
        pass  # the checksums of whole regions are the check

    def received_delta(self, refit_id, changed):
        self.changed = changed

    def commit(self, refit_id, version, timeout_s):
        self.params, self.version = {n: t.clone() for n, t in self.staging.items()}, version

    def abort(self):
        pass  # staging may be torn: syncd plans a full refit next


class HeldTrainer(TrainerEndpoint):
    """A trainer rank whose transfer ends (its optimizer may step again, `end`) only once its
    agent's mirror took what it sent: each `end` records the version the mirror then holds."""

    def __init__(self, catalog):
        super().__init__(catalog)
        self.agent = None  # set once joined
        self.mirror_at_end: list = []

    def end(self, refit_id, ok):
        mirror = self.agent.mirror if self.agent is not None else None
        self.mirror_at_end.append(mirror.version if mirror is not None else None)


@pytest.fixture
def cluster(tmp_path: Path):
    running: list = []
    settings = syncd_settings(
        tmp_path,
        bucket_bytes=16 << 10,
        expected_trainers=DIMS.world_size,
        expected_generators=2,
        delta_refits=True,
    )
    daemon = Daemon(settings)
    daemon.start()
    running.append(daemon)
    target = f"127.0.0.1:{daemon.grpc_port}"
    trainers = [
        HeldTrainer(trainer_catalog.build_catalog(ARGS, DIMS, c, "bfloat16")) for c in DIMS.all_coords()
    ]

    def join_as(member_id: str, coords: dict, role: Role, holder) -> MemberClient:
        member = join(target, holder, role=role, member_id=member_id, coords=coords, catalog=holder.catalog)
        running.append(member)
        if isinstance(holder, HeldTrainer):
            holder.agent = member.agent
        return member.client

    clients = [
        join_as(f"trainer-{DIMS.rank_of(c)}", c.as_dict(), Role.TRAINER, t)
        for c, t in zip(DIMS.all_coords(), trainers)
    ]

    def add_generator(replica: int, tp: int) -> list[StagedGenerator]:
        gens = [StagedGenerator(build_catalog(vllm_specs(ARGS, TP(tp, r)))) for r in range(tp)]
        for r, g in enumerate(gens):
            join_as(f"generator-{replica}-{r}", {"replica": replica, "tp": r}, Role.GENERATOR, g)
        return gens

    http = httpx.Client(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=30)
    running.append(http)
    yield http, clients[0].announce_version, trainers, add_generator
    for thing in reversed(running):
        (thing.stop if isinstance(thing, Daemon) else thing.close)()


class Weights:
    """The trainers' bf16 weights, stepped like an RL update: a small fraction of elements move."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.values = {
            n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
            for n, s in canonical_shapes(ARGS).items()
        }
        self._gen = gen

    def step(self, fraction: float) -> None:
        for x in self.values.values():
            hit = torch.rand(x.shape, generator=self._gen) < fraction
            x[hit] = (x[hit].float() * 1.01 + 1e-3).to(torch.bfloat16)

    def arrays(self) -> dict[str, np.ndarray]:
        return {n: x.view(torch.int16).numpy() for n, x in self.values.items()}


def _refit(http: httpx.Client, announce, trainers, weights: Weights, version: int, **body) -> dict:
    for t in trainers:
        t.load(weights.arrays())
    announce(version)
    r = http.post("/v1/refits", json={"weight_version": version, **body})
    assert r.status_code == 202, r.text
    return wait_final(lambda path: http.get(path).json(), r.json()["id"], 120, poll_s=0.05)


def _ready(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while not http.get("/readyz").json()["ready"]:
        assert time.monotonic() < deadline, http.get("/readyz").json()
        time.sleep(0.1)


def _next_final(http: httpx.Client, seen: set[str]) -> dict:
    """The first refit not in `seen` to end (syncd's own, such as a catch-up)."""
    return wait_until(
        lambda: next(
            (
                r
                for r in http.get("/v1/refits").json()["refits"]
                if r["id"] not in seen and r["state"] in TERMINAL
            ),
            None,
        ),
        60,
    )


def _assert_serves(gens: list[StagedGenerator], weights: Weights) -> None:
    expected = weights.arrays()
    for g in gens:
        for name, want in materialize(g.catalog, expected).items():
            np.testing.assert_array_equal(g.params[name].view(torch.int16).numpy(), want, err_msg=name)


def test_delta_refits_move_what_changed_and_a_late_generator_gets_a_full_refit_in_the_same_plan(cluster):
    http, announce, trainers, add_generator = cluster
    first = add_generator(0, 2)
    _ready(http)
    w = Weights()
    r1 = _refit(http, announce, trainers, w, 1)
    assert (r1["state"], r1["mode"]) == ("COMMITTED", "full"), r1
    w.step(0.01)
    r2 = _refit(http, announce, trainers, w, 2)
    assert (r2["state"], r2["mode"]) == ("COMMITTED", "delta"), r2
    assert r2["delta_generators"] == ["generator-0-0", "generator-0-1"]
    assert r2["bytes"] < 0.1 * r2["planned_bytes"] and r2["saved_bytes"] == r2["planned_bytes"] - r2["bytes"]
    assert 0.002 < r2["changed_fraction"] < 0.03, r2
    _assert_serves(first, w)
    # The mirror takes what was sent after the transfer, while the rank still holds its weights.
    assert all(t.mirror_at_end[-2:] == [1, 2] for t in trainers), [t.mirror_at_end for t in trainers]
    assert first[0].changed and first[0].changed < set(first[0].params)  # the install touches only these

    late = add_generator(1, 1)  # a replica that holds no version yet: syncd catches it up
    catch_up = _next_final(http, {r1["id"], r2["id"]})
    assert catch_up["state"] == "COMMITTED" and catch_up["weight_version"] == 2, catch_up
    # Only the late replica takes it, full: the replica serving version 2 is not refitted again.
    assert catch_up["delta_generators"] == [] and catch_up["bytes"] == catch_up["planned_bytes"], catch_up
    assert late[0].changed is None
    _assert_serves(first + late, w)

    w.step(0.01)
    r3 = _refit(http, announce, trainers, w, 3, full=True)  # an operator can ask for a full refit
    assert (r3["state"], r3["mode"], r3["bytes"]) == ("COMMITTED", "full", r3["planned_bytes"]), r3
    w.step(0.01)
    r4 = _refit(http, announce, trainers, w, 4)
    assert r4["state"] == "COMMITTED" and len(r4["delta_generators"]) == 3, r4
    _assert_serves(first + late, w)
    metrics = http.get("/metrics").text
    assert 'weightsync_syncd_committed_refits_by_mode_total{mode="delta"} 2.0' in metrics  # r2, r4
    assert "weightsync_syncd_delta_saved_bytes_total" in metrics


def test_a_flipped_element_of_the_base_aborts_the_delta_and_the_next_refit_goes_full(cluster):
    http, announce, trainers, add_generator = cluster
    gens = add_generator(0, 2)
    _ready(http)
    w = Weights()
    assert _refit(http, announce, trainers, w, 1)["state"] == "COMMITTED"
    served = {n: t.clone() for n, t in gens[1].params.items()}
    gens[1].staging["model.layers.1.mlp.experts.w2_weight"].view(-1)[7] += (
        1  # the base is not version 1 any more
    )
    w.step(0.01)
    r2 = _refit(http, announce, trainers, w, 2)
    assert (
        r2["state"] == "ABORTED"
        and "checksum mismatch for tensor model.layers.1.mlp.experts.down_proj.weight" in r2["error"]
    ), r2
    assert all(torch.equal(served[n], t) for n, t in gens[1].params.items())  # still serving version 1
    r3 = _refit(http, announce, trainers, w, 2)
    assert (r3["state"], r3["mode"]) == ("COMMITTED", "full"), r3
    _assert_serves(gens, w)


def test_a_delta_goes_through_relays_only_while_every_replica_holds_its_base(cluster):
    """Two TP-1 replicas relay (fan-out, a chain): version 2 reaches both as the trainers' delta,
    the first forwarding it. A third replica joins without a version: syncd's catch-up sends it
    version 2 full, alone (the others serve it already), and version 3 goes as a delta through all
    three."""
    http, announce, trainers, add_generator = cluster
    gens = add_generator(0, 1) + add_generator(1, 1)
    _ready(http)
    links = http.get("/v1/plan").json()["links"]
    assert [(k["src"], k["dst"]) for k in links if k["relay"]] == [("generator-0-0", "generator-1-0")]
    w = Weights()
    r1 = _refit(http, announce, trainers, w, 1)
    assert (r1["state"], r1["mode"]) == ("COMMITTED", "full"), r1
    w.step(0.01)
    r2 = _refit(http, announce, trainers, w, 2)
    assert (r2["state"], r2["mode"]) == ("COMMITTED", "delta"), r2
    assert r2["delta_generators"] == ["generator-0-0", "generator-1-0"], r2
    assert 0 < r2["bytes"] < 0.1 * r2["planned_bytes"], r2  # received, the relay's forwards not counted twice
    _assert_serves(gens, w)
    assert all(g.changed and g.changed < set(g.params) for g in gens)

    late = add_generator(2, 1)  # the chain's new tail, holding no version
    catch_up = _next_final(http, {r1["id"], r2["id"]})
    assert (catch_up["state"], catch_up["weight_version"]) == ("COMMITTED", 2), catch_up
    assert catch_up["delta_generators"] == [] and catch_up["bytes"] == catch_up["planned_bytes"], catch_up
    assert late[0].changed is None  # the late replica took the full copy
    _assert_serves(gens + late, w)

    w.step(0.01)
    r3 = _refit(http, announce, trainers, w, 3)
    assert r3["state"] == "COMMITTED" and len(r3["delta_generators"]) == 3, r3
    assert r3["bytes"] < 0.1 * r3["planned_bytes"], r3
    _assert_serves(gens + late, w)
