"""With a token configured, mutating HTTP calls and member RPCs need `Bearer <token>`."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from syncd_harness import TOKEN, generator_catalog, make_member, wait_until

from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc


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
