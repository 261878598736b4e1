"""The rank agent: zero-copy shard access under the trainer's lock, and registration with a real syncd."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import _launch
import httpx
import pytest
import torch
from _launch import TRAIN

from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.net import free_port
from syncd.refit_wait import wait_final
from syncd.vocabulary import Role
from tests.polling import wait_until
from trainer_svc.agent import LocalShards, RankAgent
from trainer_svc.canonical import canonical_shapes
from trainer_svc.catalog import build_catalog
from trainer_svc.parallel_dims import ParallelDims
from trainer_svc.settings import LaunchEnv, TrainSettings
from trainer_svc.shard_gather import gather_canonical
from trainer_svc.tiny import TINY_ARGS
from trainer_svc.train import Trainer


def _single_trainer(tiny_dir: str, dtype: str = "float32") -> Trainer:
    settings = TrainSettings(model_dir=tiny_dir, device="cpu", dtype=dtype, **TRAIN)
    return Trainer.create(settings, LaunchEnv(0, 1, 0), torch.device("cpu"))


def test_local_shards_are_live_views_of_the_parameters(tiny_dir):
    trainer = _single_trainer(tiny_dir)
    catalog = build_catalog(trainer.args, trainer.mesh.dims, trainer.mesh.coords)
    params = dict(trainer.model.named_parameters())
    shards = LocalShards(catalog, params, trainer.lock)
    assert sorted(shards.names()) == sorted(params)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert tuple(shards[fused].shape) == (8, 2, 64, 128)
    for name in shards.names():
        assert shards[name].data_ptr() == params[name].data_ptr(), f"{name} was copied"
    before = shards[fused].clone()
    trainer.train_step(1)
    assert not torch.equal(before, shards[fused]), "the view must see the optimizer's update"
    torch.testing.assert_close(shards[fused].reshape(-1, 128), params[fused].detach(), rtol=0, atol=0)


def test_bf16_shards_are_the_weights_the_model_computes_with_and_the_optimizer_keeps_float32(tiny_dir):
    trainer = _single_trainer(tiny_dir, "bfloat16")
    catalog = build_catalog(trainer.args, trainer.mesh.dims, trainer.mesh.coords, trainer.precision.dtype)
    assert {t.dtype for t in catalog.tensors} == {"bfloat16"}
    shards = LocalShards(catalog, trainer.precision.weights, trainer.lock)
    masters = dict(trainer.model.named_parameters())
    for step in (1, 2):
        trainer.train_step(step)
        for name, master in masters.items():
            assert master.dtype == torch.float32 and master.grad.dtype == torch.float32, name
            weights = shards[name].reshape(master.shape)
            assert weights.dtype == torch.bfloat16 and torch.equal(
                weights, master.detach().to(torch.bfloat16)
            ), name
    states = [t for state in trainer.optimizer.state.values() for t in state.values() if t.numel() > 1]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_optimizer_waits_while_shards_are_read(tiny_dir):
    trainer = _single_trainer(tiny_dir)
    shards = LocalShards(
        build_catalog(trainer.args, trainer.mesh.dims, trainer.mesh.coords),
        dict(trainer.model.named_parameters()),
        trainer.lock,
    )
    name = "lm_head.weight"
    done = threading.Event()
    with shards.reading() as tensors:
        snapshot = tensors[name].clone()
        worker = threading.Thread(target=lambda: (trainer.train_step(1), done.set()))
        worker.start()
        time.sleep(1.0)  # the step computes gradients, then blocks on the lock
        assert not done.is_set()
        assert torch.equal(tensors[name], snapshot), "parameters changed during a read"
    worker.join(timeout=60)
    assert done.is_set() and not torch.equal(shards[name], snapshot)


@pytest.fixture
def start_syncd(tmp_path):
    """start_syncd(trainers, generators) -> (gRPC target, HTTP client) of a real syncd process."""
    pytest.importorskip("grpc")
    procs: list[subprocess.Popen] = []
    clients: list[httpx.Client] = []

    def start(trainers: int, generators: int, token: str | None = None, ports: tuple[int, int] | None = None):
        grpc_port, http_port = ports or (free_port(), free_port())
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "syncd",
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                "--db",
                str(tmp_path / "syncd.db"),
                "--lease-seconds",
                "60",
                "--expected-trainers",
                str(trainers),
                "--expected-generators",
                str(generators),
                "--backend",
                "gloo",
                *(["--auth-token", token] if token else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=5)
        clients.append(http)
        wait_until(lambda: _get_ok(http, "/healthz") or proc.poll() is not None, 60, "syncd to start")
        if proc.poll() is not None:
            pytest.fail(f"syncd exited: {proc.stderr.read().decode()[-2000:]}")
        return f"127.0.0.1:{grpc_port}", http

    def stop() -> None:
        """Stop the syncd started last (start it again with its `ports` to restart it)."""
        procs[-1].terminate()
        procs[-1].wait(timeout=10)

    start.stop = stop
    yield start
    for http in clients:
        http.close()
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def _get_ok(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def test_trainer_ranks_register_with_syncd_and_announce(start_syncd, tiny_dir, tmp_path):
    target, http = start_syncd(trainers=2, generators=1)
    settings = TrainSettings(model_dir=tiny_dir, ep=2, device="cpu", syncd=target, **TRAIN)
    members: dict[str, dict] = {}  # every member syncd listed while the job ran
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=http.base_url, timeout=5) as watcher:
            while not done.is_set():
                members.update({m["member_id"]: m for m in watcher.get("/v1/members").json()["members"]})
                time.sleep(0.02)

    watching = threading.Thread(target=watch, daemon=True)
    watching.start()
    try:
        _launch.run_job(settings, tmp_path / "run")
    finally:
        done.set()
        watching.join(10)
    assert set(members) == {"trainer-0", "trainer-1"}
    assert http.get("/v1/members").json()["members"] == []  # each rank left syncd as the job ended
    dims = ParallelDims(ep=2)
    for rank in range(2):
        m = members[f"trainer-{rank}"]
        c = dims.coords(rank)
        assert m["role"] == "trainer"
        assert m["coords"] == c.as_dict()
        assert m["catalog_hash"] == build_catalog(TINY_ARGS, dims, c).content_hash
    assert http.get("/v1/status").json()["announced_version"] == TRAIN["steps"]


class _Receiver:
    """A stand-in generator holding every canonical tensor whole: a plain endpoint joined through
    the same front door (`syncd.member.join`) the real services use."""

    def __init__(self, target: str) -> None:
        from syncd.member import join

        shapes = canonical_shapes(TINY_ARGS)
        canon = tuple(CanonicalTensor(n, s, "float32") for n, s in shapes.items())
        catalog = Catalog(canon, tuple(local_tensor(n, "float32", Canon(n, s)) for n, s in shapes.items()))
        self.tensors = {n: torch.zeros(s) for n, s in shapes.items()}
        self.committed: list[int] = []
        self.member = join(
            target,
            self,
            role=Role.GENERATOR,
            member_id="generator-0-0",
            coords={"replica": 0, "tp": 0},
            catalog=catalog,
        )

    def begin(self, refit_id, version, buckets):
        return self.tensors

    def end(self, refit_id, ok):
        pass

    def verify(self, refit_id):
        pass

    def commit(self, refit_id, version, timeout_s):
        self.committed.append(version)

    def abort(self):
        pass

    def close(self) -> None:
        self.member.close()


def test_refit_moves_the_trained_weights_bit_exactly(start_syncd, tiny_dir):
    """A real refit through syncd: the agent sends from its live (fused, sharded-view) parameters
    and a receiver holding HF-shaped tensors gets exactly the trainer's weights."""
    target, http = start_syncd(trainers=1, generators=1)
    settings = TrainSettings(model_dir=tiny_dir, device="cpu", syncd=target, **TRAIN)
    trainer = Trainer.create(settings, LaunchEnv(0, 1, 0), torch.device("cpu"))
    agent = RankAgent.start(target, trainer, LaunchEnv(0, 1, 0))
    receiver = _Receiver(target)
    try:
        trainer.train_step(1)
        wait_until(lambda: _get_ok(http, "/readyz"), 30, "syncd ready")
        r = http.post("/v1/refits", json={})
        assert r.status_code == 202, r.text
        done = wait_final(lambda path: http.get(path).json(), r.json()["id"], 60)
        assert done["state"] == "COMMITTED", done["error"]
        assert done["weight_version"] == 1 and receiver.committed == [1]
        expected = gather_canonical(trainer.precision.weights, trainer.mesh, trainer.args)
        for name, want in expected.items():
            assert torch.equal(receiver.tensors[name], want), name

        trainer.train_step(2)  # the trainer moved on: syncd refuses to move version 1
        r = http.post("/v1/refits", json={"weight_version": 1})
        assert r.status_code == 409 and "not held by the trainers" in r.json()["error"]["message"], r.text
    finally:
        receiver.close()
        agent.close()


