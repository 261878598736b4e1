"""Fan-out across lab hosts: a relay whose link goes down mid-refit. Every member is a process on
its own lab host (`testkit/plain_member.py`, gloo over the lab's shaped links); syncd runs here and
is reached through the lab's gateway.

The chain trainer -> generator-0-0 -> generator-1-0 -> generator-2-0; generator-1-0's cable is
pulled while it is in the refit of version 2: nobody commits that refit, syncd's retry (once the
lease ran out) commits version 2 on generator-0-0 and generator-2-0 (the members blocked on the
cut-off relay are freed by syncd's Abort), and generator-1-0, plugged back in, registers again and
gets the catch-up refit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.lab import Lab
from deploy.local.processes import PYTHON, Cluster, Proc
from syncd.auth import ENV_TOKEN_FILE
from syncd.daemon.service import Daemon
from tests.integration.test_fanout_refit import Fleet
from tests.lab_support import running_lab
from tests.polling import wait_until
from tests.syncd_settings import syncd_settings


class LabFleet(Fleet):
    """`Fleet` with every member on its own lab host."""

    lab: Lab
    hosts: dict[str, str]  # member (process) name -> lab host

    @property
    def target(self) -> str:
        return f"{self.lab.gateway}:{self.daemon.grpc_port}"

    def member(self, *args: str, name: str) -> Proc:
        host = self.hosts[name]
        cmd = [PYTHON, "-m", "testkit.plain_member", "--syncd", self.target, "--model", "tiny"]
        return self.lab.spawn(host, [*cmd, *args, "--host", self.lab.address(host)], name=name)


@pytest.fixture
def lab_fleet(tmp_path: Path) -> Iterator[LabFleet]:
    hosts = {"trainer-0": "t0", "generator-0-0": "g0", "generator-1-0": "g1", "generator-2-0": "g2"}
    with running_lab(sorted(set(hosts.values())), "fan", tmp_path / "logs") as lab:
        token = lab.cluster.make_token(tmp_path)  # syncd serves the lab's network: members need it
        settings = syncd_settings(
            tmp_path,
            host="0.0.0.0",
            auth_token_file=lab.cluster.env[ENV_TOKEN_FILE],
            prepare_timeout=60,
            transfer_timeout=60,
            bucket_bytes=32 << 10,
            # The default stall timeout (30 s; sends 2 x 30 s x 1.x): a member blocked on the
            # cut-off relay (no RST) is free for the retry's groups at syncd's Abort, which breaks
            # its groups, not when its waits give up (that would outlast the retry's PREPARING).
            expected_trainers=1,
            expected_generators=3,
        )
        daemon = Daemon(settings)
        daemon.start()
        http = httpx.Client(
            base_url=f"http://127.0.0.1:{settings.http_port}",
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )
        fleet = LabFleet(daemon, Cluster(tmp_path / "unused"), tmp_path, http)
        fleet.lab, fleet.hosts = lab, hosts
        try:
            yield fleet
        finally:
            lab.cluster.stop()
            http.close()
            daemon.stop()


def test_a_relay_cut_off_mid_refit_leaves_nothing_torn_and_catches_up(lab_fleet):
    fleet = lab_fleet
    fleet.trainer(1, 0)
    for replica in range(3):
        extra = ("--hold-begin-s", "6", "--hold-from-version", "2") if replica == 1 else ()
        fleet.generator(replica, 1, 0, *extra)
    fleet.ready()
    assert fleet.refit(1)["state"] == "COMMITTED"
    victim = next(p for p in fleet.lab.cluster.procs if p.name == "generator-1-0")

    fleet.announce(2)
    first = fleet.http.post("/v1/refits", json={"weight_version": 2}).json()["id"]
    wait_until(lambda: "holding" in victim.tail(), 60, "generator-1-0 to be in its transfer")
    fleet.lab.link_down("g1")
    aborted = fleet.final(first)
    assert aborted["state"] == "ABORTED", aborted
    for member_id in ("generator-0-0", "generator-2-0"):
        fleet.assert_nothing_torn_by(member_id, first)

    def retried() -> dict | None:
        refits = fleet.http.get("/v1/refits").json()["refits"]
        return next((r for r in refits if r["id"] != first and r["weight_version"] == 2), None)

    wait_until(lambda: retried() is not None, 30, "syncd to retry over the survivors")
    assert fleet.final(retried()["id"])["state"] == "COMMITTED"
    for member_id in ("generator-0-0", "generator-2-0"):
        fleet.assert_bit_exact(member_id, 2)

    fleet.lab.link_up("g1")  # back: it registers again behind version 2 and is caught up
    wait_until(
        lambda: json.loads(fleet.digest_file("generator-1-0").read_text())["version"] == 2,
        120,
        "generator-1-0 to catch up",
    )
    fleet.assert_bit_exact("generator-1-0", 2)
