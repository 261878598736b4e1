"""syncd's token across hosts of a lab: syncd serves its lab address, and a member on another host
without the token, or with a wrong one, is refused, says which, and never registers (so never
joins a group); with the token it registers. An HTTP POST from another host without the token gets
401. The same syncd without a token refuses to start on that address, naming the flags."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lab import Lab
from deploy.local.processes import Proc
from syncd import http_client
from syncd.auth import ENV_TOKEN_FILE, write_token_file
from syncd.net import free_port
from tests.lab_support import running_lab
from tests.polling import wait_until

PY = sys.executable
# A trainer rank of a one-layer model attached with `syncd.member.attach`: it prints whether
# syncd registered it or why syncd refused it.
MEMBER = textwrap.dedent(
    """
    import sys, torch
    from syncd.member.attach import attach
    try:
        handle = attach(torch.nn.Linear(4, 4), syncd=sys.argv[1], names=lambda name, shape: name,
                        data_host=sys.argv[2], register_timeout_s=120)
    except PermissionError as refused:
        print("REFUSED", refused, flush=True)
        sys.exit(3)
    print("REGISTERED", flush=True)
    handle.close()
    """
)


class Secured:
    def __init__(self, lab: Lab, work: Path) -> None:
        self.lab, self.work = lab, work
        self.token = lab.cluster.make_token(work)  # every process the lab starts gets its path
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://{lab.address('syncd')}:{self.http_port}"
        self.target = f"{lab.address('syncd')}:{self.grpc_port}"

    def start_syncd(self, name: str = "syncd", env: dict[str, str] | None = None) -> Proc:
        argv = [PY, "-m", "syncd", "--host", self.lab.address("syncd"), "--db", str(self.work / f"{name}.db")]
        argv += ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        return self.lab.spawn("syncd", argv, env=env, name=name)

    def member(self, name: str, env: dict[str, str] | None = None) -> Proc:
        argv = [PY, "-c", MEMBER, self.target, self.lab.address("member")]
        return self.lab.spawn("member", argv, env=env, name=name)

    def members(self) -> list[str]:
        return [
            m["member_id"] for m in http_client.get(f"{self.url}/v1/members", timeout=10).json()["members"]
        ]


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    with running_lab(["syncd", "member"], "auth", tmp_path / "logs") as lab:
        secured = Secured(lab, tmp_path)
        syncd = secured.start_syncd()
        lab.cluster.wait_http(syncd, f"{secured.url}/healthz", 60)
        yield secured


def _finished(proc: Proc) -> str:
    wait_until(lambda: not proc.alive(), 180, f"{proc.name} to end")
    return proc.log.read_text()


def test_members_without_the_right_token_are_refused_and_never_register(secured, tmp_path):
    wrong = tmp_path / "wrong-token"
    write_token_file(wrong)
    for name, env, why in (
        ("no-token", {ENV_TOKEN_FILE: ""}, f"no token given: set {ENV_TOKEN_FILE}"),
        ("wrong-token", {ENV_TOKEN_FILE: str(wrong)}, "syncd refused the token"),
    ):
        refused = secured.member(name, env)
        out = _finished(refused)
        assert refused.popen.returncode == 3 and f"REFUSED trainer-0: syncd at {secured.target}" in out, out
        assert why in out, out
        assert secured.members() == []  # never registered: no plan or group can include it
    accepted = secured.member("with-token")
    out = _finished(accepted)
    assert accepted.popen.returncode == 0 and "REGISTERED" in out, out


def test_an_http_post_from_another_host_without_the_token_gets_401(secured):
    post = f"import httpx; print(httpx.post({secured.url + '/v1/refits'!r}, json={{}}).status_code)"
    asked = secured.lab.spawn("member", [PY, "-c", post], name="post")
    assert _finished(asked).strip().endswith("401")
    with_token = {"Authorization": f"Bearer {secured.token}"}
    ok = http_client.post(f"{secured.url}/v1/refits", json={}, headers=with_token, timeout=10)
    assert ok.status_code == 409, ok.text  # past the token, refused on merit (nobody registered)


def test_syncd_without_a_token_refuses_to_serve_the_lab_naming_the_flags(secured):
    secured.http_port, secured.grpc_port = free_port(), free_port()
    refused = secured.start_syncd("open-syncd", env={ENV_TOKEN_FILE: ""})
    out = _finished(refused)
    assert refused.popen.returncode != 0, out
    assert f"refusing to serve on {secured.lab.address('syncd')} without a token" in out, out
    assert "--auth-token-file" in out and "--insecure-no-auth" in out, out
