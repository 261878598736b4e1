"""Named LoRA adapters served from slots (`generator_svc.server.served_adapters`): the install
syncd's commit asks for, and what the API says of them.

    GET  /v1/adapters                                the adapters served: name, version, LoRA id, slot,
                                                     and a digest of what the slot holds
    POST /internal/adapters/commit {refit_id, adapter, version, timeout_s}
                             the tp-0 worker relays syncd's Commit of an adapter refit here, with
                             the worker token; answers once the adapter is live (504 past the
                             deadline, 500 when the install failed: the slot keeps what it held)

Responses say the adapter's version: the `adapter` field of each choice and the
`X-Adapter-Version` header (`generator_svc.server.versions_http`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from generator_svc.server.route_responses import FAILED, INVALID, LATE, UNAUTHORIZED, not_a_worker
from generator_svc.server.served_adapters import AdapterCommit, ServedAdapters
from syncd.error_body import error_response

log = logging.getLogger("generator_svc.server.adapter_routes")
router = APIRouter()


def served_adapters(request: Request) -> ServedAdapters:
    adapters: ServedAdapters = request.app.state.served_adapters
    return adapters


AdaptersDep = Annotated[ServedAdapters, Depends(served_adapters)]


@router.get("/v1/adapters")
async def adapters(served: AdaptersDep, request: Request) -> JSONResponse:
    digests = await served.digests(request.app.state.refitter.engine)
    return JSONResponse({"adapters": [{**asdict(a), "digest": digests.get(a.name)} for a in served.all()]})


@router.post("/internal/adapters/commit", responses={**INVALID, **FAILED, **UNAUTHORIZED, **LATE})
async def commit_adapter(body: AdapterCommit, served: AdaptersDep, request: Request) -> JSONResponse:
    refitter = request.app.state.refitter
    if (refused := not_a_worker(refitter, request)) is not None:
        return refused
    what = f"adapter {body.adapter!r} version {body.version}"
    try:
        installed = await served.install(refitter.engine, request.app.state.openai_serving_models, body)
    except TimeoutError:
        return error_response(f"{what} was not installed within {body.timeout_s:.1f} s", 504)
    except Exception as e:  # a failure inside vLLM or a bug: never bad input
        log.exception("install of %s failed", what)
        return error_response(f"install of {what} failed: {type(e).__name__}: {e}", 500)
    return JSONResponse(asdict(installed))
