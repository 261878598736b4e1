"""The engine's weight-update lifecycle as both refit modes drive it, in the API-server process.

`UpdateLifecycle` owns what the modes share: the engine client, the served version and whether
generation is allowed, the one-transition-at-a-time lock, the update that missed its deadline, and
the steps every refit ends with (update, finish, reset the prefix cache, go live, report to syncd).
The modes (`generator_svc.server.refit_strategies`) decide when those steps run;
`generator_svc.server.refit` picks the mode once from the settings.

The lock is only ever held inside one request (`exclusive`): one staging write, install, hold
opening or release at a time. What outlives a request (an in-place hold) is an object of its mode,
never a held lock.

Deadline (syncd's commit timeout): the install runs under it. If it passes first, `within` gives
up at once (`DeadlineExceeded`), refuses generation, and lets the update finish in the background
without ever making its version live or resuming generation: syncd has already been told the
commit failed, so serving that version would run weights syncd does not know about.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from generator_svc.server import metrics
from generator_svc.server.refit_history import RefitHistory, RefitPause
from generator_svc.settings import PauseMode, Settings
from generator_svc.vllm_adapter import WeightTransferUpdateRequest, pause_scheduler
from generator_svc.worker_protocol import CommitOutcome, WorkerInstall
from syncd.weight_version import version_of_label

log = logging.getLogger("generator_svc.server.refit")


class RefitRefused(ValueError):
    """The refit cannot be applied as asked (incomplete or invalid staging, no time left, a mode
    that cannot do it); nothing changed. HTTP 409."""


class StagingRejected(RefitRefused):
    """A worker rejected what it was asked to stage (no such file, shape or dtype not the
    catalog's); staging was dropped, the engine untouched. HTTP 409."""


class Untouched(RuntimeError):
    """An update gave up before it changed the engine (the committed weights are intact)."""


class DeadlineExceeded(TimeoutError):
    """The install did not finish before the commit deadline; generation is refused until the
    next complete refit (the weights may be partly installed). HTTP 504."""


@dataclass(frozen=True)
class LastInstall:
    """The last committed install: generation held `hold_seconds`; the slowest worker's copy and
    post-processing seconds; parameters and bytes over all workers; loader fallbacks. inplace only:
    the most extra memory one worker used (`extra_bytes`: its receive buffers plus the checkpoint
    tensors of the layers it was receiving, at their peak) and the largest bucket it received."""

    version: str
    hold_seconds: float
    copy_seconds: float
    process_seconds: float
    params_copied: int
    bytes_copied: int
    fallback_params: list[str]
    extra_bytes: int = 0
    bucket_bytes: int = 0
    pause_mode: PauseMode = PauseMode.WAIT
    install_seconds: float = 0.0  # of hold_seconds, the engine paused (see RefitPause)


@dataclass(frozen=True)
class ServingState:
    """What the generator serves (`GET /v1/weight_version`): the version label, whether generation
    is allowed, and whether an update is under way. Not syncd's `RefitState` (a refit's phase)."""

    version: str
    serving: bool
    updating: bool


class UpdateLifecycle:
    """The served weights and the engine steps that change them (see the module docstring)."""

    def __init__(self, engine: Any, settings: Settings) -> None:
        self.engine = engine  # vLLM's AsyncLLM (or a stand-in with its methods, in tests)
        self.settings = settings
        self.version = settings.initial_version
        self.serving = True
        self.last_install: LastInstall | None = None
        self.history = RefitHistory()
        self._paused_at = 0.0  # perf_counter when the last pause call returned
        self._held_since = 0.0  # perf_counter from which the last pause held requests
        self._pause_call_s = 0.0  # how long the last pause call took
        self._lock = asyncio.Lock()
        self._late_update: asyncio.Future[None] | None = None  # an update that missed its deadline

    @property
    def busy(self) -> bool:
        """A transition runs now, or an update that missed its deadline is still settling."""
        late = self._late_update is not None and not self._late_update.done()
        return self._lock.locked() or late

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """One staging writer, install, hold opening or release at a time, and none while a late
        update still runs. Entered and left by the same request."""
        async with self._lock:
            if self._late_update is not None:
                await self._late_update
                self._late_update = None
            yield

    async def pause(self) -> None:
        """Pause generation as `--pause-mode` says (vLLM's own modes): `wait` returns once running
        requests finished, `keep` once the engine holds them between steps, `abort` once they
        ended. New requests queue until `resume_generation`.

        When requests began to be held: the engine core takes the pause between two steps, so
        with `keep` and `abort` the step in flight at the call still runs (its requests get their
        token) and the hold begins when the core answers; with `wait` new requests are held while
        the running ones finish, so the hold is counted from the call (at most one step early)."""
        called = time.perf_counter()
        await pause_scheduler(self.engine, self.settings.pause_mode.value)
        self._paused_at = time.perf_counter()
        self._pause_call_s = self._paused_at - called
        self._held_since = called if self.settings.pause_mode is PauseMode.WAIT else self._paused_at

    async def went_live(self, version: str, held_since: float) -> None:
        """`version` is installed whole: serve it, resume generation (held since `held_since`,
        a perf_counter time), record the install."""
        self.version, self.serving = version, True
        metrics.SERVING.set(1)
        set_version_metric(version)
        resuming = time.perf_counter()
        await self.engine.resume_generation()
        resumed = time.perf_counter()
        held, install = resumed - held_since, resuming - self._paused_at
        metrics.APPLY_SECONDS.observe(held)
        metrics.INSTALL_SECONDS.observe(install)
        self.history.add(
            RefitPause(
                version,
                self.settings.pause_mode,
                pause_s=round(resumed - self._held_since, 6),
                install_s=round(install, 6),
                pause_call_s=round(self._pause_call_s, 6),
            )
        )
        await self._record_install(version, held, install)

    async def within(self, deadline: float | None, update: asyncio.Future[None], version: str) -> None:
        """Wait for `update` until `deadline`. Past it, refuse generation, let the update finish in
        the background without ever making `version` live, and raise DeadlineExceeded."""
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            await asyncio.wait_for(asyncio.shield(update), remaining)
        except TimeoutError:
            self.refuse_generation()
            self._late_update = asyncio.ensure_future(self._settle_late_update(update, version))
            raise DeadlineExceeded(
                f"version {version} was not installed before the commit deadline; "
                "generation is refused until a complete refit succeeds"
            ) from None

    async def end_update(self, version: str) -> None:
        """The last steps of the lifecycle: install (staged) or check (inplace), finish (which
        labels every later token with `version`), and drop KV computed with the old weights.
        Requests kept across the pause (`--pause-mode keep`) hold KV blocks, and vLLM resets the
        prefix cache only when none does: they are preempted, and recompute their prompt and the
        tokens they have so far on the new weights when generation resumes. A prefix cache that
        kept their blocks would hand old-weights KV to requests that start after the refit."""
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await self.engine.finish_weight_update(weight_version=version)
        await self.engine.reset_prefix_cache(reset_running_requests=True)

    def refuse_generation(self) -> None:
        self.serving = False
        metrics.SERVING.set(0)

    async def report(self, refit_id: str, version: str, *, ok: bool, error: str = "") -> None:
        """Tell every worker the outcome of the Commit of `refit_id` (they report it to syncd)."""
        if refit_id:
            outcome = CommitOutcome(refit_id, version, ok, error)
            await self.engine.collective_rpc("ws_committed", args=(outcome.to_wire(),))

    async def _record_install(self, version: str, held_s: float, install_s: float) -> None:
        """Keep what the workers' install did (`GET /v1/install`), count loader fallbacks."""
        replies = await self.engine.collective_rpc("ws_last_install")
        reports = WorkerInstall.replies(r for r in replies if r is not None)
        fallback = [p for r in reports for p in r.fallback_params]
        if fallback:
            metrics.INSTALL_FALLBACK_PARAMS.inc(len(fallback))
            log.warning(
                "version %s: %d parameters went through vLLM's loaders: %s",
                version,
                len(fallback),
                ", ".join(fallback[:10]),
            )
        self.last_install = LastInstall(
            version=version,
            hold_seconds=round(held_s, 6),
            copy_seconds=round(max((r.copy_s for r in reports), default=0.0), 6),
            process_seconds=round(max((r.process_s for r in reports), default=0.0), 6),
            params_copied=sum(r.params_copied for r in reports),
            bytes_copied=sum(r.bytes_copied for r in reports),
            fallback_params=fallback,
            extra_bytes=max((r.receive_buffer_bytes + r.peak_open_bytes for r in reports), default=0),
            bucket_bytes=max((r.bucket_bytes for r in reports), default=0),
            pause_mode=self.settings.pause_mode,
            install_seconds=round(install_s, 6),
        )

    async def _settle_late_update(self, update: asyncio.Future[None], version: str) -> None:
        """Wait for an update that missed its deadline (`exclusive` makes everything else that
        touches staging or the engine wait for this). Whatever it did, `version` never goes live:
        syncd was told it failed."""
        try:
            await update
            log.warning("version %s finished installing after its deadline; not serving it", version)
        except Untouched:
            log.warning(
                "version %s missed its deadline before the install began; serving %s again",
                version,
                self.version,
            )
            self.serving = True
            metrics.SERVING.set(1)
            await self.engine.resume_generation()
        except Exception:
            log.exception("late update to version %s failed; recovering the workers", version)
            await self.engine.collective_rpc("ws_recover")


def set_version_metric(version: str) -> None:
    if (trainer_version := version_of_label(version)) is not None:
        metrics.WEIGHT_VERSION.set(trainer_version)
