"""The client of a `vllm serve` process started with weight sync's flags (`SERVE_FLAGS`): asks its
middleware (`generator_svc.attach.serve_middleware`) to attach the server's engine to syncd, and
returns an `AttachedServer` that reads and waits for the version it serves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from generator_svc.attach.engine_args import (
    ATTACH_ROUTE,
    MIDDLEWARE,
    SERVE_FLAGS,
    AttachRefused,
    make_settings,
)
from generator_svc.server.version_wait import MAX_WAIT_S, not_served
from syncd import http_client
from syncd.weight_version import Version


@dataclass(frozen=True)
class AttachedServer:
    """A `vllm serve` process attached to syncd (from `attach_server`): `workers` as it answered
    (member ids, tp ranks, catalog hashes); `version` and `wait_version` as an attached `LLM`'s."""

    url: str
    workers: list[dict]
    headers: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def version(self) -> Version:
        return self._served(http_client.get(f"{self.url}/weightsync/weight_version", headers=self.headers))

    def wait_version(
        self, version: int | str | Version, *, exact: bool = False, timeout_s: float = 600.0
    ) -> Version:
        """The version served once it is `version` or a newer step (`exact`: that version only),
        asked of the server in waits of at most `MAX_WAIT_S`; TimeoutError after `timeout_s`."""
        wanted = Version.of(version)
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = min(max(deadline - time.monotonic(), 0.0), MAX_WAIT_S)
            response = http_client.get(
                f"{self.url}/weightsync/weight_version",
                params={"at_least": wanted.label, "exact": exact, "timeout_s": wait_s},
                headers=self.headers,
                timeout=wait_s + 30,
            )
            served = self._served(response)
            if served.reaches(wanted, exact):
                return served
            if time.monotonic() >= deadline:
                raise TimeoutError(not_served(served, wanted, exact, timeout_s))

    @staticmethod
    def _served(response: httpx.Response) -> Version:
        response.raise_for_status()
        body = response.json()
        return Version(body["version"], body["step"])


def attach_server(
    url: str,
    *,
    syncd: str,
    replica: int = 0,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    **options: Any,
) -> AttachedServer:
    """Attach the `vllm serve` process at `url` (started with `SERVE_FLAGS`) as replica `replica`
    of syncd `syncd`; `options` as for `attach`; `api_key` where the server has `--api-key`.
    Raises AttachRefused naming what the server lacks."""
    make_settings(syncd, replica, **options)  # bad values fail here, before the server is asked
    body = {"syncd": syncd, "replica": replica, **options}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = http_client.post(
        f"{url.rstrip('/')}{ATTACH_ROUTE}", json=body, headers=headers, timeout=timeout_s
    )
    if response.status_code == 404:
        raise AttachRefused(
            f"{url} has no {ATTACH_ROUTE}: start it with --middleware {MIDDLEWARE} "
            f"(all of weight sync's flags: {' '.join(SERVE_FLAGS)})"
        )
    if response.status_code == 409:
        raise AttachRefused(response.json()["error"]["message"])
    response.raise_for_status()
    return AttachedServer(url.rstrip("/"), response.json()["workers"], headers)
