"""The client of a `vllm serve` process started with weight sync's flags (`SERVE_FLAGS`): asks its
middleware (`generator_svc.attach.serve_middleware`) to attach the server's engine to syncd.
"""

from __future__ import annotations

from typing import Any

import httpx

from generator_svc.attach.engine_args import (
    ATTACH_ROUTE,
    MIDDLEWARE,
    SERVE_FLAGS,
    AttachRefused,
    make_settings,
)


def attach_server(
    url: str,
    *,
    syncd: str,
    replica: int = 0,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    **options: Any,
) -> dict:
    """Attach the `vllm serve` process at `url` (started with `SERVE_FLAGS`) as replica `replica`
    of syncd `syncd`; `options` as for `attach`; `api_key` where the server has `--api-key`.
    Returns its answer (`workers`: member ids, tp ranks, catalog hashes). Raises AttachRefused
    naming what the server lacks."""
    make_settings(syncd, replica, **options)  # bad values fail here, before the server is asked
    body = {"syncd": syncd, "replica": replica, **options}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{url.rstrip('/')}{ATTACH_ROUTE}", json=body, headers=headers, timeout=timeout_s)
    if response.status_code == 404:
        raise AttachRefused(
            f"{url} has no {ATTACH_ROUTE}: start it with --middleware {MIDDLEWARE} "
            f"(all of weight sync's flags: {' '.join(SERVE_FLAGS)})"
        )
    if response.status_code == 409:
        raise AttachRefused(response.json()["error"]["message"])
    response.raise_for_status()
    return response.json()
