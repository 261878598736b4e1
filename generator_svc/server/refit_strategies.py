"""The two refit modes of the API server, one strategy each behind `RefitStrategy`.

`StagedRefit` (`--refit-mode staged`): the workers receive into staging while serving goes on;
`apply` checks every worker's staging is complete, then holds generation for the install only:

1. check (no engine change): every worker's staging holds a complete version, else RefitRefused;
2. `pause_generation(mode=--pause-mode)`: `wait`: running requests finish on the committed
   weights; `keep`: they are held and continue on the new weights after step 5; `abort`: they end
   (a retryable 503). New ones are held (queued, not failed) until step 5;
3. `start_weight_update` / `update_weights` / `finish_weight_update` on every worker (vLLM's
   lifecycle: staging installed by parameter, vLLM's post-processing, CPU MoE fix);
4. `reset_prefix_cache` (KV computed with the old weights must not be reused);
5. `resume_generation`.
A refit that fails before step 3 never touches the engine. If step 3 itself fails, the workers
restore real tensors (`ws_recover`) but the weights may be torn: the generator refuses generation
(HTTP 503) until the next complete refit succeeds.

`InplaceRefit` (`--refit-mode inplace`, `generator_svc.worker.inplace`): steps 2 and the start of 3 come
before the transfer. `hold(refit_id)` pauses generation and opens the install on every worker,
and keeps a `Hold`; the data plane writes the bytes into the live layers; `apply` ends the
lifecycle (update, finish, reset, resume). `release` ends a hold without a commit (Abort, the
hold limit, or a newer refit's hold): when no layer was installed yet the committed weights are
whole and serving resumes, otherwise they are mixed and the generator refuses generation (503)
until a complete refit succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from generator_svc.server import metrics
from generator_svc.server.update_lifecycle import (
    DeadlineExceeded,
    RefitRefused,
    StagingRejected,
    Untouched,
    UpdateLifecycle,
)
from generator_svc.settings import RefitMode
from generator_svc.worker_protocol import CommitReadiness, StagedFile

log = logging.getLogger("generator_svc.server.refit")


class RefitStrategy(Protocol):
    """What a refit mode does for each request of the API server. `apply` raises RefitRefused
    (engine untouched), DeadlineExceeded (generation refused from then on) or the lifecycle's
    error; on success the version is live."""

    mode: RefitMode

    @property
    def holding(self) -> bool:
        """Generation is held for a transfer (an update is under way between requests)."""
        ...

    async def stage_file(self, path: str, refit_id: str) -> list[StagedFile]: ...

    async def abort(self, refit_id: str) -> None: ...

    async def apply(self, version: str, refit_id: str, deadline: float | None) -> None: ...

    async def hold(self, refit_id: str) -> None: ...

    async def release(self, refit_id: str, reason: str) -> bool: ...


class StagedRefit:
    mode = RefitMode.STAGED

    def __init__(self, lifecycle: UpdateLifecycle) -> None:
        self._life = lifecycle

    @property
    def holding(self) -> bool:
        return False

    async def stage_file(self, path: str, refit_id: str) -> list[StagedFile]:
        """Stage a safetensors checkpoint on every worker (serving goes on). A worker that rejects
        the file (`StagedFile.rejected`) makes it StagingRejected; staging is dropped either way."""
        engine = self._life.engine
        async with self._life.exclusive():  # never rewrite staging while an apply reads it
            try:
                results = StagedFile.replies(
                    await engine.collective_rpc("ws_stage_file", args=(path, refit_id))
                )
            except Exception:
                await engine.collective_rpc("ws_abort", args=(refit_id,))
                metrics.REFITS.labels("refused").inc()
                raise
            rejected = [r.rejected for r in results if r.rejected]
            if rejected:
                await engine.collective_rpc("ws_abort", args=(refit_id,))
                metrics.REFITS.labels("refused").inc()
                raise StagingRejected("; ".join(rejected))
        return results

    async def abort(self, refit_id: str) -> None:
        async with self._life.exclusive():
            await self._life.engine.collective_rpc("ws_abort", args=(refit_id,))

    async def apply(self, version: str, refit_id: str, deadline: float | None) -> None:
        async with self._life.exclusive():
            try:
                await self._install(version, deadline)
            except RefitRefused as e:
                metrics.REFITS.labels("refused").inc()
                await self._life.report(refit_id, version, ok=False, error=str(e))
                raise
            except DeadlineExceeded:
                # The workers are still inside the update (their RPC loop is busy, so no outcome can
                # reach them now): each worker's own commit wait expires and reports the failure.
                metrics.REFITS.labels("timeout").inc()
                raise
            except Exception as e:
                metrics.REFITS.labels("failed").inc()
                await self._life.report(refit_id, version, ok=False, error=f"{type(e).__name__}: {e}")
                raise
            metrics.REFITS.labels("committed").inc()
            await self._life.report(refit_id, version, ok=True)

    async def hold(self, refit_id: str) -> None:
        raise RefitRefused("holding generation for a transfer needs --refit-mode inplace")

    async def release(self, refit_id: str, reason: str) -> bool:
        return False  # a staged generator never holds

    async def _install(self, version: str, deadline: float | None) -> None:
        life = self._life
        status = CommitReadiness.replies(await life.engine.collective_rpc("ws_status"))
        problems = [problem for w in status if (problem := w.problem())]
        if problems:
            raise RefitRefused(f"version {version} is not completely staged: {'; '.join(problems)}")
        if deadline is not None and time.monotonic() >= deadline:
            raise RefitRefused(f"version {version}: the commit deadline passed before the install began")
        start = time.perf_counter()
        update = asyncio.ensure_future(self._update(version, deadline))
        try:
            await life.within(deadline, update, version)
        except Untouched as e:  # the deadline passed in the same instant: nothing changed
            await life.engine.resume_generation()
            raise RefitRefused(str(e)) from None
        except Exception:
            log.exception("update to version %s failed inside the lifecycle; refusing generation", version)
            life.refuse_generation()
            await life.engine.collective_rpc("ws_recover")
            raise
        await life.went_live(version, start)

    async def _update(self, version: str, deadline: float | None) -> None:
        # With --pause-mode wait running requests finish first; if that outlasts the deadline, the
        # engine is left untouched.
        await self._life.pause()
        if deadline is not None and time.monotonic() >= deadline:
            raise Untouched(f"version {version}: the deadline passed while generation paused")
        await self._life.engine.start_weight_update()
        await self._life.end_update(version)


@dataclass
class Hold:
    """inplace: generation is held and the install is open on every worker for refit `refit_id`,
    since `since` (perf_counter). Made by `InplaceRefit.hold` once the install is open; ended by
    exactly one of `apply` (commit), `release` (Abort, a newer refit) or its watchdog (the hold
    limit), whichever `InplaceRefit._end_hold` hands it to first."""

    refit_id: str
    since: float
    watchdog: asyncio.Task[None] | None = field(default=None, repr=False)

    def stop_watchdog(self) -> None:
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()


class InplaceRefit:
    mode = RefitMode.INPLACE

    def __init__(self, lifecycle: UpdateLifecycle) -> None:
        self._life = lifecycle
        self._hold: Hold | None = None  # from `hold` until `_end_hold` hands it to its ender

    @property
    def holding(self) -> bool:
        return self._hold is not None

    async def stage_file(self, path: str, refit_id: str) -> list[StagedFile]:
        metrics.REFITS.labels("refused").inc()
        raise RefitRefused("this generator runs --refit-mode inplace: it has no staging to load a file into")

    async def abort(self, refit_id: str) -> None:
        """Nothing is staged in this mode; a hold ends through `release`."""

    async def hold(self, refit_id: str) -> None:
        """Hold generation and open the in-place install of `refit_id` on every worker (a retry for
        the refit already held is a no-op). Syncd runs one refit at a time, so a hold still open
        for another refit is over (syncd restarted or gave it up): it is released first. On failure
        nothing was written and the committed weights serve on."""
        life = self._life
        async with life.exclusive():
            if self._hold is not None:
                if self._hold.refit_id == refit_id:
                    return
                await self._release(self._end_hold(self._hold.refit_id), f"refit {refit_id} asks to hold")
            since = time.perf_counter()
            await life.pause()
            try:
                await life.engine.start_weight_update()
                await life.engine.collective_rpc("ws_hold", args=(refit_id,))
            except Exception:
                log.exception("refit %s: opening the in-place install failed; serving on", refit_id)
                await life.engine.collective_rpc("ws_recover")
                if life.serving:
                    await life.engine.resume_generation()
                raise
            hold = self._hold = Hold(refit_id, since)
            hold.watchdog = asyncio.ensure_future(self._expire(refit_id))
        log.info("refit %s holds generation for its in-place install", refit_id)

    async def release(self, refit_id: str, reason: str) -> bool:
        """End the hold of `refit_id` without a commit. False when it holds nothing (committed or
        released already)."""
        async with self._life.exclusive():
            hold = self._end_hold(refit_id)
            if hold is None:
                return False
            await self._release(hold, reason)
            return True

    async def apply(self, version: str, refit_id: str, deadline: float | None) -> None:
        """End the held lifecycle of `refit_id`: every layer arrived (checked by the workers),
        finish, resume. Failures leave generation refused, as in `release`."""
        life = self._life
        async with life.exclusive():
            hold = self._end_hold(refit_id)
            if hold is None:
                metrics.REFITS.labels("refused").inc()
                other = f" (refit {self._hold.refit_id} does)" if self._hold else ""
                error = f"version {version}: refit {refit_id or '(none)'} holds no in-place install{other}"
                await life.report(refit_id, version, ok=False, error=error)
                raise RefitRefused(error)
            update = asyncio.ensure_future(life.end_update(version))
            try:
                await life.within(deadline, update, version)
            except DeadlineExceeded:
                metrics.REFITS.labels("timeout").inc()
                raise
            except Exception as e:
                log.exception("in-place install of version %s failed; refusing generation", version)
                life.refuse_generation()
                await life.engine.collective_rpc("ws_release")
                await life.engine.collective_rpc("ws_recover")
                metrics.REFITS.labels("failed").inc()
                await life.report(refit_id, version, ok=False, error=f"{type(e).__name__}: {e}")
                raise
            await life.went_live(version, hold.since)
            metrics.REFITS.labels("committed").inc()
            await life.report(refit_id, version, ok=True)

    def _end_hold(self, refit_id: str) -> Hold | None:
        """Hand the hold of `refit_id` to the caller, who ends it; None when it holds nothing. No
        await: exactly one caller gets it."""
        hold = self._hold
        if hold is None or not refit_id or hold.refit_id != refit_id:
            return None
        self._hold = None
        hold.stop_watchdog()
        return hold

    async def _release(self, hold: Hold | None, reason: str) -> None:
        """The workers close the install and put real tensors back; serve on if nothing was
        installed, else refuse generation (mixed weights). Runs inside `exclusive`."""
        if hold is None:
            return
        life = self._life
        installed = sum(await life.engine.collective_rpc("ws_release"))
        await life.engine.collective_rpc("ws_recover")
        metrics.REFITS.labels("failed").inc()
        if installed:
            log.error(
                "refit %s released (%s) after %d layers were installed: the weights are mixed, "
                "refusing generation until a complete refit",
                hold.refit_id,
                reason,
                installed,
            )
            life.refuse_generation()
            return
        log.warning(
            "refit %s released (%s) before any layer was installed; serving version %s on",
            hold.refit_id,
            reason,
            life.version,
        )
        if life.serving:
            await life.engine.resume_generation()

    async def _expire(self, refit_id: str) -> None:
        limit = self._life.settings.hold_limit_s
        await asyncio.sleep(limit)
        await self.release(refit_id, f"no commit within --hold-limit-s {limit:g}")


def strategy_for(mode: RefitMode, lifecycle: UpdateLifecycle) -> RefitStrategy:
    """The strategy of `mode`, chosen once when the service starts."""
    strategies: dict[RefitMode, type[StagedRefit] | type[InplaceRefit]] = {
        RefitMode.STAGED: StagedRefit,
        RefitMode.INPLACE: InplaceRefit,
    }
    return strategies[mode](lifecycle)
