"""Bounded inputs. The token is checked before a message is read, messages, catalogs,
plans and Watch streams per session have limits (settings with documented defaults)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from syncd_harness import TOKEN, Cluster, SyncdProcess, generator_catalog, wait_until

from syncd.api import convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.layout import Box, CanonicalTensor, Catalog, LocalTensor, Piece
from syncd.net import free_port


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_an_unauthenticated_huge_message_is_refused_before_it_is_read(tmp_path: Path) -> None:
    syncd = SyncdProcess(tmp_path / "db", free_port(), free_port(), "--auth-token", TOKEN).start()
    try:
        before = peak_rss_mib(syncd.proc.pid)  # type: ignore[union-attr]
        huge = pb.RegisterRequest(
            role=pb.ROLE_GENERATOR, member_id="generator-0-0", catalog_hash="x" * (96 << 20)
        )
        with (
            grpc.insecure_channel(
                syncd.target, options=[("grpc.max_send_message_length", 1 << 30)]
            ) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.SyncdStub(channel).Register(huge, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        grown = peak_rss_mib(syncd.proc.pid) - before  # type: ignore[union-attr]
        assert grown < 48, f"syncd's peak memory grew by {grown:.0f} MiB for a refused 96 MiB message"
    finally:
        syncd.stop()


def test_a_message_over_the_limit_is_refused(make_cluster) -> None:
    cluster: Cluster = make_cluster(max_message_bytes=1 << 20)
    big = pb.RegisterRequest(role=pb.ROLE_GENERATOR, member_id="generator-0-0", catalog_hash="x" * (2 << 20))
    with grpc.insecure_channel(cluster.target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.SyncdStub(channel).Register(big, timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_catalog_declaring_an_absurd_tensor_is_refused(cluster: Cluster) -> None:
    shape = (2**62,)
    absurd = Catalog(
        (CanonicalTensor("w", shape, "int8"),),
        (LocalTensor("w", shape, "int8", (Piece("w", Box((0,), shape), Box((0,), shape)),)),),
    )
    request = pb.RegisterRequest(
        role=pb.ROLE_GENERATOR,
        member_id="generator-0-0",
        coords={"tp": 0},
        catalog_hash=absurd.content_hash,
        catalog=convert.catalog_to_pb(absurd),
    )
    with grpc.insecure_channel(cluster.target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.SyncdStub(channel).Register(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tensor_elements" in refused.value.details()


def test_a_plan_over_the_bucket_limit_is_refused_not_computed(make_cluster) -> None:
    cluster: Cluster = make_cluster(max_plan_buckets=3)
    for member_id in ("trainer-0", "trainer-1", "generator-0-0", "generator-0-1"):
        cluster.start_member(member_id)
    wait_until(lambda: len(cluster.http.get("/v1/members").json()["members"]) == 4, what="members")
    plan = cluster.http.get("/v1/plan")
    assert plan.status_code == 409 and "max_plan_buckets" in plan.json()["error"]["message"]
    ready = cluster.http.get("/readyz")
    assert ready.status_code == 503 and "max_plan_buckets" in ready.json()["reason"]


def test_watch_streams_per_session_are_limited_and_honest_members_keep_their_lease(cluster: Cluster) -> None:
    cluster.start_all()
    honest = cluster.members["generator-0-0"].client
    catalog = generator_catalog(1)
    register = pb.RegisterRequest(
        role=pb.ROLE_GENERATOR,
        member_id="generator-7-0",
        coords={"replica": 7, "tp": 0},
        catalog_hash=catalog.content_hash,
        catalog=convert.catalog_to_pb(catalog),
    )
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.SyncdStub(channel)
        session = stub.Register(register, timeout=10).session_id
        watch = pb.WatchRequest(member_id="generator-7-0", session_id=session)
        # Accepted streams stay open until their deadline; refused ones end at once.
        streams = [stub.Watch(watch, timeout=3) for _ in range(40)]
        codes = [s.code() for s in streams]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 38
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 2
    session_before = honest.session_id
    # The flooding member stops heartbeating; once its lease ran out, honest members still hold theirs.
    wait_until(
        lambda: "generator-7-0" not in str(cluster.http.get("/v1/members").json()), what="lease expiry"
    )
    assert cluster.wait_refit(cluster.refit(weight_version=1)["id"])["state"] == "COMMITTED"
    assert honest.session_id == session_before
