"""How an HTTP client of syncd waits for a refit to end: `syncctl refit --wait`, the demo and the
tests poll `GET /v1/refits/{id}` through this one loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from syncd.states import TERMINAL


def wait_final(
    get: Callable[[str], Mapping[str, Any]],
    refit_id: str,
    timeout_s: float,
    *,
    on_state: Callable[[Mapping[str, Any]], None] | None = None,
    poll_s: float = 0.2,
) -> Mapping[str, Any]:
    """Poll syncd's `GET /v1/refits/{refit_id}` (`get(path)` returns the JSON body) until the refit
    is COMMITTED or ABORTED, and return that body; `on_state` sees the body at each new state.
    Raises TimeoutError naming the state it is still in."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        body = get(f"/v1/refits/{refit_id}")
        if body["state"] != last:
            last = body["state"]
            if on_state is not None:
                on_state(body)
        if body["state"] in TERMINAL:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"{refit_id} still {body['state']} after {timeout_s:g} s")
        time.sleep(poll_s)