def test_a_rank_registers_with_a_token_protected_syncd_only_with_the_token(
    start_syncd, tiny_dir, monkeypatch
):
    target, http = start_syncd(trainers=1, generators=1, token="s3cret")
    monkeypatch.setenv("SYNCD_AUTH_TOKEN", "s3cret")
    settings = TrainSettings.from_argv(["--model-dir", tiny_dir, "--device", "cpu", "--syncd", target])
    assert settings.auth_token == "s3cret"
    trainer = Trainer.create(settings, LaunchEnv(0, 1, 0), torch.device("cpu"))
    without = RankAgent.start(target, trainer, LaunchEnv(0, 1, 0))
    assert not without.client.wait_registered(3), "syncd must refuse a member without the token"
    without.close()
    agent = RankAgent.start(target, trainer, LaunchEnv(0, 1, 0), auth_token=settings.auth_token)
    try:
        assert agent.client.wait_registered(30)
        members = http.get("/v1/members").json()["members"]
        assert [m["member_id"] for m in members] == ["trainer-0"]
    finally:
        agent.close()


def test_a_synchronous_rank_waits_for_the_refit_of_a_step_it_could_not_announce(
    start_syncd, tiny_dir, caplog
):
    """syncd restarts while a --sync-refit rank announces its step: the version reaches the new
    syncd through the rank's re-registration, and the rank waits for that refit instead of moving
    on (a job's last step used to finish unannounced and the job exit before anyone moved it)."""
    target, http = start_syncd(trainers=1, generators=1)
    ports = (int(target.rpartition(":")[2]), http.base_url.port)
    settings = TrainSettings(model_dir=tiny_dir, device="cpu", syncd=target, **TRAIN)
    trainer = Trainer.create(settings, LaunchEnv(0, 1, 0), torch.device("cpu"))
    agent = RankAgent.start(target, trainer, LaunchEnv(0, 1, 0), sync_refit_s=120)
    receiver = _Receiver(target)
    try:
        wait_until(lambda: _get_ok(http, "/readyz"), 30, "syncd ready")
        start_syncd.stop()
        step = threading.Thread(target=trainer.train_step, args=(1,))
        step.start()
        wait_until(lambda: "could not announce version 1" in caplog.text, 60, "the announcement to fail")
        _, http = start_syncd(trainers=1, generators=1, ports=ports)
        wait_until(lambda: _get_ok(http, "/readyz"), 60, "both members back with the restarted syncd")
        assert step.is_alive(), "the rank moved on without the refit of its step"
        assert http.get("/v1/status").json()["announced_version"] == 1
        r = http.post("/v1/refits", json={})
        assert r.status_code == 202, r.text
        done = wait_final(lambda path: http.get(path).json(), r.json()["id"], 60)
        assert done["state"] == "COMMITTED", done["error"]
        step.join(60)
        assert not step.is_alive() and receiver.committed == [1]
    finally:
        receiver.close()
        agent.close()
