"""With a token configured, mutating HTTP calls and member RPCs need `Bearer <token>`; without
one, syncd serves loopback alone unless `--insecure-no-auth` says otherwise, and says so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from syncd_harness import PYTHON, REPO, TOKEN, SyncdProcess, generator_catalog, make_member, wait_until

from syncd import http_client
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.auth import ENV_TOKEN, ENV_TOKEN_FILE, TokenError, is_loopback, resolve_token, write_token_file
from syncd.daemon.settings import Settings
from syncd.net import free_port


@pytest.fixture
def secured(make_cluster):
    return make_cluster(auth_token=TOKEN)


@pytest.mark.parametrize("path", ["/v1/refits", "/v1/refits/refit-1/abort"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", TOKEN])
def test_mutating_http_calls_need_the_token(secured, path: str, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    r = secured.http.post(path, json={"weight_version": 1}, headers=headers)
    assert r.status_code == 401
    assert "credentials" in r.json()["error"]["message"]
    assert secured.http.get("/v1/refits").json()["refits"] == []


def test_reads_stay_open_and_the_right_token_passes(secured) -> None:
    assert secured.http.get("/v1/members").status_code == 200
    assert secured.http.get("/readyz").status_code == 503
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = secured.http.post("/v1/refits", json={"weight_version": 1}, headers=headers)
    assert r.status_code == 409 and "not ready" in r.json()["error"]["message"]  # past auth, refused on merit


def test_grpc_without_token_is_unauthenticated(secured) -> None:
    request = pb.RegisterRequest(
        role=pb.ROLE_GENERATOR,
        member_id="generator-0-0",
        coords={"replica": 0, "tp": 0},
        catalog_hash=generator_catalog(0).content_hash,
    )
    with grpc.insecure_channel(secured.target) as channel:
        stub = pb_grpc.SyncdStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Register(request, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health checks stay open for probes.
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="weightsync.v1.Syncd"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert secured.http.get("/v1/members").json()["members"] == []


def test_member_client_with_token_registers(secured) -> None:
    member = make_member(secured.target, "generator-0-0", token=TOKEN)
    member.client.start(member.handle)
    try:
        wait_until(lambda: secured.http.get("/v1/members").json()["members"], what="registration")
    finally:
        member.client.close()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_refused_member_says_whether_its_token_was_missing_or_wrong(secured, token) -> None:
    member = make_member(secured.target, "generator-0-0", token=token)
    member.client.start(member.handle)
    try:
        assert not member.client.wait_registered(30)  # returns once refused, not after 30 s
        expected = "syncd refused the token" if token else f"no token given: set {ENV_TOKEN_FILE}"
        assert member.client.refusal is not None and expected in member.client.refusal
    finally:
        member.client.close()
    assert secured.http.get("/v1/members").json()["members"] == []


def _syncd(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [PYTHON, "-m", "syncd", "--http-port", str(free_port()), "--grpc-port", str(free_port())]
    argv += ["--db", str(tmp_path / "db"), *flags]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_syncd_refuses_a_network_address_without_a_token_naming_the_flags(tmp_path, host) -> None:
    r = _syncd(tmp_path, "--host", host)
    assert r.returncode != 0
    fixes = ("--auth-token-file", ENV_TOKEN_FILE, "--auth-token", "--insecure-no-auth", "--host 127.0.0.1")
    assert all(fix in r.stderr for fix in fixes), r.stderr
    assert not (tmp_path / "db").exists()  # refused before it opened anything


def test_a_token_and_a_token_file_together_are_refused_naming_both(tmp_path) -> None:
    token_file = tmp_path / "token"
    write_token_file(token_file)
    r = _syncd(tmp_path, "--auth-token-file", str(token_file), env={**os.environ, ENV_TOKEN: TOKEN})
    assert r.returncode != 0 and "--auth-token-file" in r.stderr and "--auth-token " in r.stderr, r.stderr
    r = _syncd(tmp_path, "--insecure-no-auth", "--auth-token", TOKEN)
    assert r.returncode != 0 and "--insecure-no-auth with a token" in r.stderr, r.stderr


def test_insecure_no_auth_serves_open_and_says_so_everywhere(tmp_path) -> None:
    http_port = free_port()
    syncd = SyncdProcess(tmp_path / "db", http_port, free_port(), "--insecure-no-auth")
    syncd.args[syncd.args.index("--host") + 1] = "0.0.0.0"
    syncd.start()
    try:
        status = http_client.get(f"{syncd.url}/v1/status").json()
        assert status["insecure_no_auth"] is True and status["access"] == "insecure-no-auth"
        assert "weightsync_syncd_insecure_no_auth 1.0" in http_client.get(f"{syncd.url}/metrics").text
        assert (
            http_client.post(f"{syncd.url}/v1/refits", json={}).status_code == 409
        )  # open: refused on merit
    finally:
        syncd.stop()
    assert syncd.proc is not None and syncd.proc.stderr is not None
    assert "INSECURE: --insecure-no-auth" in syncd.proc.stderr.read()


def test_status_and_metric_say_how_syncd_is_guarded(make_cluster, secured) -> None:
    open_on_loopback = make_cluster()
    for cluster, access in ((secured, "token"), (open_on_loopback, "loopback")):
        status = cluster.http.get("/v1/status").json()
        assert status["access"] == access and status["insecure_no_auth"] is False
        assert "weightsync_syncd_insecure_no_auth 0.0" in cluster.http.get("/metrics").text


def test_syncd_binds_loopback_unless_told_otherwise() -> None:
    assert Settings().host == "127.0.0.1" and Settings().access == "loopback"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "syncd", "node0")] == [False] * 5


def test_members_find_the_token_by_one_rule(tmp_path) -> None:
    token_file = tmp_path / "token"
    token = write_token_file(token_file)
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token) >= 32
    assert resolve_token(environ={}) is None
    assert resolve_token(environ={ENV_TOKEN_FILE: str(token_file)}) == token
    assert resolve_token(environ={ENV_TOKEN: "t"}) == "t"
    assert resolve_token("flag", environ={ENV_TOKEN: "env"}) == "flag"  # a flag wins over its variable
    assert resolve_token(None, str(token_file), environ={ENV_TOKEN_FILE: "/nowhere"}) == token
    for given in ({"token": "t", "token_file": str(token_file)}, {"token": "t"}):
        with pytest.raises(TokenError, match="both a token file"):  # a file and a value: never a guess
            resolve_token(**given, environ={ENV_TOKEN_FILE: str(token_file)})
    with pytest.raises(TokenError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        resolve_token(token_file=str(tmp_path / "empty"), environ={})
