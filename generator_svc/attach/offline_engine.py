"""vLLM's offline `LLM` seen as the async engine client that generator_svc's refit lifecycle drives.

`generator_svc.server.update_lifecycle.UpdateLifecycle` (pause, install by parameter, prefix-cache reset,
resume, weight version) awaits an `AsyncLLM`'s methods. An `LLM` has the same methods, blocking;
`OfflineEngineClient` runs each in a thread of the lifecycle's event loop, so that one lifecycle drives
both (`generator_svc.attach`).

Why this is safe while the `LLM`'s owner generates in its own thread: every call here is a
utility call to the engine core process, which runs it between two engine steps, and the refit
pauses the engine core's scheduler first (`pause_scheduler`: the owner's `generate` then waits
for its outputs, its requests queued or finishing by the pause mode) and resumes it last. The
client's sends are serialized (`vllm_adapter.serialize_sends`): its socket is not thread-safe.
"""

from __future__ import annotations

import asyncio
from typing import Any

from generator_svc.vllm_adapter import (
    WeightTransferUpdateRequest,
    pause_scheduler_sync,
    resume_scheduler_sync,
    serialize_sends,
)


class _EngineCore:
    """The scheduler controls `vllm_adapter.pause_scheduler` and `resume_generation` use."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def pause_scheduler_async(self, mode: str, clear_cache: bool = False) -> None:
        assert not clear_cache, "the lifecycle resets the prefix cache itself, after the install"
        await asyncio.to_thread(pause_scheduler_sync, self._client, mode)

    async def resume_scheduler_async(self) -> None:
        await asyncio.to_thread(resume_scheduler_sync, self._client)


class OfflineEngineClient:
    """An `LLM` (whose engine core runs in its own process, `client`) with `AsyncLLM`'s methods."""

    def __init__(self, llm: Any, client: Any) -> None:
        self.llm = llm
        serialize_sends(client)
        self.engine_core = _EngineCore(client)

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return await asyncio.to_thread(self.llm.collective_rpc, method, timeout, args, kwargs)

    async def start_weight_update(self) -> None:
        await asyncio.to_thread(self.llm.start_weight_update)

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        await asyncio.to_thread(self.llm.update_weights, request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await asyncio.to_thread(self.llm.finish_weight_update, weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await asyncio.to_thread(self.llm.update_weight_version, new_version)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await asyncio.to_thread(self.llm.reset_prefix_cache, reset_running_requests)

    async def resume_generation(self) -> None:
        await self.engine_core.resume_scheduler_async()
