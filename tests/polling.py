"""Waiting for a condition in tests: poll with a generous timeout, so that speed stays out of the
assertions, and fail with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> object:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
