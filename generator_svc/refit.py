"""The engine-level update lifecycle, run in the API-server process.

`Refitter.apply(version)` is the only way weights change while serving:

1. check (no engine change): every worker's staging holds a complete version, else ValueError;
2. `pause_generation(mode="wait")`: running requests finish on the committed weights, new ones are
   held (queued, not failed) until step 5 - generation waits for at most the update phase;
3. `start_weight_update` / `update_weights` / `finish_weight_update` on every worker (vLLM's
   lifecycle: staging installed by parameter, vLLM's post-processing, CPU MoE fix);
4. `reset_prefix_cache` (KV computed with the old weights must not be reused);
5. `resume_generation`.

A refit that fails before step 3 (bad shape, missing tensor, interrupted transfer) never touches
the engine: it keeps serving the committed version. If step 3 itself fails, the workers restore
real tensors (`ws_recover`) but the weights may be torn: the generator then refuses generation
(HTTP 503) and keeps held requests held until the next complete refit succeeds.

In `inplace` mode (`generator_svc.inplace`) steps 2 and the start of 3 come before the transfer:
`hold(refit_id)` pauses generation and opens the install on every worker; the data plane writes the
bytes into the live layers; `apply` ends the lifecycle (update, finish, reset, resume). `release`
ends a hold without a commit (Abort, `--hold-limit-s`, or a newer refit's hold): when no layer was
installed yet the committed weights are whole and serving resumes, otherwise the weights are mixed
and the generator refuses generation (503) until a complete refit succeeds.

Deadline (syncd's commit timeout): steps 3-4 run under it. If it passes first, `apply` gives up at
once (`DeadlineExceeded`), refuses generation, and lets the update finish in the background
without ever making its version live or resuming generation: syncd has already been told the
commit failed, so serving that version would run weights syncd does not know about.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from generator_svc import metrics
from generator_svc.settings import Settings
from syncd.weight_version import version_of_label

log = logging.getLogger("generator_svc.refit")


class RefitRefused(ValueError):
    """The staged weights are not a complete version (or no time is left); nothing changed."""


class _Untouched(RuntimeError):
    """An update gave up before it changed the engine (the committed weights are intact)."""


class DeadlineExceeded(TimeoutError):
    """The install did not finish before the commit deadline; generation is refused until the
    next complete refit (the weights may be partly installed)."""


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


@dataclass
class _Hold:
    """inplace: the refit that holds generation, since when, and its `--hold-limit-s` watchdog."""

    refit_id: str
    since: float
    watchdog: asyncio.Task | None = None


@dataclass(frozen=True)
class RefitState:
    version: str
    serving: bool
    updating: bool


class Refitter:
    def __init__(self, engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.version = settings.initial_version
        self.serving = True
        self._lock = asyncio.Lock()
        self._late_update: asyncio.Future | None = None  # an update that missed its deadline
        # Authenticates the workers' commit requests (`/internal/commit`); handed to them only
        # through collective_rpc, never over the network.
        self.commit_token = secrets.token_urlsafe(32)
        self.workers: list[dict] = []
        # Where the workers publish their status (`worker_status`), read by /healthz and /readyz.
        self.status_dir = tempfile.mkdtemp(prefix="generator-workers-")
        self.last_install: LastInstall | None = None
        self._held: _Hold | None = None  # inplace: set from `hold` to `apply` or `release`

    @property
    def state(self) -> RefitState:
        late = self._late_update is not None and not self._late_update.done()
        return RefitState(self.version, self.serving, self._lock.locked() or late)

    async def setup(self, internal_url: str) -> list[dict]:
        """Catalog, staging (staged mode) and syncd registration on every worker; tp rank 0 relays
        syncd's commands to `internal_url` (`/commit`, and in inplace mode `/hold`, `/release`)."""
        self.workers = await self.engine.collective_rpc(
            "ws_setup",
            kwargs={
                "replica": self.settings.replica,
                "syncd": self.settings.syncd,
                "auth_token": self.settings.auth_token,
                "internal_url": internal_url,
                "refit_mode": self.settings.refit_mode,
                "hold_limit_s": self.settings.hold_limit_s,
                "commit_token": self.commit_token,
                "data_host": self.settings.data_host,
                "in_flight": self.settings.in_flight_buckets,
                "status_dir": self.status_dir,
            },
        )
        await self.engine.update_weight_version(self.version)
        metrics.CATALOG_BYTES.set(sum(w["nbytes"] for w in self.workers))
        metrics.SERVING.set(1)
        self._set_version_metric(self.version)
        return self.workers

    async def stage_file(self, path: str, refit_id: str) -> list[dict]:
        """Stage a safetensors checkpoint on every worker (staging only; serving goes on)."""
        start = time.perf_counter()
        async with self._exclusive():  # never rewrite staging while an apply reads it
            try:
                out = await self.engine.collective_rpc("ws_stage_file", args=(path, refit_id))
            except Exception:
                await self.engine.collective_rpc("ws_abort", args=(refit_id,))
                metrics.REFITS.labels("refused").inc()
                raise
        metrics.STAGE_SECONDS.observe(time.perf_counter() - start)
        metrics.STAGED_BYTES.inc(sum(w["nbytes"] for w in self.workers))
        return out

    async def abort(self, refit_id: str = "") -> None:
        async with self._exclusive():
            await self.engine.collective_rpc("ws_abort", args=(refit_id,))

    async def apply(self, version: str, refit_id: str = "", timeout_s: float | None = None) -> RefitState:
        """Make `version` (completely staged) live, within `timeout_s` when given (syncd's commit
        deadline, less a margin). Raises RefitRefused (engine untouched), DeadlineExceeded
        (generation refused from then on, see the module docstring) or the lifecycle's error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self.settings.refit_mode == "inplace":
            return await self._commit_held(version, refit_id, deadline)
        async with self._exclusive():
            try:
                await self._apply_locked(version, deadline)
            except RefitRefused as e:
                metrics.REFITS.labels("refused").inc()
                await self._report(refit_id, version, ok=False, error=str(e))
                raise
            except DeadlineExceeded:
                # The workers are still inside the update (their RPC loop is busy, so no outcome can
                # reach them now): each worker's own commit wait expires and reports the failure.
                metrics.REFITS.labels("timeout").inc()
                raise
            except Exception as e:
                metrics.REFITS.labels("failed").inc()
                await self._report(refit_id, version, ok=False, error=f"{type(e).__name__}: {e}")
                raise
            metrics.REFITS.labels("committed").inc()
            await self._report(refit_id, version, ok=True)
            return self.state

    async def _apply_locked(self, version: str, deadline: float | None) -> None:
        status = await self.engine.collective_rpc("ws_status")
        problems = [
            f"{w['member_id']}: " + (", ".join(w["missing"]) if w["refit_id"] else "nothing staged")
            for w in status
            if w["missing"] or not w["refit_id"]
        ]
        if problems:
            raise RefitRefused(f"version {version} is not completely staged: {'; '.join(problems)}")
        if deadline is not None and time.monotonic() >= deadline:
            raise RefitRefused(f"version {version}: the commit deadline passed before the install began")
        start = time.perf_counter()
        update = asyncio.ensure_future(self._update(version, deadline))
        try:
            await self._within(deadline, update, version)
        except _Untouched as e:  # the deadline passed in the same instant: nothing changed
            await self.engine.resume_generation()
            raise RefitRefused(str(e)) from None
        except Exception:
            log.exception("update to version %s failed inside the lifecycle; refusing generation", version)
            self._refuse_generation()
            await self.engine.collective_rpc("ws_recover")
            raise
        await self._went_live(version, start)

    async def _went_live(self, version: str, held_since: float) -> None:
        """`version` is installed whole: serve it, resume generation (held since `held_since`,
        a perf_counter time), record the install."""
        self.version, self.serving = version, True
        metrics.SERVING.set(1)
        self._set_version_metric(version)
        await self.engine.resume_generation()
        held = time.perf_counter() - held_since
        metrics.APPLY_SECONDS.observe(held)
        await self._record_install(version, held)

    async def _update(self, version: str, deadline: float | None) -> None:
        # Running requests finish first (mode="wait"); if that outlasts the deadline, the engine
        # is left untouched.
        await self.engine.pause_generation(mode="wait", clear_cache=False)
        if deadline is not None and time.monotonic() >= deadline:
            raise _Untouched(f"version {version}: the deadline passed while running requests finished")
        await self.engine.start_weight_update()
        await self._end_update(version)

    # --- inplace mode ---

    async def hold(self, refit_id: str) -> None:
        """Hold generation and open the in-place install of `refit_id` on every worker (a retry for
        the refit already held is a no-op). Syncd runs one refit at a time, so a hold still open
        for another refit is over (syncd restarted or gave it up): it is released first. On failure
        nothing was written and the committed weights serve on."""
        if self.settings.refit_mode != "inplace":
            raise RefitRefused("holding generation for a transfer needs --refit-mode inplace")
        if self._held is not None:
            if self._held.refit_id == refit_id:
                return
            await self.release(self._held.refit_id, f"refit {refit_id} asks to hold")
        await self._lock.acquire()
        try:
            if self._late_update is not None:
                await self._late_update
                self._late_update = None
            since = time.perf_counter()
            await self.engine.pause_generation(mode="wait", clear_cache=False)
            try:
                await self.engine.start_weight_update()
                await self.engine.collective_rpc("ws_hold", args=(refit_id,))
            except Exception:
                log.exception("refit %s: opening the in-place install failed; serving on", refit_id)
                await self.engine.collective_rpc("ws_recover")
                if self.serving:
                    await self.engine.resume_generation()
                raise
        except BaseException:
            self._lock.release()
            raise
        self._held = _Hold(refit_id, since)
        self._held.watchdog = asyncio.ensure_future(self._expire(refit_id))
        log.info("refit %s holds generation for its in-place install", refit_id)

    async def release(self, refit_id: str, reason: str) -> bool:
        """End the hold of `refit_id` without a commit. False when it holds nothing (committed or
        released already)."""
        hold = self._held
        if hold is None or hold.refit_id != refit_id:
            return False
        self._held = None
        self._stop_watchdog(hold)
        try:
            installed = sum(await self.engine.collective_rpc("ws_release"))
            await self.engine.collective_rpc("ws_recover")
            metrics.REFITS.labels("failed").inc()
            if installed:
                log.error(
                    "refit %s released (%s) after %d layers were installed: the weights are mixed, "
                    "refusing generation until a complete refit",
                    refit_id,
                    reason,
                    installed,
                )
                self._refuse_generation()
            else:
                log.warning(
                    "refit %s released (%s) before any layer was installed; serving version %s on",
                    refit_id,
                    reason,
                    self.version,
                )
                if self.serving:
                    await self.engine.resume_generation()
        finally:
            self._lock.release()
        return True

    async def _expire(self, refit_id: str) -> None:
        await asyncio.sleep(self.settings.hold_limit_s)
        await self.release(refit_id, f"no commit within --hold-limit-s {self.settings.hold_limit_s:g}")

    @staticmethod
    def _stop_watchdog(hold: _Hold) -> None:
        if hold.watchdog is not None and hold.watchdog is not asyncio.current_task():
            hold.watchdog.cancel()

    async def _commit_held(self, version: str, refit_id: str, deadline: float | None) -> RefitState:
        """End the held lifecycle of `refit_id`: every layer arrived (checked by the workers),
        finish, resume. Failures leave generation refused, as in `release`."""
        hold = self._held
        if hold is None or not refit_id or hold.refit_id != refit_id:
            metrics.REFITS.labels("refused").inc()
            error = f"version {version}: refit {refit_id or '(none)'} holds no in-place install" + (
                f" (refit {hold.refit_id} does)" if hold else ""
            )
            await self._report(refit_id, version, ok=False, error=error)
            raise RefitRefused(error)
        self._held = None
        self._stop_watchdog(hold)
        try:
            update = asyncio.ensure_future(self._end_update(version))
            try:
                await self._within(deadline, update, version)
            except DeadlineExceeded:
                metrics.REFITS.labels("timeout").inc()
                raise
            except Exception as e:
                log.exception("in-place install of version %s failed; refusing generation", version)
                self._refuse_generation()
                await self.engine.collective_rpc("ws_release")
                await self.engine.collective_rpc("ws_recover")
                metrics.REFITS.labels("failed").inc()
                await self._report(refit_id, version, ok=False, error=f"{type(e).__name__}: {e}")
                raise
            await self._went_live(version, hold.since)
            metrics.REFITS.labels("committed").inc()
            await self._report(refit_id, version, ok=True)
            return self.state
        finally:
            self._lock.release()

    async def _within(self, deadline: float | None, update: asyncio.Future, version: str) -> None:
        """Wait for `update` until `deadline`. Past it, refuse generation, let the update finish in
        the background without ever making `version` live, and raise DeadlineExceeded."""
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            await asyncio.wait_for(asyncio.shield(update), remaining)
        except TimeoutError:
            self._refuse_generation()
            self._late_update = asyncio.ensure_future(self._settle_late_update(update, version))
            raise DeadlineExceeded(
                f"version {version} was not installed before the commit deadline; "
                "generation is refused until a complete refit succeeds"
            ) from None

    async def _end_update(self, version: str) -> None:
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await self.engine.finish_weight_update(weight_version=version)
        await self.engine.reset_prefix_cache()

    async def _record_install(self, version: str, held_s: float) -> None:
        """Keep what the workers' install did (`GET /v1/install`), count loader fallbacks."""
        reports = [r for r in await self.engine.collective_rpc("ws_last_install") if r]
        fallback = [p for r in reports for p in r["fallback_params"]]
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
            copy_seconds=round(max((r["copy_s"] for r in reports), default=0.0), 6),
            process_seconds=round(max((r["process_s"] for r in reports), default=0.0), 6),
            params_copied=sum(r["params_copied"] for r in reports),
            bytes_copied=sum(r["bytes_copied"] for r in reports),
            fallback_params=fallback,
            extra_bytes=max((r["receive_buffer_bytes"] + r["peak_open_bytes"] for r in reports), default=0),
            bucket_bytes=max((r["bucket_bytes"] for r in reports), default=0),
        )

    async def _settle_late_update(self, update: asyncio.Future, version: str) -> None:
        """Wait for an update that missed its deadline (`_exclusive` makes everything else that
        touches staging or the engine wait for this). Whatever it did, `version` never goes live:
        syncd was told it failed."""
        try:
            await update
            log.warning("version %s finished installing after its deadline; not serving it", version)
        except _Untouched:
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

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """One staging writer or update at a time, and none while a late update still runs."""
        async with self._lock:
            if self._late_update is not None:
                await self._late_update
                self._late_update = None
            yield

    def _refuse_generation(self) -> None:
        self.serving = False
        metrics.SERVING.set(0)

    async def _report(self, refit_id: str, version: str, *, ok: bool, error: str = "") -> None:
        if refit_id:
            await self.engine.collective_rpc("ws_committed", args=(refit_id, version, ok, error))

    @staticmethod
    def _set_version_metric(version: str) -> None:
        if (trainer_version := version_of_label(version)) is not None:
            metrics.WEIGHT_VERSION.set(trainer_version)
