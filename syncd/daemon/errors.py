"""syncd's error vocabulary, and the one table that maps it to gRPC and HTTP status codes.

Logic raises these (with a message naming the field and value); the gRPC servicer and the HTTP
app translate them with `grpc_code` / `http_status` and nothing else.
"""

from __future__ import annotations

import hmac

import grpc


class SyncdError(Exception):
    """Base: a request syncd refused. The message is shown to the caller verbatim."""


class InvalidArgument(SyncdError):
    """Malformed input: unknown dtype, box outside its tensor, hash mismatch, unknown role."""


class FailedPrecondition(SyncdError):
    """Valid input at the wrong time: a refit already running, members missing, nothing announced."""


class AlreadyExists(SyncdError):
    """A second member claiming coordinates that a live member holds."""


class NotFound(SyncdError):
    """Unknown refit, or a member session that syncd does not hold (register again)."""


class Unauthenticated(SyncdError):
    """Missing or wrong bearer token."""


class ResourceExhausted(SyncdError):
    """A per-caller limit was reached (e.g. Watch streams per session)."""


class Unavailable(SyncdError):
    """syncd cannot do it now for a reason outside the request (its store refuses writes); retry."""


_TABLE: dict[type[SyncdError], tuple[grpc.StatusCode, int]] = {
    InvalidArgument: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    FailedPrecondition: (grpc.StatusCode.FAILED_PRECONDITION, 409),
    AlreadyExists: (grpc.StatusCode.ALREADY_EXISTS, 409),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    ResourceExhausted: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
}


def grpc_code(err: SyncdError) -> grpc.StatusCode:
    return _TABLE[type(err)][0]


def http_status(err: SyncdError) -> int:
    return _TABLE[type(err)][1]


def http_headers(err: SyncdError) -> dict[str, str]:
    """RFC 9110: a 401 names the scheme the client must use."""
    return {"WWW-Authenticate": 'Bearer realm="syncd"'} if isinstance(err, Unauthenticated) else {}


def check_token(expected: str | None, authorization: str | None) -> None:
    """`authorization` is the raw header/metadata value; no token configured means open access."""
    if expected is None:
        return
    # Constant time: how long a wrong token takes to refuse says nothing about the right one.
    if not hmac.compare_digest((authorization or "").encode(), f"Bearer {expected}".encode()):
        reason = "missing" if not authorization else "wrong"
        raise Unauthenticated(f"{reason} credentials: send 'Authorization: Bearer <token>'")
