"""HTTP: vLLM's OpenAI-compatible app plus generator_svc's routes, served by vLLM's launcher.

    POST /v1/completions, /v1/chat/completions ...   vLLM (prompts as token-id lists, logprobs)
    GET  /metrics                                    vLLM's metrics plus weightsync_generator_*
    GET  /healthz                                    liveness: 200 while the engine is alive, every
                                                     worker answers and generation is allowed
    GET  /readyz                                     readiness: /healthz, and every worker serves
                                                     syncd's committed version (503 while behind)
    GET  /v1/weight_version[?at_least=V&exact=B&timeout_s=S]
                                                     version served (label and step) and refit state;
                                                     with at_least, once it serves V or newer (exact:
                                                     V itself), or timeout_s passed
    GET  /v1/install                                 refit and pause modes, what the last install did,
                                                     and per refit the serving pause (`history`)
    GET  /v1/workers                                 per worker: member id, tp rank, catalog hash, bytes
    GET  /v1/workers/{tp_rank}/catalog               that worker's registered catalog (JSON)
    GET  /v1/weights/digest                          per worker: checksums of the served version
    POST /v1/weights/stage   {path, refit_id}        stage a safetensors checkpoint (serving goes on)
    POST /v1/weights/apply   {version, refit_id?}    apply the staged version (holds generation)
    POST /v1/weights/load    {path, version}         stage + apply
    POST /v1/weights/abort   {refit_id?}             drop staged bytes
    POST /internal/commit    {refit_id, version, timeout_s}
                             the tp-0 worker relays syncd's Commit here, with the worker token
                             (`Authorization: Bearer`, made at startup, known only to the workers)
    POST /internal/hold      {refit_id, version}   inplace mode: hold generation, open the install
    POST /internal/release   {refit_id}            inplace mode: end a hold without committing
                             (both relayed by the tp-0 worker, with the worker token)

Errors (`_answer`, the one place exceptions become statuses): a refit that is refused
(incomplete or invalid staging, no time left, a mode that cannot do it: `RefitRefused`) is 409
with the reason, the engine untouched; a missed commit deadline is 504; anything else (a failure
inside the update lifecycle, or a bug) is 500, logged with its traceback. After a 500 from inside
the lifecycle or a 504 the generator answers 503 to generation requests until a good refit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.middleware.base import BaseHTTPMiddleware

from generator_svc.server import adapter_routes
from generator_svc.server.refit import Refitter
from generator_svc.server.route_responses import FAILED, INVALID, LATE, REFUSED, UNAUTHORIZED, not_a_worker
from generator_svc.server.update_lifecycle import DeadlineExceeded, RefitRefused
from generator_svc.server.version_wait import MAX_WAIT_S, wait_served_async
from generator_svc.server.versions_http import WeightVersionsMiddleware
from generator_svc.server.worker_status import behind_workers, quiet_workers
from generator_svc.settings import PauseMode, RefitMode
from generator_svc.worker_protocol import WorkerDigest
from syncd.error_body import ErrorBody, error_response
from syncd.weight_version import Version, WeightVersionJson, version_label

log = logging.getLogger("generator_svc.server.routes")

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate")


class StageRequest(BaseModel):
    path: str
    refit_id: str = "manual"


# The public routes name versions by label, text as vLLM's own `weight_version` is: a trainer version
# arrives as its decimal label (`version_label`), and an operator may load weights under any label.
# Only the workers' relays of syncd's commands carry a `WeightVersion` (`syncd.weight_version`).
class ApplyRequest(BaseModel):
    version: str
    refit_id: str = ""


class LoadRequest(BaseModel):
    path: str
    version: str


class AbortRequest(BaseModel):
    refit_id: str = ""


class CommitRequest(BaseModel):
    refit_id: str
    version: WeightVersionJson
    timeout_s: float = Field(
        gt=0, description="seconds left to install and go live (syncd's commit deadline)"
    )


class HoldRequest(BaseModel):
    refit_id: str = Field(min_length=1)
    version: WeightVersionJson


class ReleaseRequest(BaseModel):
    refit_id: str = Field(min_length=1)


class WeightVersionOut(BaseModel):
    version: str = Field(
        description="label of the weights served: a trainer version's decimal digits, "
        "or the label they were loaded under"
    )
    step: int | None = Field(description="the trainer step the label names; null for a label that names none")
    serving: bool
    updating: bool


def _refitter(request: Request) -> Refitter:
    return request.app.state.refitter


RefitterDep = Annotated[Refitter, Depends(_refitter)]
router = APIRouter()
# The routes the tp-0 worker relays syncd's commands to; also served beside an engine a user
# created (`generator_svc.attach`), so that one definition drives every engine's refits.
internal_router = APIRouter()


_NOT_HEALTHY = "engine dead, a worker not answering, or refusing generation after a failed update"


def _health_problem(refitter: Refitter) -> tuple[str, str] | None:
    """(status, reason) of why the generator is not healthy; reads only the API server's own
    state and the workers' status files, so it answers at once even when a worker is frozen."""
    if refitter.engine.errored:
        return "engine dead", "the vLLM engine has died"
    if quiet := quiet_workers(refitter.status_dir, refitter.workers):
        return "worker not answering", quiet
    if not refitter.serving:
        return (
            "refusing generation until the next good refit",
            "the last update failed or missed its deadline",
        )
    return None


