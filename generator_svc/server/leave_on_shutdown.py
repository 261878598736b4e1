"""The workers leave syncd when the generator is asked to stop, before vLLM stops them.

vLLM's launcher stops the engine on SIGTERM or SIGINT through the engine client's `shutdown`, run
on an executor thread; with vLLM's default `shutdown_timeout` (0: abort) it kills the engine core
and its workers at once, so a worker never gets to leave on its way out. Without a Leave, syncd
keeps the workers' sessions until their leases run out: a refit started meanwhile waits for them
and aborts, and the restarted generator's workers are refused their member ids until then.

So before the engine stops, every worker leaves (`ws_close`, through collective_rpc on the event
loop). Where the signal reached the whole process group (a terminal's Ctrl-C, SLURM's scancel),
the engine core is stopping already and takes no more calls: the wait then ends when the engine
is marked dead, and meanwhile the workers, stopped gracefully by their own signal, leave on their
way out (`generator_svc.worker`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

log = logging.getLogger("generator_svc.server.leave_on_shutdown")
# The Leave RPC's own bound (`syncd.member.client`) plus the member's threads winding down.
WORKERS_LEAVE_TIMEOUT_S = 10.0
_POLL_S = 0.1


def leave_syncd_before_shutdown(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Wrap `engine.shutdown` (vLLM's `AsyncLLM`, on this object only) so the first call makes the
    workers leave syncd, within `WORKERS_LEAVE_TIMEOUT_S`, before the engine stops."""
    shutdown = engine.shutdown
    left = False

    def leaving_first(timeout: float | None = None) -> None:
        nonlocal left
        # A dead engine's workers are gone: their sessions end with their leases.
        if not left and not engine.errored and not _on_a_running_loop():
            left = True
            _workers_leave(engine, loop)
        shutdown(timeout=timeout)

    engine.shutdown = leaving_first


def _on_a_running_loop() -> bool:
    """Whether this thread runs an event loop: waiting on it here would deadlock (vLLM's engine
    context calls `shutdown` again on the loop's thread, after the launcher's call)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _workers_leave(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """`ws_close` on every worker, within `WORKERS_LEAVE_TIMEOUT_S`. When the engine refuses it or
    is marked dead meanwhile, it is stopping by itself (a signal to the whole process group): its
    workers leave as vLLM stops them, and the engine is marked dead once its core and workers
    exited, so this waits for that, lest the shutdown that follows kill them first."""
    future = asyncio.run_coroutine_threadsafe(engine.collective_rpc("ws_close"), loop)
    deadline = time.monotonic() + WORKERS_LEAVE_TIMEOUT_S
    cause = f"no answer within {WORKERS_LEAVE_TIMEOUT_S:g} s"
    try:
        while not future.done() and not engine.errored and time.monotonic() < deadline:
            concurrent.futures.wait([future], timeout=_POLL_S)
        if future.done():
            future.result()  # raises what the call raised
            log.info("the workers left syncd: the generator is stopping")
            return
        if engine.errored:
            cause = "it stopped before answering"
    except Exception as e:  # noqa: BLE001 - e.g. the engine core is shutting down already
        cause = f"{type(e).__name__}: {e}"
    finally:
        future.cancel()
    while not engine.errored and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if engine.errored:
        log.info("the engine was stopping by itself (%s): its workers leave syncd as they stop", cause)
    else:
        log.warning("the workers could not leave syncd (%s); their leases end their sessions", cause)
