"""Weight sync inside a plain `vllm serve` process: an ASGI middleware vLLM loads by `--middleware`.

    python -m vllm.entrypoints.openai.api_server --model M ... \\
        --worker-extension-cls generator_svc.worker.WeightSyncExtension \\
        --weight-transfer-config '{"backend":"syncd_staging"}' \\
        --middleware generator_svc.attach.WeightSyncMiddleware

vLLM builds its API server as usual; the middleware sits in front of it, in the same process, and
takes a few paths for itself:

    POST /weightsync/attach  {syncd, replica, refit_mode?, pause_mode?, auth_token?, data_host?, ...}
                             check the engine's arguments (409 naming what is missing), set up and
                             register every worker with syncd (`Refitter.setup`); 409 when attached
    GET  /weightsync/status  {attached, version, step, serving, updating, workers}
    GET  /weightsync/weight_version[?at_least=V&exact=B&timeout_s=S]
                             what `python -m generator_svc`'s GET /v1/weight_version answers, the same
                             way: once it serves V or newer (or V itself), or timeout_s passed
    POST /internal/commit|hold|release   the tp-0 worker's relays of syncd's commands
                             (`server.routes.internal_router`, with the worker token): the refit lifecycle
                             of `generator_svc.server.refit`, on vLLM's own engine client

and, once attached, answers 503 to generation while the weights may be torn (`server.routes.torn_refusal`).
A server started with `--api-key` (or `VLLM_API_KEY`) guards `/weightsync/` with the same keys: vLLM
adds its own check inside the middlewares it registers first, so this one, outside it, checks too.
Everything else goes to vLLM unchanged. `generator_svc.attach.attach_server` (`serve_client`) is the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from generator_svc.attach.engine_args import ATTACH_ROUTE, make_settings, refusals
from generator_svc.server.refit import Refitter
from generator_svc.server.routes import (
    AT_LEAST_QUERY,
    EXACT_QUERY,
    TIMEOUT_QUERY,
    internal_router,
    torn_refusal,
    weight_version_answer,
)
from generator_svc.settings import PauseMode, RefitMode
from syncd.error_body import error_response
from syncd.weight_version import version_of_label

_OWN_PATHS = ("/weightsync/", "/internal/")


def _api_keys(vllm_state: Any) -> list[str]:
    """vLLM's API keys, chosen as vLLM chooses them: `--api-key` first, else `VLLM_API_KEY`."""
    args = getattr(vllm_state, "args", None)
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")]
    return [key for key in keys if key]


def _has_key(scope: dict, keys: list[str]) -> bool:
    headers = {name.lower(): value for name, value in scope.get("headers", [])}
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Compare digests of equal length, in constant time, against every key (as vLLM does).
    digest = hashlib.sha256(given.encode()).digest()
    matches = [secrets.compare_digest(digest, hashlib.sha256(key.encode()).digest()) for key in keys]
    return any(matches)


class AttachRequest(BaseModel):
    syncd: str = Field(min_length=1, description="syncd's gRPC address, host:port")
    replica: int = Field(0, ge=0)
    refit_mode: RefitMode = RefitMode.STAGED
    pause_mode: PauseMode = PauseMode.WAIT
    auth_token: str = ""
    data_host: str = "127.0.0.1"
    in_flight_buckets: int | None = Field(None, ge=1)
    hold_limit_s: float = Field(300.0, gt=0)
    initial_version: str = "0"


def _control_app() -> FastAPI:
    app = FastAPI(title="weightsync control (vllm serve)")
    app.state.refitter = None  # set by a successful attach
    app.state.attaching = asyncio.Lock()
    app.include_router(internal_router)

    @app.post(ATTACH_ROUTE)
    async def attach(body: AttachRequest, request: Request) -> JSONResponse:
        state = request.app.state
        async with state.attaching:
            if state.refitter is not None:
                settings = state.refitter.settings
                return error_response(
                    f"already attached as replica {settings.replica} of syncd {settings.syncd}", 409
                )
            engine = state.vllm_state.engine_client
            if problems := refusals(engine.vllm_config):
                return error_response("cannot attach weight sync to this server: " + "; ".join(problems), 409)
            options = body.model_dump(exclude={"syncd", "replica"})
            refitter = Refitter(engine, make_settings(body.syncd, body.replica, **options))
            port = request.scope["server"][1]
            workers = await refitter.setup(internal_url=f"http://127.0.0.1:{port}/internal")
            state.refitter = refitter
        return JSONResponse({"workers": [dataclasses.asdict(w) for w in workers]})

    @app.get("/weightsync/status")
    async def status(request: Request) -> JSONResponse:
        refitter: Refitter | None = request.app.state.refitter
        if refitter is None:
            return JSONResponse({"attached": False})
        s = refitter.state
        return JSONResponse(
            {
                "attached": True,
                "version": s.version,
                "step": version_of_label(s.version),
                "serving": s.serving,
                "updating": s.updating,
                "workers": [dataclasses.asdict(w) for w in refitter.workers],
            }
        )

    @app.get("/weightsync/weight_version")
    async def weight_version(
        request: Request,
        at_least: str | None = AT_LEAST_QUERY,
        exact: bool = EXACT_QUERY,
        timeout_s: float = TIMEOUT_QUERY,
    ) -> JSONResponse:
        refitter: Refitter | None = request.app.state.refitter
        if refitter is None:
            return error_response(f"weight sync is not attached (POST {ATTACH_ROUTE} first)", 409)
        return await weight_version_answer(refitter, at_least, exact, timeout_s)

    return app


class WeightSyncMiddleware:
    """vLLM's app behind the paths of weight sync (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.control = _control_app()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        refitter = self.control.state.refitter
        if refitter is None and path.startswith("/internal/"):
            not_attached = error_response(
                f"{path}: weight sync is not attached (POST {ATTACH_ROUTE} first)", 409
            )
            await not_attached(scope, receive, send)
            return
        if path.startswith(_OWN_PATHS):
            # Starlette put vLLM's app into the scope; its state holds the engine client.
            vllm_state = scope["app"].state
            keys = _api_keys(vllm_state)
            if path.startswith("/weightsync/") and keys and not _has_key(scope, keys):
                unauthorized = error_response(
                    f"{path} needs one of this server's API keys (--api-key)",
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await unauthorized(scope, receive, send)
                return
            self.control.state.vllm_state = vllm_state
            await self.control(scope, receive, send)
            return
        if refitter is not None and (refused := torn_refusal(refitter, path)) is not None:
            await refused(scope, receive, send)
            return
        await self.app(scope, receive, send)
