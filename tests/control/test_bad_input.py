"""Bad member input gets a clear gRPC status naming the problem and changes nothing."""

from __future__ import annotations

import grpc
import pytest
from syncd_harness import MEMBERS, Cluster, generator_catalog, trainer_catalog, wait_until

from syncd.api import convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.daemon.settings import Settings
from syncd.layout import Box, CanonicalTensor, Catalog, LocalTensor, Piece


@pytest.fixture
def stub(cluster: Cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        yield pb_grpc.SyncdStub(channel)


def register(
    stub,
    member_id: str,
    catalog: Catalog,
    *,
    send_catalog: bool = True,
    claimed_hash: str | None = None,
    coords: dict | None = None,
    role: int = pb.ROLE_GENERATOR,
) -> pb.RegisterResponse:
    request = pb.RegisterRequest(
        role=role,
        member_id=member_id,
        coords=coords or {"replica": 5, "tp": 0},
        catalog_hash=claimed_hash or catalog.content_hash,
    )
    if send_catalog:
        request.catalog.CopyFrom(convert.catalog_to_pb(catalog))
    return stub.Register(request, timeout=10)


def member_ids(cluster: Cluster) -> list[str]:
    return [m["member_id"] for m in cluster.http.get("/v1/members").json()["members"]]


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def test_catalog_sent_once_per_hash(cluster: Cluster, stub) -> None:
    catalog = generator_catalog(0)
    first = register(stub, "generator-5-0", catalog, send_catalog=False)
    assert first.catalog_required and not first.session_id
    assert member_ids(cluster) == []  # asking for the catalog registered nothing
    assert register(stub, "generator-5-0", catalog).session_id
    second = register(stub, "generator-6-0", catalog, send_catalog=False, coords={"replica": 6, "tp": 0})
    assert not second.catalog_required and second.session_id
    assert member_ids(cluster) == ["generator-5-0", "generator-6-0"]


def _box_outside() -> Catalog:
    canon = CanonicalTensor("w", (4, 4), "float32")
    piece = Piece("w", Box((2, 0), (6, 4)), Box((0, 0), (4, 4)))
    return Catalog((canon,), (LocalTensor("w", (4, 4), "float32", (piece,)),))


@pytest.mark.parametrize(
    "catalog, message",
    [
        (Catalog((CanonicalTensor("w", (4, 4), "float13"),), ()), "unknown dtype 'float13'"),
        (_box_outside(), "box [2:6, 0:4] is outside canonical tensor w of shape (4, 4)"),
    ],
    ids=["unknown-dtype", "box-outside-canonical"],
)
def test_invalid_catalog_is_rejected(cluster: Cluster, stub, catalog: Catalog, message: str) -> None:
    details = refused(lambda: register(stub, "generator-5-0", catalog), grpc.StatusCode.INVALID_ARGUMENT)
    assert message in details and "generator-5-0" in details
    assert member_ids(cluster) == []


def test_catalog_whose_hash_does_not_match_its_content(cluster: Cluster, stub) -> None:
    real = generator_catalog(0)
    claimed = generator_catalog(1).content_hash
    details = refused(
        lambda: register(stub, "generator-5-0", real, claimed_hash=claimed), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert claimed in details and real.content_hash in details
    assert member_ids(cluster) == []
    # The lie did not poison the hash store: a hash-only registration still needs the catalog.
    assert register(stub, "generator-5-0", generator_catalog(1), send_catalog=False).catalog_required


def test_second_member_claiming_the_same_coordinates(cluster: Cluster, stub) -> None:
    cluster.start_member("generator-0-0")
    wait_until(lambda: member_ids(cluster) == ["generator-0-0"], what="registration")
    coords = MEMBERS["generator-0-0"][1]
    details = refused(
        lambda: register(stub, "generator-impostor", generator_catalog(0), coords=coords),
        grpc.StatusCode.ALREADY_EXISTS,
    )
    assert "generator-0-0" in details and "generator-impostor" in details
    assert member_ids(cluster) == ["generator-0-0"]


def test_unspecified_role_and_trainer_without_stage(cluster: Cluster, stub) -> None:
    catalog = generator_catalog(0)
    assert "role is unspecified" in refused(
        lambda: register(stub, "x", catalog, role=pb.ROLE_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "lack the 'pp' dim" in refused(
        lambda: register(stub, "trainer-9", catalog, role=pb.ROLE_TRAINER, coords={"tp": 0}),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert member_ids(cluster) == []


def test_a_trainer_asking_for_layer_cut_buckets_is_refused(cluster: Cluster, stub) -> None:
    catalog = generator_catalog(0)
    request = pb.RegisterRequest(
        role=pb.ROLE_TRAINER,
        member_id="trainer-9",
        coords={"pp": 0},
        catalog_hash=catalog.content_hash,
        catalog=convert.catalog_to_pb(catalog),
        receive_by_layer=True,
    )
    details = refused(lambda: stub.Register(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "receive_by_layer is for generators" in details
    assert member_ids(cluster) == []


def test_unknown_session_must_register_again(cluster: Cluster, stub) -> None:
    beat = pb.HeartbeatRequest(member_id="ghost", session_id="nope")
    details = refused(lambda: stub.Heartbeat(beat, timeout=10), grpc.StatusCode.NOT_FOUND)
    assert "register again" in details


def test_a_leave_naming_another_session_is_refused_and_ends_nothing(cluster: Cluster, stub) -> None:
    session = register(stub, "generator-5-0", generator_catalog(0)).session_id
    for member_id, session_id in (("generator-5-0", "not-its-session"), ("ghost", session)):
        leave = pb.LeaveRequest(member_id=member_id, session_id=session_id)
        details = refused(lambda leave=leave: stub.Leave(leave, timeout=10), grpc.StatusCode.NOT_FOUND)
        assert "register again" in details
    assert member_ids(cluster) == ["generator-5-0"]
    stub.Leave(pb.LeaveRequest(member_id="generator-5-0", session_id=session), timeout=10)
    assert member_ids(cluster) == []


def test_generators_cannot_announce_versions(cluster: Cluster, stub) -> None:
    session = register(stub, "generator-5-0", generator_catalog(0)).session_id
    report = pb.ReportRequest(
        member_id="generator-5-0", session_id=session, phase=pb.PHASE_ANNOUNCE, ok=True, weight_version=9
    )
    details = refused(lambda: stub.Report(report, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "only trainers" in details
    assert cluster.http.get("/v1/status").json()["announced_version"] is None


def test_negative_weight_versions_are_refused(cluster: Cluster, stub) -> None:
    catalog = trainer_catalog(0)
    request = pb.RegisterRequest(
        role=pb.ROLE_TRAINER,
        member_id="trainer-9",
        coords={"pp": 0},
        catalog_hash=catalog.content_hash,
        catalog=convert.catalog_to_pb(catalog),
        weight_version=-1,
    )
    details = refused(lambda: stub.Register(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "trainer-9" in details and "weight version -1 is not an integer from 0" in details
    assert member_ids(cluster) == []

    request.ClearField("weight_version")
    session = stub.Register(request, timeout=10).session_id
    report = pb.ReportRequest(
        member_id="trainer-9", session_id=session, phase=pb.PHASE_ANNOUNCE, ok=True, weight_version=-3
    )
    details = refused(lambda: stub.Report(report, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "trainer-9" in details and "weight version -3 is not an integer from 0" in details
    assert cluster.http.get("/v1/status").json()["announced_version"] is None


def test_http_bad_input_is_a_json_error(cluster: Cluster) -> None:
    r = cluster.http.post("/v1/refits", json={"weight_version": "latest"})
    assert r.status_code == 422 and "weight_version" in r.json()["error"]["message"]
    r = cluster.http.get("/v1/refits/refit-404")
    assert r.status_code == 404 and r.json() == {
        "error": {"message": "no refit 'refit-404'", "type": "NotFound", "code": 404}
    }
    r = cluster.http.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = cluster.http.get("/v1/plan")  # nobody registered
    assert r.status_code == 409 and "cannot plan" in r.json()["error"]["message"]


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="lease_seconds must be positive"):
        Settings.load(["--lease-seconds", "0"], {})
    with pytest.raises(ValueError, match="setting http_port: 'eighty' is not a int"):
        Settings.load([], {"SYNCD_HTTP_PORT": "eighty"})
    flag_wins = Settings.load(["--grpc-port", "9"], {"SYNCD_GRPC_PORT": "8", "SYNCD_HTTP_PORT": "7"})
    assert (flag_wins.grpc_port, flag_wins.http_port) == (9, 7)
    assert Settings.load(["--auto-refit"], {}).auto_refit is True
    assert Settings.load([], {"SYNCD_AUTO_REFIT": "yes"}).auto_refit is True
