"""Fan-out refits through a real syncd, with every member a real process (`testkit/plain_member.py`:
the real client, agent and gloo data plane over loopback, plain tensors instead of vLLM): replicas
of one layout relay what they receive; every replica ends bit-exact; a replica killed mid-relay
leaves nothing torn and the survivors commit on syncd's retry; a stuck member ends in an abort that
names it."""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from deploy.local.processes import PYTHON, Cluster, Proc
from syncd.daemon.service import Daemon
from syncd.plan.simulate import materialize
from syncd.refit_wait import wait_final
from testkit.plain_member import TINY, canonical_values, loaded_marker
from testkit.synthetic_moe import vllm_catalog
from tests.polling import wait_until
from tests.syncd_settings import syncd_settings


@dataclass
class Fleet:
    """syncd (in this process) and member processes on loopback."""

    daemon: Daemon
    procs: Cluster
    tmp: Path
    http: httpx.Client
    generators: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # id -> (replica, tp, rank)
    trainers: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.daemon.grpc_port}"

    def member(self, *args: str, name: str) -> Proc:
        cmd = [PYTHON, "-m", "testkit.plain_member", "--syncd", self.target, "--model", "tiny", *args]
        return self.procs.start(name, cmd)

    def trainer(self, ep: int, ep_rank: int) -> Proc:
        self.trainers.append(f"trainer-{ep_rank}")
        return self.member(
            "--role", "trainer", "--ep", str(ep), "--ep-rank", str(ep_rank),
            "--announce-file", str(self.tmp / "version"), name=f"trainer-{ep_rank}",
        )  # fmt: skip

    def generator(self, replica: int, tp: int, rank: int, *extra: str) -> Proc:
        member_id = f"generator-{replica}-{rank}"
        self.generators[member_id] = (replica, tp, rank)
        return self.member(
            "--role", "generator", "--replica", str(replica), "--tp", str(tp), "--tp-rank", str(rank),
            "--digest-file", str(self.digest_file(member_id)), *extra, name=member_id,
        )  # fmt: skip

    def digest_file(self, member_id: str) -> Path:
        return self.tmp / f"{member_id}.json"

    def announce(self, version: int) -> None:
        """Every trainer rank holds `version` and announced it."""
        (self.tmp / "version").write_text(str(version))
        markers = [loaded_marker(self.tmp / "version", t) for t in self.trainers]
        wait_until(
            lambda: all(m.exists() and m.read_text() == str(version) for m in markers),
            30,
            f"the trainers to announce version {version}",
        )

    def refit(self, version: int) -> dict:
        self.announce(version)
        r = self.http.post("/v1/refits", json={"weight_version": version})
        assert r.status_code == 202, r.text
        return self.final(r.json()["id"])

    def final(self, refit_id: str) -> dict:
        return dict(wait_final(lambda path: self.http.get(path).json(), refit_id, 120, poll_s=0.1))

    def assert_bit_exact(self, member_id: str, version: int) -> None:
        """The generator's committed tensors, every byte, against the version's canonical values."""
        _, tp, rank = self.generators[member_id]
        body = json.loads(self.digest_file(member_id).read_text())
        assert body["version"] == version, (member_id, body["version"])
        expected = materialize(vllm_catalog(TINY, tp, rank), canonical_values(TINY, version))
        for name, arr in expected.items():
            digest = hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8)).hexdigest()
            assert body["sha256"][name] == digest, f"{member_id}/{name} differs from version {version}"

    def assert_nothing_torn_by(self, member_id: str, refit_id: str) -> None:
        """`refit_id` aborted: the member never committed it and holds exactly the version it last
        committed (syncd's retry may have committed the same version since)."""
        body = json.loads(self.digest_file(member_id).read_text())
        assert body["refit"] != refit_id, (member_id, refit_id)
        self.assert_bit_exact(member_id, body["version"])

    def ready(self, timeout_s: float = 90) -> None:
        wait_until(
            lambda: self.http.get("/readyz").status_code == 200, timeout_s, "syncd ready", interval=0.3
        )


@pytest.fixture
def fleet(tmp_path: Path, request) -> Iterator[Fleet]:
    options = getattr(request, "param", {})
    settings = syncd_settings(
        tmp_path,
        prepare_timeout=60,
        transfer_timeout=60,
        bucket_bytes=32 << 10,  # a few dozen buckets per link: a relay forwards while it receives
        **options,
    )
    daemon = Daemon(settings)
    daemon.start()
    http = httpx.Client(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=30)
    with Cluster(tmp_path / "logs") as procs:
        yield Fleet(daemon, procs, tmp_path, http)
    http.close()
    daemon.stop()


