"""The one error body of weightsync's HTTP services: OpenAI's, which vLLM's own endpoints answer on
the generator's port, so that a client reads syncd's, the generator's and vLLM's errors one way:

    {"error": {"message": "refit r-12 is TRANSFERRING; one refit at a time", "type": "Conflict", "code": 409}}

`message` names what was wrong (the field, the resource, the member); `type` is the error's kind
(syncd's error class, or the HTTP status's phrase); `code` repeats the HTTP status.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from pydantic import BaseModel, Field
from starlette.responses import JSONResponse


class ErrorInfo(BaseModel):
    message: str = Field(description="what was wrong, naming the field, resource or member")
    type: str = Field(description="the kind of error: syncd's error class or the HTTP status's phrase")
    code: int = Field(description="the HTTP status")


class ErrorBody(BaseModel):
    """The body of every error answer (for the OpenAPI documents)."""

    error: ErrorInfo


def error_body(message: str, status: int, kind: str | None = None) -> dict[str, dict]:
    return {
        "error": {
            "message": message,
            "type": kind or HTTPStatus(status).phrase.replace(" ", ""),
            "code": status,
        }
    }


def error_response(
    message: str, status: int, kind: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status, headers=dict(headers or {}))


def error_message(body: object) -> str:
    """The message of an error body; anything else (a proxy's page, say) as text."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)
