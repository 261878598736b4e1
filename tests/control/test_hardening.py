"""Hardening: identities, strict input, RFC-conformant HTTP answers, secrets kept off the
command line, and clear errors for a damaged database."""

from __future__ import annotations

import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from syncd_harness import (
    PYTHON,
    REPO,
    TOKEN,
    Cluster,
    FakeMember,
    SyncdProcess,
    generator_catalog,
    trainer_catalog,
    wait_until,
)

from syncd import http_client
from syncd.api import convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.layout import Catalog
from syncd.member.client import MemberClient
from syncd.net import free_port
from tests.keep_alive import answers_after_idling


def register(target: str, member_id: str, coords: dict | None = None) -> pb.RegisterResponse:
    catalog = generator_catalog(0)
    request = pb.RegisterRequest(
        role=pb.ROLE_GENERATOR,
        member_id=member_id,
        coords=coords or {"replica": 7, "tp": 0},
        catalog_hash=catalog.content_hash,
        catalog=convert.catalog_to_pb(catalog),
    )
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.SyncdStub(channel).Register(request, timeout=10)


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def test_a_live_member_id_is_not_taken_over(cluster: Cluster) -> None:
    cluster.start_all()
    details = refused(
        lambda: register(cluster.target, "generator-0-0", {"replica": 7, "tp": 0}),
        grpc.StatusCode.ALREADY_EXISTS,
    )
    assert "live session" in details
    members = cluster.http.get("/v1/members").json()["members"]
    held = next(m for m in members if m["member_id"] == "generator-0-0")
    assert held["coords"] == {"replica": 0, "tp": 0}
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"


@pytest.mark.parametrize(
    "member_id", ["generator-9\n2026 INFO syncd: forged", "x" * (1 << 20), "Generator-9", "-generator", ""]
)
def test_member_ids_must_be_kubernetes_names(cluster: Cluster, member_id: str) -> None:
    details = refused(lambda: register(cluster.target, member_id), grpc.StatusCode.INVALID_ARGUMENT)
    assert "not a Kubernetes name" in details and len(details) < 400 and "\n" not in details


def test_negative_coordinates_are_refused(cluster: Cluster) -> None:
    details = refused(
        lambda: register(cluster.target, "generator-9-0", {"replica": 9, "tp": -3}),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "'tp': -3" in details and "negative" in details


@pytest.mark.parametrize("version", [True, "7", 7.0, 2**63, -1])
def test_weight_version_must_be_a_strict_int64(cluster: Cluster, version: object) -> None:
    r = cluster.http.post("/v1/refits", json={"weight_version": version})
    assert r.status_code == 422 and "weight_version" in r.json()["error"]["message"], r.text


def test_http_answers_carry_the_headers_rfc_9110_asks_for(make_cluster) -> None:
    cluster: Cluster = make_cluster(auth_token=TOKEN)
    r = cluster.http.delete("/v1/refits")
    allowed = set(r.headers["allow"].replace(" ", "").split(","))
    assert r.status_code == 405 and allowed >= {"GET", "POST"} and "DELETE" not in allowed
    r = cluster.http.post("/v1/refits", json={})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_an_idle_connection_outlives_the_clients_pools(cluster: Cluster) -> None:
    """A client reusing its pooled connection after 5 s idle (httpx, syncctl) is answered."""
    assert answers_after_idling(cluster.url, "/healthz") == [200, 200]


def test_refit_ids_count_without_gaps(cluster: Cluster) -> None:
    cluster.start_all(**{"generator-0-1": {"fail_verify": "bad disk"}})
    first = cluster.wait_refit(cluster.refit(weight_version=1)["id"])
    cluster.members["generator-0-1"].behaviour.fail_verify = ""
    second = cluster.wait_refit(cluster.refit(weight_version=2)["id"])
    third = cluster.wait_refit(cluster.refit(weight_version=3)["id"])
    assert [first["state"], second["state"], third["state"]] == ["ABORTED", "COMMITTED", "COMMITTED"]
    assert [first["id"], second["id"], third["id"]] == ["refit-1", "refit-2", "refit-3"]


def in_dtype(c: Catalog, dtype: str) -> Catalog:
    return Catalog(
        tuple(replace(t, dtype=dtype) for t in c.canonical), tuple(replace(t, dtype=dtype) for t in c.tensors)
    )


def test_a_dtype_mismatch_is_refused_at_registration_with_the_hint(cluster: Cluster) -> None:
    cluster.start_member("trainer-0")
    cluster.start_member("trainer-1")
    wait_until(lambda: len(cluster.http.get("/v1/members").json()["members"]) == 2, what="trainers")
    # float32 -> bfloat16 is converted by the senders; float32 -> float8 (blockwise scales) is not yet.
    with grpc.insecure_channel(cluster.target) as channel:
        for dtype, accepted in (("bfloat16", True), ("float8_e4m3fn", False)):
            catalog = in_dtype(generator_catalog(0), dtype)
            request = pb.RegisterRequest(
                role=pb.ROLE_GENERATOR,
                member_id=f"generator-{int(accepted)}-0",
                coords={"replica": int(accepted), "tp": 0},
                catalog_hash=catalog.content_hash,
                catalog=convert.catalog_to_pb(catalog),
            )

            def register(r: pb.RegisterRequest = request) -> pb.RegisterResponse:
                return pb_grpc.SyncdStub(channel).Register(r, timeout=10)

            if accepted:
                register()
                continue
            details = refused(register, grpc.StatusCode.FAILED_PRECONDITION)
    assert "model.embed_tokens.weight as float8_e4m3fn" in details and "--dtype float32" in details


def test_readiness_shows_a_dtype_mismatch_and_agrees_with_the_plan(cluster: Cluster) -> None:
    # The generators came first: nothing to compare with at their registration.
    cluster.start_member("generator-0-0")
    cluster.start_member("generator-0-1")
    wait_until(lambda: len(cluster.http.get("/v1/members").json()["members"]) == 2, what="generators")
    fp64 = in_dtype(trainer_catalog(0), "float64")  # float64 -> float32 is no conversion senders make
    odd = FakeMember(
        MemberClient(cluster.target, role="trainer", member_id="trainer-0", coords={"pp": 0}, catalog=fp64)
    )
    odd.client.start(odd.handle)
    cluster.members["trainer-0"] = odd
    cluster.start_member("trainer-1")
    wait_until(lambda: len(cluster.http.get("/v1/members").json()["members"]) == 4, what="all members")
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 503
    assert "--dtype float64" in ready.json()["reason"]
    assert cluster.http.get("/v1/plan").status_code == 409  # both say no


def test_the_token_can_come_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    syncd = SyncdProcess(
        tmp_path / "db", free_port(), free_port(), "--auth-token-file", str(token_file)
    ).start()
    try:
        assert TOKEN not in Path(f"/proc/{syncd.proc.pid}/cmdline").read_text()  # type: ignore[union-attr]
        assert http_client.post(f"{syncd.url}/v1/refits", json={}).status_code == 401
        ok = http_client.post(f"{syncd.url}/v1/refits", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 409  # past the token, refused on merit (nobody registered)
    finally:
        syncd.stop()


def test_a_non_integer_committed_version_is_one_clear_line(tmp_path: Path) -> None:
    db = tmp_path / "db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('committed_version', 'seven')")
    r = subprocess.run(
        [
            PYTHON,
            "-m",
            "syncd",
            "--db",
            str(db),
            "--http-port",
            str(free_port()),
            "--grpc-port",
            str(free_port()),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "meta.committed_version is 'seven', not an integer" in r.stderr and "Traceback" not in r.stderr
