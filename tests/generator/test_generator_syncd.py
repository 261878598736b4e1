"""`python -m generator_svc --syncd ADDR` serves generations and registers its workers with a real
syncd (`python -m syncd`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from syncd.refit_wait import wait_final
from tests.generator.conftest import PROMPTS, REPO, Service, free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def syncd(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("syncd")
    grpc_port, http_port = free_port(), free_port()
    with open(tmp_path / "syncd.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "syncd",
                "--grpc-port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                "--db",
                str(tmp_path / "syncd.db"),
                "--same-host",  # FakeTrainer speaks plain gloo: no shared-memory links to it
                "network",
                # Never runs out here: a member whose process stops must leave (a restarted
                # generator is refused its member id while the old session holds it).
                "--lease-seconds",
                "600",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    deadline = time.monotonic() + 30
    while True:
        try:
            if http.get("/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "syncd.log").read_text()[
            -3000:
        ]
        time.sleep(0.2)
    yield f"127.0.0.1:{grpc_port}", http
    proc.terminate()
    proc.wait(10)
    http.close()


@pytest.fixture(scope="module")
def generator(syncd, checkpoints, tmp_path_factory):
    """`python -m generator_svc --syncd ...` on checkpoint A, replica 3."""
    service = Service(
        checkpoints["A"],
        tmp_path_factory.mktemp("gen") / "generator.log",
        "--syncd",
        syncd[0],
        "--replica",
        "3",
    )
    yield service.wait_ready()
    service.stop()


def test_service_registers_every_worker_with_syncd_and_serves(syncd, generator) -> None:
    _, syncd_http = syncd
    service = generator
    workers = service.http.get("/v1/workers").json()
    assert [w["member_id"] for w in workers] == ["generator-3-0"]
    deadline = time.monotonic() + 30
    while not (
        members := [
            m for m in syncd_http.get("/v1/members").json()["members"] if m["member_id"] == "generator-3-0"
        ]
    ):
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
    assert "vllm:" in metrics and "weightsync_generator_catalog_bytes" in metrics


class FakeTrainer:
    """A one-rank trainer that holds checkpoint `path` whole and speaks syncd's member protocol
    with the real client and gloo data plane (the generator side is what is under test)."""

    def __init__(self, target: str, path: Path, hold: threading.Event | None = None) -> None:
        import torch
        from safetensors.torch import load_file

        from syncd.layout import Canon, CanonicalTensor, Catalog, hf_names, local_tensor
        from syncd.member.client import MemberClient

        self.tensors = hf_names.group_from_hf(load_file(str(path / "model.safetensors")).items(), torch.stack)
        catalog = Catalog(
            tuple(CanonicalTensor(n, tuple(t.shape), "float32") for n, t in self.tensors.items()),
            tuple(local_tensor(n, "float32", Canon(n, tuple(t.shape))) for n, t in self.tensors.items()),
        )
        self.client = MemberClient(
            target,
            role="trainer",
            member_id="trainer-0",
            coords={"pp": 0, "dp": 0, "ep": 0, "tp": 0},
            catalog=catalog,
            weight_version=1,
        )  # it holds checkpoint B as version 1
        self.transports: dict = {}
        self.hold = hold  # ExecutePlan waits for it: a refit stays in TRANSFERRING until it is set
        self.client.start(self.handle)

    def handle(self, cmd) -> None:
        from syncd.commands import Abort, Commit, ExecutePlan, JoinGroup, Phase, Verify
        from syncd.member.dataplane import GlooTransport, LoopOptions, send_buckets

        report = self.client.report
        if isinstance(cmd, JoinGroup):
            address, store = (cmd.address, None)
            if cmd.rank == 0 and not address:
                address, store = GlooTransport.create_address("127.0.0.1", cmd.world_size, 60)
                report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
            self.transports[cmd.group_id] = (
                GlooTransport.connect(address, cmd.rank, cmd.world_size, cmd.group_id, 60, store=store),
                cmd.members,
            )
            report(cmd.refit_id, Phase.JOINED)
        elif isinstance(cmd, ExecutePlan):
            if self.hold is not None:
                self.hold.wait(120)
            stats_bytes, sums = 0, {}
            for group in cmd.groups:
                transport, members = self.transports[group.group_id]
                mine = [b for b in cmd.buckets if b.src == "trainer-0" and b.stage == group.stage]
                stats = send_buckets(
                    mine, self.tensors, transport, {m: i for i, m in enumerate(members)}, LoopOptions(60)
                )
                stats_bytes += stats.bytes
                sums.update(stats.checksums)
            report(cmd.refit_id, Phase.TRANSFERRED, bytes=stats_bytes, checksums=sums)
        elif isinstance(cmd, (Verify, Commit)):
            report(cmd.refit_id, Phase.VERIFIED if isinstance(cmd, Verify) else Phase.COMMITTED)
        elif isinstance(cmd, Abort):
            report(cmd.refit_id, Phase.ABORTED)

    def close(self) -> None:
        self.client.close()


def test_refit_driven_by_syncd_moves_b_into_the_generator(
    syncd, generator, checkpoints, outputs_fresh_b
) -> None:
    target, syncd_http = syncd
    service = generator
    trainer = FakeTrainer(target, checkpoints["B"])
    try:
        deadline = time.monotonic() + 30
        while syncd_http.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, syncd_http.get("/readyz").text
            time.sleep(0.2)
        r = syncd_http.post("/v1/refits", json={"weight_version": 1})
        assert r.status_code == 202, r.text
        refit = wait_final(lambda path: syncd_http.get(path).json(), r.json()["id"], 120)
        assert refit["state"] == "COMMITTED", refit["error"] + "\n" + service.log_tail()
        assert refit["bytes"] == service.http.get("/v1/workers").json()[0]["nbytes"]
        assert service.http.get("/v1/weight_version").json()["version"] == "1"
        assert service.outputs() == outputs_fresh_b
    finally:
        trainer.close()


def _wait(what: str, condition, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _members(syncd_http: httpx.Client) -> list[str]:
    return [m["member_id"] for m in syncd_http.get("/v1/members").json()["members"]]


def test_a_frozen_worker_makes_healthz_answer_503_at_once(generator) -> None:
    """SIGSTOP on the vLLM worker turns /healthz 503 (answered, not hung); SIGCONT heals."""
    (worker,) = generator.http.get("/v1/workers").json()
    probe = httpx.Client(base_url=generator.url, timeout=5)  # a hung /healthz fails the test
    assert probe.get("/healthz").status_code == 200
    os.kill(worker["pid"], signal.SIGSTOP)
    try:
        frozen = _wait("503 from /healthz", lambda: (r := probe.get("/healthz")).status_code == 503 and r, 30)
        assert frozen.json()["status"] == "worker not answering"
        assert f"generator-3-0 (pid {worker['pid']}) has not answered" in frozen.json()["reason"]
    finally:
        os.kill(worker["pid"], signal.SIGCONT)
    _wait("200 from /healthz after SIGCONT", lambda: probe.get("/healthz").status_code == 200, 30)
    probe.close()


def test_a_restarted_generator_is_not_ready_until_caught_up(syncd, generator, checkpoints, tmp_path):
    """Restarted after version 1 committed, the generator serves its --model checkpoint
    (A) and says so in /readyz (503) until syncd's catch-up refit of version 1 (B) reaches it; then
    it generates exactly what it generated before the restart, and is ready."""
    target, syncd_http = syncd
    hold = threading.Event()
    trainer = FakeTrainer(target, checkpoints["B"], hold)
    restarted = None
    try:
        _wait("syncd ready", lambda: syncd_http.get("/readyz").status_code == 200)
        if syncd_http.get("/v1/status").json()["committed_version"] != 1:
            hold.set()
            refit_id = syncd_http.post("/v1/refits", json={"weight_version": 1}).json()["id"]
            wait_final(lambda path: syncd_http.get(path).json(), refit_id, 120)
            hold.clear()
        _wait("generator ready", lambda: generator.http.get("/readyz").status_code == 200)
        assert generator.http.get("/v1/weight_version").json()["version"] == "1"
        before = generator.outputs()

        generator.stop()  # SIGTERM to its process group, as a terminal's Ctrl-C or scancel
        assert "generator-3-0" not in _members(syncd_http)  # its worker left on its way out
        restarted = Service(checkpoints["A"], tmp_path / "restarted.log", "--syncd", target, "--replica", "3")
        restarted.wait_ready()  # /healthz: alive (liveness), serving checkpoint A
        behind = _wait(
            "/readyz naming the catch-up",
            lambda: "catch-up" in (r := restarted.http.get("/readyz")).json().get("reason", "") and r,
        )
        assert behind.status_code == 503
        assert "serves its start-up checkpoint but syncd committed version 1" in behind.json()["reason"]
        assert syncd_http.get("/readyz").status_code == 503  # syncd holds the catch-up refit (held by `hold`)

        hold.set()
        _wait("generator caught up", lambda: restarted.http.get("/readyz").status_code == 200)
        assert restarted.http.get("/v1/weight_version").json()["version"] == "1"
        assert restarted.outputs() == before
        refits = syncd_http.get("/v1/refits").json()["refits"]
        assert (refits[0]["weight_version"], refits[0]["state"]) == (1, "COMMITTED")
    finally:
        hold.set()
        trainer.close()
        if restarted is not None:
            restarted.stop()


def test_a_sigterm_to_the_main_process_makes_the_workers_leave_syncd_first(syncd, checkpoints, tmp_path):
    """Kubernetes signals the container's main process only, and vLLM then kills its engine at once:
    the workers leave syncd before that (`generator_svc.server.leave_on_shutdown`), so syncd ends their
    sessions now, not when their leases (600 s here) run out."""
    _, syncd_http = syncd
    service = Service(checkpoints["A"], tmp_path / "stopped.log", "--syncd", syncd[0], "--replica", "5")
    try:
        service.wait_ready()
        _wait("generator-5-0 registered", lambda: "generator-5-0" in _members(syncd_http))
        os.kill(service.proc.pid, signal.SIGTERM)
        assert service.proc.wait(120) == 0, service.log_tail()
    finally:
        service.stop()
    assert "generator-5-0" not in _members(syncd_http)
    assert "the workers left syncd" in service.log.read_text(errors="replace"), service.log_tail()
