"""`python -m generator_svc --syncd ADDR` serves generations and registers its workers with a real
syncd (`python -m syncd`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.generator.conftest import PROMPTS, REPO, Service, free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def syncd(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tmp_path = tmp_path_factory.mktemp("syncd")
    grpc_port, http_port = free_port(), free_port()
    log = open(tmp_path / "syncd.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "syncd", "--grpc-port", str(grpc_port), "--http-port",
                             str(http_port), "--db", str(tmp_path / "syncd.db")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    deadline = time.monotonic() + 30
    while True:
        try:
            if http.get("/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "syncd.log").read_text()[-3000:]
        time.sleep(0.2)
    yield f"127.0.0.1:{grpc_port}", http
    proc.terminate()
    proc.wait(10)
    http.close()


@pytest.fixture(scope="module")
def generator(syncd, checkpoints, tmp_path_factory):  # noqa: ANN001, ANN201
    """`python -m generator_svc --syncd ...` on checkpoint A, replica 3."""
    service = Service(checkpoints["A"], tmp_path_factory.mktemp("gen") / "generator.log",
                      "--syncd", syncd[0], "--replica", "3")
    yield service.wait_ready()
    service.stop()


def test_service_registers_every_worker_with_syncd_and_serves(syncd, generator) -> None:  # noqa: ANN001
    _, syncd_http = syncd
    service = generator
    workers = service.http.get("/v1/workers").json()
    assert [w["member_id"] for w in workers] == ["generator-3-0"]
    deadline = time.monotonic() + 30
    while not (members := [m for m in syncd_http.get("/v1/members").json()["members"]
                           if m["member_id"] == "generator-3-0"]):
        assert time.monotonic() < deadline, syncd_http.get("/v1/members").text
        time.sleep(0.2)
    (member,) = members
    assert member["role"] == "generator"
    assert member["coords"] == {"replica": 3, "tp": 0}
    assert member["catalog_hash"] == workers[0]["catalog_hash"]

    tokens, logprobs = service.complete(PROMPTS["short"])
    assert len(tokens) == len(logprobs) == 8
    assert service.http.get("/v1/weight_version").json()["version"] == "0"
    metrics = service.http.get("/metrics").text
    assert "vllm:" in metrics and "weightsync_catalog_bytes" in metrics


class FakeTrainer:
    """A one-rank trainer that holds checkpoint `path` whole and speaks syncd's member protocol
    with the real client and gloo data plane (the generator side is what is under test)."""

    def __init__(self, target: str, path: Path) -> None:
        import torch
        from safetensors.torch import load_file

        from syncd.client import MemberClient
        from syncd.layout import Canon, CanonicalTensor, Catalog, hf_names, local_tensor

        self.tensors = hf_names.group_from_hf(load_file(str(path / "model.safetensors")).items(), torch.stack)
        catalog = Catalog(
            tuple(CanonicalTensor(n, tuple(t.shape), "float32") for n, t in self.tensors.items()),
            tuple(local_tensor(n, "float32", Canon(n, tuple(t.shape))) for n, t in self.tensors.items()))
        self.client = MemberClient(target, role="trainer", member_id="trainer-0",
                                   coords={"pp": 0, "dp": 0, "ep": 0, "tp": 0}, catalog=catalog,
                                   weight_version=1)  # it holds checkpoint B as version 1
        self.transports: dict = {}
        self.client.start(self.handle)

    def handle(self, cmd) -> None:  # noqa: ANN001
        from syncd.commands import Abort, Commit, ExecutePlan, JoinGroup, Phase, Verify
        from syncd.dataplane import GlooTransport, send_buckets

        report = self.client.report
        if isinstance(cmd, JoinGroup):
            address, store = (cmd.address, None)
            if cmd.rank == 0 and not address:
                address, store = GlooTransport.create_address("127.0.0.1", cmd.world_size, 60)
                report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
            self.transports[cmd.group_id] = (
                GlooTransport.connect(address, cmd.rank, cmd.world_size, cmd.group_id, 60, store=store), cmd.members)
            report(cmd.refit_id, Phase.JOINED)
        elif isinstance(cmd, ExecutePlan):
            stats_bytes, sums = 0, {}
            for group in cmd.groups:
                transport, members = self.transports[group.group_id]
                mine = [b for b in cmd.buckets if b.src == "trainer-0" and b.stage == group.stage]
                stats = send_buckets(mine, self.tensors, transport, {m: i for i, m in enumerate(members)},
                                     timeout_s=60)
                stats_bytes += stats.bytes
                sums.update(stats.checksums)
            report(cmd.refit_id, Phase.TRANSFERRED, bytes=stats_bytes, checksums=sums)
        elif isinstance(cmd, (Verify, Commit)):
            report(cmd.refit_id, Phase.VERIFIED if isinstance(cmd, Verify) else Phase.COMMITTED)
        elif isinstance(cmd, Abort):
            report(cmd.refit_id, Phase.ABORTED)

    def close(self) -> None:
        self.client.close()


def test_refit_driven_by_syncd_moves_b_into_the_generator(syncd, generator, checkpoints, outputs_fresh_b) -> None:  # noqa: ANN001
    target, syncd_http = syncd
    service = generator
    trainer = FakeTrainer(target, checkpoints["B"])
    try:
        deadline = time.monotonic() + 30
        while not syncd_http.get("/readyz").status_code == 200:
            assert time.monotonic() < deadline, syncd_http.get("/readyz").text
            time.sleep(0.2)
        r = syncd_http.post("/v1/refits", json={"weight_version": 1})
        assert r.status_code == 202, r.text
        refit_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while (refit := syncd_http.get(f"/v1/refits/{refit_id}").json())["state"] not in ("COMMITTED", "ABORTED"):
            assert time.monotonic() < deadline, refit
            time.sleep(0.2)
        assert refit["state"] == "COMMITTED", refit["error"] + "\n" + service.log_tail()
        assert refit["bytes"] == service.http.get("/v1/workers").json()[0]["nbytes"]
        assert service.http.get("/v1/weight_version").json()["version"] == "1"
        assert service.outputs() == outputs_fresh_b
    finally:
        trainer.close()
