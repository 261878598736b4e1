"""Keeping Python's cyclic garbage collector off while transfers run, for the caller that owns it.

Why: a full collection in a process holding torch takes tens of milliseconds (87 ms measured on
an H100 host by bench/loopback_bench.py, the 108 ms gap seen on 2x H200 at 64 MiB buckets),
during which the host enqueues nothing and the link idles. Reference counting frees everything
else as usual; the cycles made during a transfer are collected after the last one ends.

The collector is process state, so the pause is an object its owner passes to the loops
(`LoopOptions.gc_pause`), never a hidden global: a member's `MemberAgent` owns one and shares it
by all its stages (one per stage may run at once), which is what the counting below is for. Two
owners in one process (tests that run several members in threads) may each switch it back on
early; neither leaves it off when it was on before.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class GcPause:
    """The collector stays off from the first `held()` until the last one ends, then goes back to
    what it was before the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()
