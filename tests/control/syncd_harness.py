"""Harness for the control-plane tests: a real syncd (gRPC + HTTP + SQLite on loopback) and
simulated members that speak the real protocol through MemberClient but move no tensors: their
handlers report the bytes of their plan part and a checksum derived from each unit's key, so
senders and receivers agree unless a test corrupts one."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from syncd import http_client
from syncd.commands import Abort, Command, Commit, ExecutePlan, JoinGroup, Phase, Verify, checksum_key
from syncd.daemon.service import Daemon
from syncd.daemon.settings import Settings
from syncd.layout import Canon, CanonicalTensor, Catalog, Shard, Sharded, local_tensor
from syncd.member.client import MemberClient
from syncd.refit_wait import wait_final
from tests.polling import wait_until
from tests.syncd_settings import syncd_settings

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TOKEN = "s3cret"

# A toy model: stage 0 holds the embedding, stage 1 the grouped experts and the head.
EMBED = CanonicalTensor("model.embed_tokens.weight", (16, 8), "float32")
GATE = CanonicalTensor("model.layers.0.mlp.experts.gate_proj.weight", (4, 6, 8), "bfloat16")
HEAD = CanonicalTensor("lm_head.weight", (16, 8), "float32")
STAGES = {0: (EMBED,), 1: (GATE, HEAD)}


def trainer_catalog(stage: int) -> Catalog:
    tensors = tuple(local_tensor(c.name, c.dtype, Canon(c.name, c.shape)) for c in STAGES[stage])
    return Catalog(STAGES[stage], tensors)


def generator_catalog(tp: int, tp_size: int = 2) -> Catalog:
    canon = (EMBED, GATE, HEAD)
    tensors = tuple(
        local_tensor(
            c.name, c.dtype, Sharded(Canon(c.name, c.shape), (Shard(len(c.shape) - 2),), (tp_size,), (tp,))
        )
        for c in canon
    )
    return Catalog(canon, tensors)


def fake_checksum(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class Behaviour:
    """What a simulated member does besides following the protocol."""

    corrupt: frozenset[str] = frozenset()  # canonical tensors whose received checksum is wrong
    on_execute: Callable[[ExecutePlan], None] | None = None  # called before reporting TRANSFERRED
    fail_verify: str = ""  # error text to report instead of VERIFIED
    die_on_execute: bool = False  # on ExecutePlan: stop heartbeating and never answer (a crash)
    reported_bytes: int | None = None  # bytes to report in TRANSFERRED instead of the plan's
    on_commit: Callable[[Commit], None] | None = None  # called on Commit instead of confirming it
    on_abort: Callable[[Abort], None] | None = None  # called on Abort (on the client's abort thread)


@dataclass
class FakeMember:
    client: MemberClient
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[Command] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    @property
    def member_id(self) -> str:
        return self.client.member_id

    def of_type(self, kind: type) -> list:
        return [c for c in self.received if isinstance(c, kind)]

    def handle(self, cmd: Command) -> None:
        self.received.append(cmd)
        c = self.client
        match cmd:
            case JoinGroup(rank=0, address=""):
                c.report(cmd.refit_id, Phase.GROUP_ADDRESS, address=f"127.0.0.1:{29500 + cmd.stage}")
                c.report(cmd.refit_id, Phase.JOINED)
            case JoinGroup():
                assert cmd.address, "non-root ranks get the relayed address"
                c.report(cmd.refit_id, Phase.JOINED)
            case ExecutePlan() if self.behaviour.die_on_execute:
                threading.Thread(target=c.close, kwargs={"leave": False}).start()
            case ExecutePlan():
                if self.behaviour.on_execute is not None:
                    self.behaviour.on_execute(cmd)
                self._transfer(cmd)
            case Verify():
                if self.behaviour.fail_verify:
                    c.report(cmd.refit_id, Phase.VERIFIED, ok=False, error=self.behaviour.fail_verify)
                else:
                    c.report(cmd.refit_id, Phase.VERIFIED)
            case Commit() if self.behaviour.on_commit is not None:
                self.behaviour.on_commit(cmd)
            case Commit():
                self.committed.append(cmd.weight_version)
                c.report(cmd.refit_id, Phase.COMMITTED)
            case Abort() if self.behaviour.on_abort is not None:
                self.behaviour.on_abort(cmd)
            case Abort():
                pass

    def _transfer(self, cmd: ExecutePlan) -> None:
        sums, nbytes = {}, 0
        for b in cmd.buckets:
            nbytes += b.nbytes
            for u in b.units:
                key = checksum_key(u.canonical, u.canon)
                bad = b.dst == self.member_id and u.canonical in self.behaviour.corrupt
                sums[key] = fake_checksum(key + ("flipped" if bad else ""))
        if self.behaviour.reported_bytes is not None:
            nbytes = self.behaviour.reported_bytes
        self.client.report(
            cmd.refit_id, Phase.TRANSFERRED, bytes=nbytes, checksums=sums, timings={"transfer_s": 0.001}
        )


MEMBERS = {
    "trainer-0": ("trainer", {"pp": 0, "dp": 0, "ep": 0, "tp": 0}, lambda: trainer_catalog(0)),
    "trainer-1": ("trainer", {"pp": 1, "dp": 0, "ep": 0, "tp": 0}, lambda: trainer_catalog(1)),
    "generator-0-0": ("generator", {"replica": 0, "tp": 0}, lambda: generator_catalog(0)),
    "generator-0-1": ("generator", {"replica": 0, "tp": 1}, lambda: generator_catalog(1)),
}
# A second replica of the same layout, for tests of a fleet that loses one (`start_all` leaves it
# out; a test starts it).
SECOND_REPLICA = {
    "generator-1-0": ("generator", {"replica": 1, "tp": 0}, lambda: generator_catalog(0)),
    "generator-1-1": ("generator", {"replica": 1, "tp": 1}, lambda: generator_catalog(1)),
}


def make_member(
    target: str,
    member_id: str,
    token: str | None = None,
    *,
    run_id: str = "",
    weight_version: int | None = None,
    host_id: str | None = None,
    device: str = "",
    gpu_id: str = "",
    gpu_peers: tuple[str, ...] = (),
    **behaviour: object,
) -> FakeMember:
    role, coords, catalog = {**MEMBERS, **SECOND_REPLICA}[member_id]
    # Only what a test sets is passed, so the harness also drives an older syncd (to show a
    # regression test fails there).
    optional = {
        k: v
        for k, v in (
            ("run_id", run_id),
            ("weight_version", weight_version),
            ("host_id", host_id),
            ("device", device),
            ("gpu_id", gpu_id),
            ("gpu_peers", gpu_peers),
        )
        if v not in ("", None, ())
    }
    client = MemberClient(
        target, role=role, member_id=member_id, coords=coords, catalog=catalog(), auth_token=token, **optional
    )
    return FakeMember(client, Behaviour(**behaviour))  # type: ignore[arg-type]


def base_settings(tmp_path: Path, **overrides: object) -> Settings:
    """Two trainers and two generators of simulated members, tiny buckets (many per refit)."""
    return syncd_settings(
        tmp_path,
        **{
            "lease_seconds": 5.0,
            "prepare_timeout": 20.0,
            "transfer_timeout": 20.0,
            "verify_timeout": 20.0,
            "commit_timeout": 20.0,
            "bucket_bytes": 256,
            "expected_trainers": 2,
            "expected_generators": 2,
            "backend": "auto",
            **overrides,
        },
    )


@dataclass
class Cluster:
    """A running syncd plus HTTP access and the members started against it."""

    daemon: Daemon
    http: httpx.Client
    members: dict[str, FakeMember] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.daemon.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.daemon.settings.http_port}"

    def start_member(
        self,
        member_id: str,
        *,
        run_id: str = "",
        weight_version: int | None = None,
        host_id: str | None = None,
        device: str = "",
        gpu_id: str = "",
        gpu_peers: tuple[str, ...] = (),
        **behaviour: object,
    ) -> FakeMember:
        m = make_member(
            self.target,
            member_id,
            self.daemon.settings.auth_token,
            run_id=run_id,
            weight_version=weight_version,
            host_id=host_id,
            device=device,
            gpu_id=gpu_id,
            gpu_peers=gpu_peers,
            **behaviour,
        )
        m.client.start(m.handle)
        self.members[member_id] = m
        return m

    def start_all(self, run_id: str = "", **behaviour_by_member: dict) -> None:
        for member_id in MEMBERS:
            self.start_member(
                member_id,
                run_id=run_id if member_id.startswith("trainer") else "",
                **behaviour_by_member.get(member_id, {}),
            )
        wait_until(lambda: self.http.get("/readyz").status_code == 200, what="syncd ready")

    def announce(self, version: int) -> None:
        self.members["trainer-0"].client.announce_version(version)

    def restart_trainers(self, run_id: str, weight_version: int | None = None) -> None:
        """The trainer job restarts: every rank registers again (once its old lease ran out)."""
        for member_id in ("trainer-0", "trainer-1"):
            self.members.pop(member_id).client.close()
        for member_id in ("trainer-0", "trainer-1"):
            self.start_member(member_id, run_id=run_id, weight_version=weight_version)
        for member_id in ("trainer-0", "trainer-1"):
            assert self.members[member_id].client.wait_registered()

    def refit(self, **body: object) -> dict:
        """Trigger a refit; a `weight_version` is first announced by the trainers (they hold it)."""
        if "weight_version" in body:
            self.announce(body["weight_version"])  # type: ignore[arg-type]
        token = self.daemon.settings.auth_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = self.http.post("/v1/refits", json=body, headers=headers)
        assert r.status_code == 202, r.text
        return r.json()

    def wait_refit(self, refit_id: str, timeout_s: float = 30) -> dict:
        return dict(wait_final(lambda path: self.http.get(path).json(), refit_id, timeout_s, poll_s=0.02))

    def close(self) -> None:
        for m in self.members.values():
            m.client.close()
        self.http.close()


class SyncdProcess:
    """`python -m syncd` in a subprocess, as an operator would run it."""

    def __init__(self, db: Path, http_port: int, grpc_port: int, *extra: str) -> None:
        self.url = f"http://127.0.0.1:{http_port}"
        self.target = f"127.0.0.1:{grpc_port}"
        self.args = [
            PYTHON,
            "-m",
            "syncd",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--db",
            str(db),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> SyncdProcess:
        self.proc = subprocess.Popen(
            self.args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

        def healthy() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            try:
                return http_client.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, what="syncd to serve")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, as when the node or the OOM killer ends syncd."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=20)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
