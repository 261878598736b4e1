"""The engine-level update lifecycle, run in the API-server process.

`Refitter.apply(version)` is the only way weights change while serving:

1. check (no engine change): every worker's staging holds a complete version, else ValueError;
2. `pause_generation(mode="wait")`: running requests finish on the committed weights, new ones are
   held (queued, not failed) until step 5 - generation waits for at most the update phase;
3. `start_weight_update` / `update_weights` / `finish_weight_update` on every worker (vLLM's
   lifecycle: layerwise reload from staging, vLLM's loaders and post-processing, CPU MoE fix);
4. `reset_prefix_cache` (KV computed with the old weights must not be reused);
5. `resume_generation`.

A refit that fails before step 3 (bad shape, missing tensor, interrupted transfer) never touches
the engine: it keeps serving the committed version. If step 3 itself fails, the workers restore
real tensors (`ws_recover`) but the weights may be torn: the generator then refuses generation
(HTTP 503) and keeps held requests held until the next complete refit succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from generator_svc import metrics
from generator_svc.settings import Settings

log = logging.getLogger("generator_svc.refit")


class RefitRefused(ValueError):
    """The staged weights are not a complete version; nothing changed."""


@dataclass(frozen=True)
class RefitState:
    version: str
    serving: bool
    updating: bool


class Refitter:
    def __init__(self, engine, settings: Settings) -> None:  # noqa: ANN001 (vLLM EngineClient)
        self.engine = engine
        self.settings = settings
        self.version = settings.initial_version
        self.serving = True
        self._lock = asyncio.Lock()
        self.workers: list[dict] = []

    @property
    def state(self) -> RefitState:
        return RefitState(self.version, self.serving, self._lock.locked())

    async def setup(self, commit_url: str) -> list[dict]:
        """Catalog, staging and syncd registration on every worker."""
        self.workers = await self.engine.collective_rpc(
            "ws_setup", kwargs={"replica": self.settings.replica, "syncd": self.settings.syncd,
                                "auth_token": self.settings.auth_token, "commit_url": commit_url,
                                "data_host": self.settings.data_host,
                                "in_flight": self.settings.in_flight_buckets})
        await self.engine.update_weight_version(self.version)
        metrics.CATALOG_BYTES.set(sum(w["nbytes"] for w in self.workers))
        metrics.SERVING.set(1)
        self._set_version_metric(self.version)
        return self.workers

    async def stage_file(self, path: str, refit_id: str) -> list[dict]:
        """Stage a safetensors checkpoint on every worker (staging only; serving goes on)."""
        start = time.perf_counter()
        async with self._lock:  # never rewrite staging while an apply reads it
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
        async with self._lock:
            await self.engine.collective_rpc("ws_abort", args=(refit_id,))

    async def apply(self, version: str, refit_id: str = "") -> RefitState:
        async with self._lock:
            try:
                await self._apply_locked(version)
            except RefitRefused as e:
                metrics.REFITS.labels("refused").inc()
                await self._report(refit_id, version, ok=False, error=str(e))
                raise
            except Exception as e:
                metrics.REFITS.labels("failed").inc()
                await self._report(refit_id, version, ok=False, error=f"{type(e).__name__}: {e}")
                raise
            metrics.REFITS.labels("committed").inc()
            await self._report(refit_id, version, ok=True)
            return self.state

    async def _apply_locked(self, version: str) -> None:
        status = await self.engine.collective_rpc("ws_status")
        problems = [f"{w['member_id']}: " + (", ".join(w["missing"]) if w["refit_id"] else "nothing staged")
                    for w in status if w["missing"] or not w["refit_id"]]
        if problems:
            raise RefitRefused(f"version {version} is not completely staged: {'; '.join(problems)}")
        start = time.perf_counter()
        await self.engine.pause_generation(mode="wait", clear_cache=False)
        try:
            await self.engine.start_weight_update()
            try:
                await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
                await self.engine.finish_weight_update(weight_version=version)
            except Exception:
                log.exception("update to version %s failed inside the lifecycle; refusing generation", version)
                self.serving = False
                metrics.SERVING.set(0)
                await self.engine.collective_rpc("ws_recover")
                raise
            await self.engine.reset_prefix_cache()
            self.version, self.serving = version, True
            metrics.SERVING.set(1)
            self._set_version_metric(version)
        finally:
            if self.serving:
                await self.engine.resume_generation()
                metrics.APPLY_SECONDS.observe(time.perf_counter() - start)

    async def _report(self, refit_id: str, version: str, *, ok: bool, error: str = "") -> None:
        if refit_id:
            await self.engine.collective_rpc("ws_committed", args=(refit_id, version, ok, error))

    @staticmethod
    def _set_version_metric(version: str) -> None:
        try:
            metrics.WEIGHT_VERSION.set(float(version))
        except ValueError:
            pass
