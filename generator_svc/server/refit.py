"""The refits of one generator, as the API server's routes see them: `Refitter`.

`Refitter.apply(version)` is the only way weights change while serving. What a refit does depends
on `--refit-mode`, chosen once at start: `generator_svc.server.refit_strategies` has one strategy per mode
(`StagedRefit`, `InplaceRefit`, their steps and failure rules); `generator_svc.server.update_lifecycle` the
engine steps and served state they share. The Refitter sets the workers up, times and counts what
the routes ask, and tells the routes what is served.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
import weakref
from typing import Any

from generator_svc.server import metrics
from generator_svc.server.refit_history import RefitHistory
from generator_svc.server.refit_strategies import RefitStrategy, strategy_for
from generator_svc.server.served_adapters import ServedAdapters
from generator_svc.server.update_lifecycle import (
    LastInstall,
    ServingState,
    UpdateLifecycle,
    set_version_metric,
)
from generator_svc.settings import Settings
from generator_svc.worker_protocol import StagedFile, WorkerInfo, WorkerSetup


class Refitter:
    def __init__(self, engine: Any, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._life = UpdateLifecycle(engine, settings)
        self._mode: RefitStrategy = strategy_for(settings.refit_mode, self._life)
        # Authenticates the workers' commit requests (`/internal/commit`); handed to them only
        # through collective_rpc, never over the network.
        self.commit_token = secrets.token_urlsafe(32)
        self.workers: list[WorkerInfo] = []
        # Where the workers publish their status (`worker_protocol.WorkerStatus`), read by the probes.
        self.status_dir = tempfile.mkdtemp(prefix="generator-workers-")
        # Removed with the Refitter or at the process's exit: every start left one in /tmp.
        weakref.finalize(self, shutil.rmtree, self.status_dir, ignore_errors=True)
        self.adapters = ServedAdapters()  # named LoRA adapters served from slots, with their versions

    @property
    def version(self) -> str:
        return self._life.version

    @property
    def serving(self) -> bool:
        return self._life.serving

    @property
    def last_install(self) -> LastInstall | None:
        return self._life.last_install

    @property
    def history(self) -> RefitHistory:
        return self._life.history

    @property
    def state(self) -> ServingState:
        return ServingState(self.version, self.serving, self._life.busy or self._mode.holding)

    async def setup(self, internal_url: str) -> list[WorkerInfo]:
        """Catalog, staging (staged mode) and syncd registration on every worker; tp rank 0 relays
        syncd's commands to `internal_url` (`/commit`, and in inplace mode `/hold`, `/release`)."""
        setup = WorkerSetup(
            replica=self.settings.replica,
            syncd=self.settings.syncd,
            auth_token=self.settings.auth_token,
            internal_url=internal_url,
            commit_token=self.commit_token,
            data_host=self.settings.data_host,
            in_flight=self.settings.in_flight_buckets,
            status_dir=self.status_dir,
            refit_mode=self.settings.refit_mode,
            hold_limit_s=self.settings.hold_limit_s,
            keep_delta_base=self.settings.inplace_delta_base,
        )
        self.workers = WorkerInfo.replies(
            await self.engine.collective_rpc("ws_setup", args=(setup.to_wire(),))
        )
        await self.engine.update_weight_version(self.version)
        metrics.CATALOG_BYTES.set(sum(w.nbytes for w in self.workers))
        metrics.SERVING.set(1)
        set_version_metric(self.version)
        return self.workers

    async def stage_file(self, path: str, refit_id: str) -> list[StagedFile]:
        """Stage a safetensors checkpoint on every worker (staging only; serving goes on). Raises
        StagingRejected when a worker rejects the file, RefitRefused in a mode without staging."""
        start = time.perf_counter()
        out = await self._mode.stage_file(path, refit_id)
        metrics.STAGE_SECONDS.observe(time.perf_counter() - start)
        metrics.STAGED_BYTES.inc(sum(w.nbytes for w in self.workers))
        return out

    async def abort(self, refit_id: str = "") -> None:
        """Drop staged bytes of `refit_id` (any when empty); serving is unaffected."""
        await self._mode.abort(refit_id)

    async def apply(self, version: str, refit_id: str = "", timeout_s: float | None = None) -> ServingState:
        """Make `version` live, within `timeout_s` when given (syncd's commit deadline, less a
        margin). Raises RefitRefused (engine untouched), DeadlineExceeded (generation refused from
        then on, see `generator_svc.server.update_lifecycle`) or the lifecycle's error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        await self._mode.apply(version, refit_id, deadline)
        return self.state

    async def hold(self, refit_id: str) -> None:
        """inplace: hold generation and open the install of `refit_id` (RefitRefused when staged)."""
        await self._mode.hold(refit_id)

    async def release(self, refit_id: str, reason: str) -> bool:
        """inplace: end the hold of `refit_id` without a commit; False when it holds nothing."""
        return await self._mode.release(refit_id, reason)