@router.get("/healthz", responses={503: {"description": _NOT_HEALTHY}})
async def healthz(refitter: RefitterDep) -> JSONResponse:
    if problem := _health_problem(refitter):
        return JSONResponse({"status": problem[0], "reason": problem[1]}, status_code=503)
    return JSONResponse({"status": "ok", "version": refitter.version})


@router.get(
    "/readyz", responses={503: {"description": f"{_NOT_HEALTHY}, or behind syncd's committed version"}}
)
async def readyz(refitter: RefitterDep) -> JSONResponse:
    """Ready to take traffic: healthy and serving syncd's committed version. A generator that is
    behind keeps generating for callers that reach it directly (its /v1/weight_version says what
    it serves); readiness only keeps load balancers away until a catch-up refit reaches it."""
    problem = _health_problem(refitter)
    if problem is None and (behind := behind_workers(refitter.status_dir, refitter.workers)):
        problem = ("behind the committed version", behind)
    if problem:
        return JSONResponse({"status": problem[0], "reason": problem[1]}, status_code=503)
    return JSONResponse({"status": "ok", "version": refitter.version})


AT_LEAST_QUERY = Query(None, description="answer once the engine serves this version or a newer trainer step")
EXACT_QUERY = Query(False, description="with at_least: that version itself, not a newer one")
TIMEOUT_QUERY = Query(
    0.0, ge=0, le=MAX_WAIT_S, description="seconds to wait for at_least; then what is served"
)


@router.get("/v1/weight_version", response_model=WeightVersionOut, responses=INVALID)
async def weight_version(
    refitter: RefitterDep,
    at_least: str | None = AT_LEAST_QUERY,
    exact: bool = EXACT_QUERY,
    timeout_s: float = TIMEOUT_QUERY,
) -> JSONResponse:
    return await weight_version_answer(refitter, at_least, exact, timeout_s)


async def weight_version_answer(
    refitter: Refitter, at_least: str | None, exact: bool, timeout_s: float
) -> JSONResponse:
    """What is served (`WeightVersionOut`), once it is `at_least` or a newer step (`exact`: that
    version itself) when one is given (`generator_svc.server.version_wait`), or `timeout_s`
    passed: a long poll, whose caller compares the answer with what it asked for."""
    if at_least is not None:
        await wait_served_async(refitter, Version.of_label(at_least), exact, timeout_s)
    s = refitter.state
    served = Version.of_label(s.version)
    out = WeightVersionOut(version=served.label, step=served.step, serving=s.serving, updating=s.updating)
    return JSONResponse(out.model_dump())


class InstallStatus(BaseModel):
    mode: RefitMode = Field(
        description="refit mode: 'staged' (receive beside the live weights, install on commit) or "
        "'inplace' (hold generation, receive into the live layers)"
    )
    pause_mode: PauseMode = Field(description="how a refit meets running requests: 'wait', 'keep' or 'abort'")
    last: dict | None = Field(
        description="the last committed install: hold, copy and post-processing seconds, "
        "parameters, bytes, loader fallbacks; null before the first"
    )
    history: list[dict] = Field(
        description="the last 100 committed installs, oldest first: version, pause_mode, pause_s "
        "(generation held, pause to resume), install_s (engine paused) and spanning_requests "
        "(finished requests with tokens from before and after it)"
    )


@router.get("/v1/install")
async def install_status(refitter: RefitterDep) -> InstallStatus:
    last = refitter.last_install
    return InstallStatus(
        mode=refitter.settings.refit_mode,
        pause_mode=refitter.settings.pause_mode,
        last=dataclasses.asdict(last) if last else None,
        history=refitter.history.entries(),
    )


@router.get("/v1/workers")
async def workers(refitter: RefitterDep) -> list[dict]:
    return [dataclasses.asdict(w) for w in refitter.workers]


@router.get("/v1/workers/{tp_rank}/catalog", responses={**INVALID, 404: {"model": ErrorBody}})
async def worker_catalog(tp_rank: int, refitter: RefitterDep) -> JSONResponse:
    catalogs = await refitter.engine.collective_rpc("ws_catalog")
    if not 0 <= tp_rank < len(catalogs):
        return error_response(f"no worker with tp rank {tp_rank}", 404)
    return JSONResponse(content=json.loads(catalogs[tp_rank]))


@router.get("/v1/weights/digest")
async def digest(refitter: RefitterDep) -> list[dict]:
    """Per worker, the checksums of what it holds of the served version, by canonical region
    (`generator_svc.worker.digest`); `syncctl verify` compares them with syncd's record."""
    digests = WorkerDigest.replies(await refitter.engine.collective_rpc("ws_digest"))
    return [dataclasses.asdict(d) for d in digests]


