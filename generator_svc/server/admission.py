"""Admission of generation requests: at most `max_concurrent` served at once, at most `max_queued`
waiting for a slot, and the rest refused at once (the edge answers 429 with `Retry-After`).

vLLM's scheduler queues whatever it is given, without bound: under a flood the API server keeps
every request, its prompt and its response stream in memory. A bounded queue turns overload into
an answer a client can act on. One `Admission` per app, used only from its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class OverloadedError(Exception):
    """Every slot is busy and the queue is full."""


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError(
                f"need max_concurrent >= 1 and max_queued >= 0, got {max_concurrent}, {max_queued}"
            )
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_concurrent)
        self.running = 0
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body of the `async with` (the whole response, streamed or not);
        raise OverloadedError, at once, when no slot is free and `max_queued` requests already wait."""
        if self.running >= self.max_concurrent and self.waiting >= self.max_queued:
            raise OverloadedError(
                f"{self.running} requests running (--max-concurrent-requests {self.max_concurrent}) "
                f"and {self.waiting} queued (--max-queued-requests {self.max_queued})"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
