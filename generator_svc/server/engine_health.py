"""The engine's death, said out loud: the 503s, a metric and a log line with the cause, then an exit
that the supervisor turns into a restart.

vLLM's own watchdog stops the HTTP server within seconds of the engine core's death, so clients
and probes see "connection refused" and nothing says why. generator_svc keeps the server up
instead (`VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`): from the moment vLLM marks the engine dead,
`/healthz` and `/readyz` answer 503 (`generator_svc.server.routes`, which reads `engine.errored`) and
generation requests 503 with a body that says so (`generator_svc.server.request_guard`); `EngineWatch` sets
`weightsync_generator_engine_alive` to 0, logs the cause and, `engine_death_exit_s` later (time for
a scrape and for clients to read the 503), stops the server; `serve` then exits with status 1.
A shutdown asked for (SIGTERM or SIGINT, on which vLLM's launcher stops the engine, marking it dead
as it goes) is not a death: the generator exits with status 0 and reports nothing.
What restarts the generator: Kubernetes (`restartPolicy: Always`; the liveness probe on /healthz
too), or whatever runs the process; see generator_svc/README.md, "When the engine dies".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Protocol

from generator_svc.server import metrics

log = logging.getLogger("generator_svc.server.engine_health")
KEEP_ALIVE_ENV = "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"


class EngineClient(Protocol):
    """What the watch reads of vLLM's `AsyncLLM`."""

    @property
    def errored(self) -> bool: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


def keep_http_up_after_engine_death() -> None:
    """Turn off vLLM's watchdog exit (read lazily by its launcher each watchdog tick); the API
    process's environment is ours to set before the server starts."""
    os.environ[KEEP_ALIVE_ENV] = "1"


def _signal_name(code: int) -> str:
    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


def engine_death_cause(engine: object) -> str:
    """What is known in the API process about why the engine died: the exit codes of the engine
    core processes that ended (vLLM's process manager reports them), else that it failed.
    The engine core logs its own traceback to the same output before it dies."""
    # AsyncLLM -> its core client -> the client's resources -> vLLM's process manager; an engine
    # in-process or over Ray has none of them, and then only the generic cause is known.
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    finished_procs = getattr(getattr(resources, "engine_manager", None), "finished_procs", None)
    finished = finished_procs() if callable(finished_procs) else {}
    if finished:
        return "; ".join(f"{name} exited with {code}{_signal_name(code)}" for name, code in finished.items())
    return "the engine core reported a fatal error (its traceback is logged above)"


class EngineWatch:
    """Watches one vLLM engine client (`AsyncLLM`); `run()` is a task for the server's lifetime."""

    def __init__(self, engine: EngineClient, exit_after_s: float, poll_s: float = 0.2) -> None:
        self.engine = engine
        self.exit_after_s = exit_after_s
        self.poll_s = poll_s
        self.cause: str | None = None  # set once the death is recorded
        self.stopping = False  # the engine's shutdown was asked for: it is marked dead, not dying
        self._follow_shutdown()

    def _follow_shutdown(self) -> None:
        """Note a shutdown asked for before the engine is marked dead by it: vLLM's launcher stops
        the engine on SIGTERM or SIGINT through its client's `shutdown`, which a death does not
        call (vLLM's own monitor stops only the engine core client)."""
        shutdown = self.engine.shutdown

        def noted(timeout: float | None = None) -> None:
            # Said here, not in `run`: the server's shutdown may cancel `run` before its next poll.
            if not self.stopping:  # vLLM's launcher and its engine context both call it
                log.info("stopping the vLLM engine: a shutdown was asked for")
            self.stopping = True
            shutdown(timeout=timeout)

        self.engine.shutdown = noted  # type: ignore[method-assign]  # on this engine object only

    @property
    def dead(self) -> bool:
        """At once: vLLM's own flag, set by its engine-core monitor and output handler."""
        return self.engine.errored

    async def run(self) -> None:
        metrics.ENGINE_ALIVE.set(1)
        while not self.dead:
            await asyncio.sleep(self.poll_s)
        if self.stopping:
            return  # marked dead by the shutdown asked for, which `_follow_shutdown` logged
        self.cause = engine_death_cause(self.engine)
        metrics.ENGINE_ALIVE.set(0)
        metrics.ENGINE_DEATHS.inc()
        log.error(
            "the vLLM engine died: %s; answering 503 to /healthz and generation, exiting in %.0f s "
            "for the supervisor to restart this generator",
            self.cause,
            self.exit_after_s,
        )
        await asyncio.sleep(self.exit_after_s)
        log.error("exiting after the engine's death (%s)", self.cause)
        # vLLM's launcher stops the engine client and the HTTP server on SIGTERM.
        os.kill(os.getpid(), signal.SIGTERM)
