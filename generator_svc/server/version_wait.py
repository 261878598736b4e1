"""Waiting until a generator serves a weight version: that version or any newer trainer step, or
(`exact`) that version only.

One rule for every way in: `AttachedEngine.wait_version` (an attached `LLM`), `GET
/v1/weight_version?at_least=V` (`python -m generator_svc`), `GET /weightsync/weight_version` (a
`vllm serve` with the middleware) and `AttachedServer.wait_version` (its client). A trainer may be
several versions ahead of its rollouts: syncd then commits versions the rollout loop never asked
for, and a wait for exactly one of them would wait for weights that were already replaced.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from syncd.weight_version import Version

POLL_S = 0.05  # what the served label is read at; it changes only at an install's end
MAX_WAIT_S = 60.0  # the most one HTTP request waits (a client that needs longer asks again)


def not_served(served: Version, wanted: Version, exact: bool, waited_s: float) -> str:
    """The message of a wait that ended without `wanted`: both versions and how long it waited."""
    newer = "" if exact or wanted.step is None else " or newer"
    return f"the engine serves version {served.label!r}, not {wanted.label!r}{newer}, after {waited_s:g} s"


def wait_served(read: Callable[[], str], wanted: Version, exact: bool, timeout_s: float) -> Version:
    """Block until `read()` (the served label) reaches `wanted`; return the version served. Raises
    TimeoutError naming both versions after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (served := Version.of_label(read())).reaches(wanted, exact):
        if time.monotonic() >= deadline:
            raise TimeoutError(not_served(served, wanted, exact, timeout_s))
        time.sleep(POLL_S)
    return served


async def wait_served_async(refitter: Any, wanted: Version, exact: bool, timeout_s: float) -> Version | None:
    """`wait_served` on an event loop, for `refitter` (a `Refitter`): the version served, or None
    when `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    while not (served := Version.of_label(refitter.version)).reaches(wanted, exact):
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(POLL_S)
    return served