@pytest.mark.parametrize("fleet", [{"expected_trainers": 2, "expected_generators": 7}], indirect=True)
def test_replicas_relay_each_layout_and_every_replica_is_bit_exact(fleet):
    """Trainer ep 2; three TP-1 replicas (a chain of three) and two TP-2 replicas (a chain of two
    per TP rank). Two refits; the trainers send one copy per layout."""
    for r in range(2):
        fleet.trainer(2, r)
    for replica in range(3):
        fleet.generator(replica, 1, 0)
    for replica in (3, 4):
        for rank in range(2):
            fleet.generator(replica, 2, rank)
    fleet.ready()
    plan = fleet.http.get("/v1/plan").json()
    relays = sorted((k["src"], k["dst"]) for k in plan["links"] if k["relay"])
    assert relays == [
        ("generator-0-0", "generator-1-0"),
        ("generator-1-0", "generator-2-0"),
        ("generator-3-0", "generator-4-0"),
        ("generator-3-1", "generator-4-1"),
    ]
    tp1 = sum(t.nbytes for t in vllm_catalog(TINY, 1, 0).tensors)
    tp2 = sum(t.nbytes for r in range(2) for t in vllm_catalog(TINY, 2, r).tensors)
    assert plan["source_bytes"] == tp1 + tp2  # one copy per layout, whatever the replicas
    assert plan["total_bytes"] == 3 * tp1 + 2 * tp2
    senders = {k["src"] for k in plan["links"] if not k["relay"]}
    assert senders == {"trainer-0", "trainer-1"}

    for version in (1, 2):
        state = fleet.refit(version)
        assert state["state"] == "COMMITTED", state
        assert state["bytes"] == plan["total_bytes"], state  # what the generators received
        for member_id in fleet.generators:
            fleet.assert_bit_exact(member_id, version)


@pytest.mark.parametrize("fleet", [{"expected_trainers": 1, "expected_generators": 3}], indirect=True)
def test_a_replica_killed_mid_relay_leaves_nothing_torn_and_the_survivors_commit(fleet):
    """A chain trainer -> generator-0-0 -> generator-1-0 -> generator-2-0; generator-1-0 (a relay)
    is killed in the middle of the refit of version 2. syncd aborts, waits out its lease, retries
    over generator-0-0 -> generator-2-0, which commit version 2; generator-1-0, started again,
    catches up to version 2."""
    fleet.trainer(1, 0)
    for replica in range(3):
        extra = ("--hold-begin-s", "600", "--hold-from-version", "2") if replica == 1 else ()
        fleet.generator(replica, 1, 0, *extra)
    fleet.ready()
    assert fleet.refit(1)["state"] == "COMMITTED"
    victim = next(p for p in fleet.procs.procs if p.name == "generator-1-0")

    fleet.announce(2)
    first = fleet.http.post("/v1/refits", json={"weight_version": 2}).json()["id"]
    wait_until(lambda: "holding" in victim.tail(), 60, "generator-1-0 to be in its transfer")
    victim.popen.send_signal(signal.SIGKILL)
    aborted = fleet.final(first)
    assert aborted["state"] == "ABORTED", aborted
    for member_id in ("generator-0-0", "generator-2-0"):
        fleet.assert_nothing_torn_by(member_id, first)

    def retried() -> dict | None:
        refits = fleet.http.get("/v1/refits").json()["refits"]
        return next((r for r in refits if r["id"] != first and r["weight_version"] == 2), None)

    wait_until(lambda: retried() is not None, 30, "syncd to retry over the survivors")
    retry = fleet.final(retried()["id"])
    assert retry["state"] == "COMMITTED", retry
    for member_id in ("generator-0-0", "generator-2-0"):
        fleet.assert_bit_exact(member_id, 2)

    fleet.generator(1, 1, 0)  # back, serving version 0: syncd's catch-up refit brings it to 2
    wait_until(
        lambda: (
            fleet.digest_file("generator-1-0").exists()
            and json.loads(fleet.digest_file("generator-1-0").read_text())["version"] == 2
        ),
        90,
        "generator-1-0 to catch up",
    )
    fleet.assert_bit_exact("generator-1-0", 2)
    fleet.ready()


@pytest.mark.parametrize(
    "fleet", [{"expected_trainers": 1, "expected_generators": 3, "stall_timeout": 5}], indirect=True
)
def test_a_stuck_relay_ends_in_an_abort_that_names_it(fleet):
    """generator-1-0, the middle of the chain, never takes its buckets: its successor's receive
    stalls, and the refit aborts within the stall timeout naming generator-1-0; nobody commits."""
    fleet.trainer(1, 0)
    for replica in range(3):
        fleet.generator(replica, 1, 0, *(("--hold-begin-s", "600") if replica == 1 else ()))
    fleet.ready()
    state = fleet.refit(1)
    assert state["state"] == "ABORTED", state
    assert "generator-1-0 is slow or stuck" in state["error"], state["error"]
    assert not any(fleet.digest_file(m).exists() for m in fleet.generators)