@router.post("/v1/weights/stage", responses={**INVALID, **REFUSED, **FAILED})
async def stage(body: StageRequest, refitter: RefitterDep) -> JSONResponse:
    async def staged() -> JSONResponse:
        staged_files = await refitter.stage_file(body.path, body.refit_id)
        return JSONResponse({"workers": [dataclasses.asdict(f) for f in staged_files]})

    return await _answer(f"staging {body.path}", staged())


@router.post("/v1/weights/apply", responses={**INVALID, **REFUSED, **FAILED})
async def apply(body: ApplyRequest, refitter: RefitterDep) -> JSONResponse:
    return await _answer(f"apply of version {body.version}", _applied(refitter, body.version, body.refit_id))


@router.post("/v1/weights/load", responses={**INVALID, **REFUSED, **FAILED})
async def load(body: LoadRequest, refitter: RefitterDep) -> JSONResponse:
    async def loaded() -> JSONResponse:
        await refitter.stage_file(body.path, f"load-{body.version}")
        return await _applied(refitter, body.version, "")

    return await _answer(f"load of {body.path} as version {body.version}", loaded())


@router.post("/v1/weights/abort", responses={**INVALID, **FAILED})
async def abort(body: AbortRequest, refitter: RefitterDep) -> JSONResponse:
    async def aborted() -> JSONResponse:
        await refitter.abort(body.refit_id)
        return JSONResponse({"aborted": body.refit_id or "any"})

    return await _answer("abort", aborted())


@internal_router.post("/internal/commit", responses={**INVALID, **REFUSED, **FAILED, **UNAUTHORIZED, **LATE})
async def commit(body: CommitRequest, refitter: RefitterDep, request: Request) -> JSONResponse:
    if (refused := not_a_worker(refitter, request)) is not None:
        return refused
    version = version_label(body.version)
    return await _answer(
        f"commit of version {version}", _applied(refitter, version, body.refit_id, body.timeout_s)
    )


@internal_router.post("/internal/hold", responses={**INVALID, **REFUSED, **FAILED, **UNAUTHORIZED})
async def hold(body: HoldRequest, refitter: RefitterDep, request: Request) -> JSONResponse:
    if (refused := not_a_worker(refitter, request)) is not None:
        return refused

    async def held() -> JSONResponse:
        await refitter.hold(body.refit_id)
        return JSONResponse({"held": body.refit_id})

    return await _answer(f"hold for refit {body.refit_id}", held())


@internal_router.post("/internal/release", responses={**INVALID, **FAILED, **UNAUTHORIZED})
async def release(body: ReleaseRequest, refitter: RefitterDep, request: Request) -> JSONResponse:
    if (refused := not_a_worker(refitter, request)) is not None:
        return refused

    async def released() -> JSONResponse:
        ended = await refitter.release(body.refit_id, "aborted by syncd")
        return JSONResponse({"released": ended, "serving": refitter.serving})

    return await _answer(f"release of refit {body.refit_id}", released())


async def _applied(
    refitter: Refitter, version: str, refit_id: str, timeout_s: float | None = None
) -> JSONResponse:
    state = await refitter.apply(version, refit_id, timeout_s)
    return JSONResponse({"version": state.version, "serving": state.serving})


async def _answer(what: str, respond: Awaitable[JSONResponse]) -> JSONResponse:
    """`respond`'s answer, or the one place an exception becomes an HTTP status: only the refit's
    own errors say what was wrong with the request (409) or its deadline (504); anything else is
    a failure inside vLLM or a bug, a 500 logged with its traceback so that it never reads as bad
    input. `what` names the request in the log."""
    try:
        return await respond
    except RefitRefused as e:
        return error_response(str(e), 409)
    except DeadlineExceeded as e:
        return error_response(str(e), 504)
    except Exception as e:
        log.exception("%s failed", what)
        return error_response(_message(e), 500)


def _message(e: BaseException) -> str:
    # collective_rpc wraps worker errors; the innermost message names the tensor.
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


def torn_refusal(refitter: Refitter, path: str) -> JSONResponse | None:
    """The 503 for a generation request while the weights may be torn (a failed update, until
    the next complete refit); None when `path` may go to the engine."""
    if not refitter.serving and path.startswith(_GENERATION_PATHS):
        return error_response("weights are being repaired after a failed update; retry later", 503)
    return None


def install(app: FastAPI, refitter: Refitter) -> None:
    """Add generator_svc's routes, the weight versions of completions and the torn-weights guard
    to vLLM's app."""
    app.state.refitter = refitter
    app.state.served_adapters = refitter.adapters
    app.include_router(router)
    app.include_router(internal_router)
    app.include_router(adapter_routes.router)

    async def refuse_when_torn(request: Request, call_next):
        if (refused := torn_refusal(refitter, request.url.path)) is not None:
            return refused
        return await call_next(request)

    # vLLM's build_app already built the middleware stack; drop it so Starlette rebuilds it with ours.
    app.middleware_stack = None
    settings = refitter.settings
    app.add_middleware(
        WeightVersionsMiddleware, pause_mode=settings.pause_mode, retry_after_s=settings.retry_after_s
    )
    app.add_middleware(BaseHTTPMiddleware, dispatch=refuse_when_torn)
