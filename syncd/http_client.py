"""HTTP clients that share one TLS context per process.

httpx builds a TLS context for every `Client` it makes, loading the CA bundle: about 40 ms of CPU
each, also for plain `http://` URLs (measured on a 2-core machine, httpx 0.28), where sending a
small request takes well under a millisecond. `httpx.get(...)` makes a client per call, so loops
that poll with it (a health route while a process starts, twice a second for a minute) spent most
of their CPU there. Clients made here take a context built once, with httpx's own defaults (its
CA bundle, `SSL_CERT_FILE` and `SSL_CERT_DIR` where set): nothing about what is trusted changes.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once per process."""
    return httpx.create_ssl_context()


def client(**kwargs: Any) -> httpx.Client:
    """`httpx.Client(**kwargs)` with the shared TLS context."""
    return httpx.Client(verify=tls_context(), **kwargs)


def request(method: str, url: str, *, timeout: float | None = 5.0, **kwargs: Any) -> httpx.Response:
    """One request on a client of its own, as `httpx.request` sends it, without building a TLS
    context for it."""
    with client(timeout=timeout) as http:
        return http.request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)
