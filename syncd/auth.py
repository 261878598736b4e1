"""syncd's bearer token, as every process of the system finds it: syncd itself and its members
(`trainer_svc`, `generator_svc`, `syncd.member.attach`, `generator_svc.attach`). One pair of
environment variables for all of them:

    SYNCD_AUTH_TOKEN_FILE   a file holding the token (a mounted Secret, a launcher's 0600 file)
    SYNCD_AUTH_TOKEN        the token itself (it shows in the process's environment)

The rule, the same everywhere: the token comes from a file or from a value, never both. A flag or
keyword (`--auth-token-file`, `--auth-token`, `auth_token_file=`, `auth_token=`) wins over the
environment; with neither, the environment is read. Given a file and a value (by any mix of
flags, keywords and environment), the process refuses to start, naming both: which one was meant
is not a guess to make about a credential.

Launchers make a fresh token per run with `write_token_file` (random, 256 bits, mode 0600) and
hand every process the file's path, never the token, so it shows on no command line.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

ENV_TOKEN = "SYNCD_AUTH_TOKEN"
ENV_TOKEN_FILE = "SYNCD_AUTH_TOKEN_FILE"
TOKEN_BYTES = 32  # 256 random bits, URL-safe base64


class Access(StrEnum):
    """Who may call syncd's mutating HTTP routes and member RPCs (`/v1/status`'s `access`)."""

    TOKEN = "token"  # callers with the bearer token
    LOOPBACK = "loopback"  # no token, bound to loopback: whoever runs on syncd's host
    INSECURE_NO_AUTH = "insecure-no-auth"  # no token, by --insecure-no-auth: whoever reaches it


class TokenError(ValueError):
    """The token cannot be found as configured: an unreadable or empty file, or both forms given."""


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token a file holds (surrounding whitespace dropped); raises TokenError naming the file."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TokenError(f"token file {str(path)!r}: {e.strerror}") from None
    if not token:
        raise TokenError(f"token file {str(path)!r} is empty")
    return token


def resolve_token(
    token: str | None = None,
    token_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The token a member sends: from `token` or `token_file` when either is given, else from the
    environment; None when nowhere. Empty strings count as not given."""
    environ = os.environ if environ is None else environ
    token = token or environ.get(ENV_TOKEN) or None
    token_file = token_file or environ.get(ENV_TOKEN_FILE) or None
    if token is not None and token_file is not None:
        raise TokenError(
            f"both a token file ({token_file!r}) and a token were given (--auth-token-file or "
            f"{ENV_TOKEN_FILE}, and --auth-token or {ENV_TOKEN}): give one"
        )
    return read_token_file(token_file) if token_file is not None else token


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def write_token_file(path: str | os.PathLike[str]) -> str:
    """Make a fresh token and write it to `path`, which must not exist, readable by this user
    alone (0600 from its creation: never a moment with wider permissions). Returns the token."""
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


def is_loopback(host: str) -> bool:
    """Whether an address syncd binds is reachable only from its own host: 127.0.0.0/8, ::1 or
    `localhost`. Anything else (0.0.0.0, ::, a host name, an interface's address) is a network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refusal(token_given: bool) -> str:
    """What a member tells its user when syncd answers UNAUTHENTICATED."""
    if token_given:
        return "syncd refused the token: it is not the token syncd was started with"
    return (
        f"no token given: set {ENV_TOKEN_FILE} (or --auth-token-file) to a file holding syncd's "
        f"token, or {ENV_TOKEN} (or --auth-token)"
    )
