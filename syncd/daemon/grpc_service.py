"""The member-facing gRPC service (weightsync.v1.Syncd) plus the standard health service.

The bearer token is checked by `TokenFirst`, an interceptor, from the call's metadata before gRPC
reads the request message: an unauthenticated caller cannot make syncd read a large message.
Every RPC goes through `_guarded`: the one translation of SyncdError (and ValueError from
decoding foreign messages) into a gRPC status.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from syncd.api import convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.daemon.coordinator import Coordinator
from syncd.daemon.errors import InvalidArgument, SyncdError, Unauthenticated, check_token, grpc_code
from syncd.daemon.registry import Registry
from syncd.daemon.version_status import VersionStatus
from syncd.weight_version import WeightVersion, parse_weight_version

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Syncd"].full_name
_WATCH_POLL_S = 0.5  # how often an idle Watch stream notices a cancelled client


class TokenFirst(grpc.ServerInterceptor):
    """Refuses calls to the Syncd service without the token before their message is read."""

    def __init__(self, auth_token: str | None) -> None:
        self.auth_token = auth_token

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(f"/{SERVICE_NAME}/"):  # the health service stays open
            return continuation(details)
        try:
            check_token(self.auth_token, dict(details.invocation_metadata).get("authorization"))
        except Unauthenticated as err:
            message = str(err)

            def refuse(_requests: Iterator, context: grpc.ServicerContext) -> None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            # A request-streaming handler: gRPC reads no message before it runs (and this one reads none).
            return grpc.stream_unary_rpc_method_handler(refuse)
        return continuation(details)


def _guarded(method: Callable) -> Callable:
    def fail(context: grpc.ServicerContext, err: Exception) -> None:
        if isinstance(err, ValueError):
            err = InvalidArgument(str(err))
        assert isinstance(err, SyncdError)
        context.abort(grpc_code(err), str(err))

    if method.__name__ == "Watch":

        @functools.wraps(method)
        def stream(self: SyncdServicer, request: Any, context: grpc.ServicerContext) -> Iterator:
            try:
                yield from method(self, request, context)
            except (SyncdError, ValueError) as err:
                fail(context, err)

        return stream

    @functools.wraps(method)
    def unary(self: SyncdServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except (SyncdError, ValueError) as err:
            fail(context, err)

    return unary


class SyncdServicer(pb_grpc.SyncdServicer):
    def __init__(self, registry: Registry, coordinator: Coordinator) -> None:
        self.registry = registry
        self.coordinator = coordinator

    @_guarded
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        role = convert.ROLE_NAMES.get(request.role)
        if role is None:
            raise InvalidArgument(f"member {request.member_id}: role is unspecified")
        catalog = convert.catalog_from_pb(request.catalog) if request.HasField("catalog") else None
        known = catalog or self.registry.known_catalog(request.catalog_hash)
        adapter = convert.adapter_from_pb(request.adapter) if request.HasField("adapter") else None
        slots = convert.lora_slots_from_pb(request.lora_slots) if request.HasField("lora_slots") else None
        if known is not None:
            self.coordinator.admit(role, request.member_id, known, adapter)
        result = self.registry.register(
            role=role,
            member_id=request.member_id,
            coords=dict(request.coords),
            device=request.device,
            data_address=request.data_address,
            catalog_hash=request.catalog_hash,
            catalog=catalog,
            run_id=request.run_id,
            weight_version=request.weight_version if request.HasField("weight_version") else None,
            receive_by_layer=request.receive_by_layer,
            host_id=request.host_id,
            gpu_id=request.gpu_id,
            gpu_peers=tuple(request.gpu_peers),
            adapter=adapter,
            lora_slots=slots,
        )
        if result.catalog_required:
            return pb.RegisterResponse(catalog_required=True)
        assert result.member is not None
        return pb.RegisterResponse(
            session_id=result.member.session_id,
            lease_seconds=self.registry.lease_seconds,
            committed_version=self._committed_version(),
        )

    @_guarded
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self.registry.heartbeat(request.member_id, request.session_id)
        return pb.HeartbeatResponse(
            lease_seconds=self.registry.lease_seconds, committed_version=self._committed_version()
        )

    @_guarded
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self.registry.leave(request.member_id, request.session_id)
        return pb.LeaveResponse()

    def _committed_version(self) -> WeightVersion | None:
        committed = self.coordinator.versions.committed
        return committed.version if committed is not None else None

    @_guarded
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.Command]:
        with self.registry.watching(request.member_id, request.session_id) as commands:
            while context.is_active():
                try:
                    command = commands.get(timeout=_WATCH_POLL_S)
                except queue.Empty:
                    continue
                if command is None:  # session ended
                    return
                yield convert.command_to_pb(command)

    @_guarded
    def Report(self, request: pb.ReportRequest, context: grpc.ServicerContext) -> pb.ReportResponse:
        member = self.registry.member(request.member_id, request.session_id)
        phase = convert.PHASE_NAMES.get(request.phase)
        if phase is None:
            raise InvalidArgument(f"report from {member.member_id}: phase is unspecified")
        if phase == "ANNOUNCE":
            self.coordinator.announce(member, request.weight_version)
        else:
            self.coordinator.report(convert.report_from_pb(request, member.member_id))
        return pb.ReportResponse()

    @_guarded
    def Progress(self, request: pb.ProgressRequest, context: grpc.ServicerContext) -> pb.ProgressResponse:
        member = self.registry.member(request.member_id, request.session_id)
        self.coordinator.report_progress(convert.progress_from_pb(request, member.member_id))
        return pb.ProgressResponse()

    @_guarded
    def VersionStatus(
        self, request: pb.VersionStatusRequest, context: grpc.ServicerContext
    ) -> pb.VersionStatusResponse:
        member = self.registry.member(request.member_id, request.session_id)
        status = self.coordinator.version_status(member, parse_weight_version(request.weight_version))
        return _version_status_to_pb(status)


def _version_status_to_pb(status: VersionStatus) -> pb.VersionStatusResponse:
    r = status.refit
    if r is None:
        return pb.VersionStatusResponse(waiting_for=status.waiting_for)
    end = r.finished_at if r.finished_at is not None else time.time()
    return pb.VersionStatusResponse(
        refit_id=r.id,
        weight_version=r.weight_version,
        state=r.state,
        ended=status.ended,
        error=r.error,
        unconfirmed=list(r.unconfirmed),
        seconds=max(end - r.created_at, 0.0),
        bytes=r.bytes,
    )


def build_grpc_server(
    servicer: SyncdServicer,
    host: str,
    port: int,
    max_workers: int,
    auth_token: str | None,
    max_message_bytes: int,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A gRPC server with the Syncd and health services; returns it with its bound port.
    Each open Watch stream holds a worker thread, so `max_workers` must exceed the member count."""
    # gRPC enables SO_REUSEPORT by default: a second syncd would silently share the port.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[TokenFirst(auth_token)],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", 1 << 30),
        ],
    )
    pb_grpc.add_SyncdServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's way of saying the address is taken
        raise OSError(f"cannot bind gRPC on {host}:{port}: address in use or unavailable") from None
    return server, bound, health_servicer
