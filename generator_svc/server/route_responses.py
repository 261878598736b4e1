"""What generator_svc's routes answer besides 200, declared once for every router, so the OpenAPI
document tells clients (and schemathesis) the truth: vLLM's app turns request validation errors
into 400, not 422. And the one check of the internal routes: the caller holds this generator's
worker token."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from generator_svc.server.refit import Refitter
from syncd.error_body import ErrorBody, error_response

# FastAPI's type for `responses=`: status code -> OpenAPI response object.
Responses = dict[int | str, dict[str, Any]]
INVALID: Responses = {400: {"description": "invalid request (vLLM's error format)"}}
REFUSED: Responses = {409: {"model": ErrorBody, "description": "refused; the served weights are unchanged"}}
FAILED: Responses = {
    500: {"model": ErrorBody, "description": "failed inside vLLM, or a bug (logged with its traceback)"}
}
UNAUTHORIZED: Responses = {401: {"model": ErrorBody, "description": "not the worker token of this generator"}}
LATE: Responses = {
    504: {
        "model": ErrorBody,
        "description": "the install did not finish within the commit deadline; "
        "the served weights are unchanged",
    }
}


def not_a_worker(refitter: Refitter, request: Request) -> JSONResponse | None:
    """The 401 for a caller without this generator's worker token, None for a worker."""
    if secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {refitter.commit_token}"):
        return None
    return error_response(
        f"{request.url.path} needs this generator's worker token", 401, headers={"WWW-Authenticate": "Bearer"}
    )
