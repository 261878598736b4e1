"""syncd's HTTP API (FastAPI): health, readiness, metrics and the operator's /v1 resources.

Errors are the one error body of both services (`syncd.error_body`, OpenAI's shape): SyncdError maps
through `syncd.daemon.errors.http_status` (its class names the type), request validation is 422,
anything unexpected is a 500 with a one-line message (never a stack trace).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.routing import Match

from syncd.auth import Access
from syncd.daemon.adapter_refits import AdapterState
from syncd.daemon.coordinator import Coordinator
from syncd.daemon.digests import compare
from syncd.daemon.errors import InvalidArgument, SyncdError, check_token, http_headers, http_status
from syncd.daemon.http_models import (
    AdapterOut,
    AdaptersOut,
    DifferenceOut,
    DigestOut,
    HealthOut,
    MemberOut,
    MembersOut,
    PlanOut,
    ReadinessOut,
    RefitIn,
    RefitOut,
    RefitsOut,
    StatusOut,
    VerifyIn,
    VerifyOut,
)
from syncd.daemon.metrics import Metrics
from syncd.daemon.progress_http import RefitProgressOut, progress_events
from syncd.daemon.registry import ROLES, Registry
from syncd.error_body import ErrorBody, error_response
from syncd.weight_version import parse_weight_version

log = logging.getLogger(__name__)


def require_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """Mutating endpoints need `Authorization: Bearer <token>` when a token is configured."""
    check_token(request.app.state.auth_token, authorization)


Authorized = Annotated[None, Depends(require_token)]
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 422)}
_TRIGGER_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    503: {"model": ErrorBody, "description": "the store refuses to record a refit"},
}


def build_app(
    registry: Registry,
    coordinator: Coordinator,
    metrics: Metrics,
    auth_token: str | None,
    access: Access = Access.TOKEN,
) -> FastAPI:
    """`access`: what `/v1/status` reports of who may call the mutating routes (`auth_token`
    alone decides who may)."""
    app = FastAPI(title="syncd", version="1", description="Weight-sync daemon: members, plans and refits.")
    app.state.auth_token = auth_token
    _install_error_handlers(app)

    # Liveness and metrics are `async`: they run on the event loop, never queued behind slow
    # requests in the thread pool (a liveness probe that waits gets syncd killed by Kubernetes).
    # Readiness plans (bounded by the plan limits), so it stays off the event loop.
    @app.get("/healthz", response_model=HealthOut, tags=["health"])
    async def healthz() -> HealthOut:
        return HealthOut()

    @app.get(
        "/readyz", response_model=ReadinessOut, responses={503: {"model": ReadinessOut}}, tags=["health"]
    )
    def readyz() -> JSONResponse:
        r = ReadinessOut.of(coordinator.readiness())
        return JSONResponse(r.model_dump(), status_code=200 if r.ready else 503)

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def prometheus() -> Response:
        members = registry.members()
        for role in ROLES:
            metrics.members.labels(role=role).set(sum(m.role == role for m in members))
        metrics.show_progress(*coordinator.progress.latest(coordinator.current()))
        metrics.missing_generators.set(len(coordinator.missing_generators()))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status", response_model=StatusOut, tags=["refits"])
    def status() -> StatusOut:
        current = coordinator.current()
        committed, announced = coordinator.versions.committed, coordinator.versions.announced
        return StatusOut(
            state=current.state if current else "IDLE",
            current_refit=RefitOut.of(current) if current else None,
            committed_version=committed.version if committed else None,
            committed_run=committed.run_id if committed else None,
            announced_version=announced.version if announced else None,
            announced_run=coordinator.versions.run_id,
            readiness=ReadinessOut.of(coordinator.readiness()),
            access=access,
            insecure_no_auth=access is Access.INSECURE_NO_AUTH,
        )

    @app.get("/v1/members", response_model=MembersOut, tags=["members"])
    def members() -> MembersOut:
        return MembersOut(members=[MemberOut.of(m) for m in registry.all_members()])

    @app.get("/v1/adapters", response_model=AdaptersOut, tags=["adapters"])
    def adapters() -> AdaptersOut:
        """Every named LoRA adapter a trainer registered: its spec, trainers and versions."""
        states = coordinator.adapters.versions.all()
        senders = registry.adapter_senders()
        names = sorted(set(states) | {m.adapter.name for m in senders if m.adapter is not None})
        return AdaptersOut(
            adapters=[
                AdapterOut.of(
                    n,
                    [m for m in senders if m.adapter and m.adapter.name == n],
                    states.get(n, AdapterState()),
                )
                for n in names
            ]
        )

    @app.get("/v1/plan", response_model=PlanOut, responses=_ERRORS, tags=["plan"])
    def plan() -> PlanOut:
        plan = coordinator.current_plan()
        return PlanOut.of(plan, coordinator.link_transports(plan))

    @app.post(
        "/v1/refits", response_model=RefitOut, status_code=202, responses=_TRIGGER_ERRORS, tags=["refits"]
    )
    def trigger(_: Authorized, body: RefitIn | None = None) -> RefitOut:
        body = body or RefitIn()
        if body.adapter is not None:
            if body.allow_rollback or body.full:
                raise InvalidArgument("allow_rollback and full are for the base weights, not an adapter")
            return RefitOut.of(coordinator.trigger_adapter(body.adapter, body.weight_version))
        return RefitOut.of(coordinator.trigger(body.weight_version, body.allow_rollback, body.full))

    @app.get("/v1/refits", response_model=RefitsOut, tags=["refits"])
    def history(limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> RefitsOut:
        return RefitsOut(refits=[RefitOut.of(r) for r in coordinator.history(limit)])

    def refit_with_progress(refit_id: str) -> RefitProgressOut:
        record = coordinator.get(refit_id)
        return RefitProgressOut.with_progress(record, coordinator.refit_progress(record))

    @app.get("/v1/refits/{refit_id}", response_model=RefitProgressOut, responses=_ERRORS, tags=["refits"])
    def refit(refit_id: str) -> RefitProgressOut:
        """The refit, with its live progress (bytes, rates, ETA, the slowest link)."""
        return refit_with_progress(refit_id)

    @app.get(
        "/v1/refits/{refit_id}/events",
        response_class=StreamingResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
        tags=["refits"],
    )
    def refit_events(refit_id: str) -> StreamingResponse:
        """Server-sent events: `progress` (the body of GET /v1/refits/{id}) as the refit moves,
        then `end` once it is COMMITTED or ABORTED."""
        refit_with_progress(refit_id)  # an unknown refit is a 404, before the stream starts
        return StreamingResponse(
            progress_events(lambda: refit_with_progress(refit_id)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @app.post("/v1/refits/{refit_id}/abort", response_model=RefitOut, responses=_ERRORS, tags=["refits"])
    def abort(_: Authorized, refit_id: str) -> RefitOut:
        return RefitOut.of(coordinator.abort(refit_id))

    @app.get("/v1/digest", response_model=DigestOut, responses=_ERRORS, tags=["verify"])
    def digest(weight_version: Annotated[int | None, Query(ge=0)] = None) -> DigestOut:
        """The senders' checksums of a committed version (default: the newest), per member."""
        version = None if weight_version is None else parse_weight_version(weight_version)
        return DigestOut.of(coordinator.digests.get(version))

    @app.post("/v1/verify", response_model=VerifyOut, responses=_ERRORS, tags=["verify"])
    def verify(_: Authorized, body: VerifyIn) -> VerifyOut:
        """Compare members' digests of what they hold with the committed versions' digests;
        names every tensor and region that differs (`syncctl verify`)."""
        differences, compared = [], 0
        for member_id, reported in body.members.items():
            recorded = coordinator.digests.get(reported.weight_version)
            compared += len(recorded.members.get(member_id, {}))
            differences += compare(recorded, member_id, reported.checksums)
        return VerifyOut(
            equal=not differences,
            regions_compared=compared,
            tensors=sorted({d.tensor for d in differences}),
            differences=[DifferenceOut.of(d) for d in differences],
        )

    return app


def _allowed_methods(app: FastAPI, request: Request) -> set[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return methods


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SyncdError)
    async def syncd_error(_: Request, err: SyncdError) -> JSONResponse:
        return error_response(str(err), http_status(err), type(err).__name__, http_headers(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(f"invalid request: {problems}", 422, "InvalidRequest")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        headers = dict(err.headers or {})
        if err.status_code == 405:  # RFC 9110: `Allow` lists every method of the resource
            headers["Allow"] = ", ".join(sorted(_allowed_methods(app, request)))
        return error_response(str(err.detail), err.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(f"internal error: {type(err).__name__}: {err}", 500)
