"""The states of a refit, as syncd records them (SQLite), reports them (HTTP, `syncctl`) and
labels its metrics with them (lower case), and how a client waits for a final one. A StrEnum:
each state is also its plain string, which is what travels in JSON and sits in the database."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any


class RefitState(StrEnum):
    PREPARING = "PREPARING"  # membership, plan and groups agreed
    TRANSFERRING = "TRANSFERRING"
    VERIFYING = "VERIFYING"  # checksums compared
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"  # final: the version is live (unconfirmed members listed)
    ABORTED = "ABORTED"  # final: the previous version stays live


TERMINAL = frozenset({RefitState.COMMITTED, RefitState.ABORTED})


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
    Raises TimeoutError naming the state it is still in. The one refit-waiting loop: `syncctl`,
    the demo and the tests use it."""
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
