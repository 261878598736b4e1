"""Whether an HTTP server keeps an idle connection open for as long as clients' pools reuse one
(`syncd.net.HTTP_KEEP_ALIVE_S`): two requests on one connection, the second after idling past the
5 s that httpx and openai keep a pooled connection. A server that closed it meanwhile fails the
second request as it failed a demo client ("Server disconnected without sending a response")."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

CLIENT_POOL_IDLE_S = 5.0  # httpx's and openai's keepalive_expiry


def answers_after_idling(url: str, path: str, idle_s: float = CLIENT_POOL_IDLE_S + 1) -> list[int]:
    """The statuses of two GETs of `path` on one connection to `url`, `idle_s` apart."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    statuses = []
    try:
        for i in range(2):
            time.sleep(idle_s if i else 0)
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        connection.close()
    return statuses
