"""The named LoRA adapters a generator serves from slots, their versions, and their install at
syncd's commit (`generator_svc.server.adapter_routes` relays it; `generator_svc.worker.adapter_endpoint`
stages it in the worker).

An install writes the staged adapter into its slot on the engine's thread (`ws_install_adapter`,
between engine steps), resets the prefix cache (its keys name the adapter's LoRA id, which stays
the same from version to version), and only then serves the adapter under its name at its new
version: `model: "<name>"` in a completion picks it (vLLM's OpenAI server resolves the name to
its `LoRARequest`).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from generator_svc.vllm_adapter import new_lora_id, serve_lora
from syncd.weight_version import WeightVersionJson, version_label


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    version: str  # the label of the adapter's weight version, as syncd committed it
    lora_id: int  # vLLM's id of the adapter (its LoRARequest's), the same for every version
    slot: int


class ServedAdapters:
    """The adapters this generator serves from slots, by name. Written by one install at a time
    (syncd runs one refit at a time); read by every response."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}

    def version(self, name: str) -> str | None:
        with self._lock:
            served = self._by_name.get(name)
        return served.version if served is not None else None

    def all(self) -> list[ServedAdapter]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.name)

    async def digests(self, engine: Any) -> dict[str, str]:
        """By name, a digest of what each served adapter's slot holds on the tp-0 worker."""
        return {
            a.name: (await engine.collective_rpc("ws_adapter_digest", args=(a.lora_id,)))[0]
            for a in self.all()
        }

    async def install(self, engine: Any, models: Any, body: AdapterCommit) -> ServedAdapter:
        """Write the staged adapter into its slot on every worker, then serve it under its name."""
        current = self._by_name.get(body.adapter)
        lora_id = current.lora_id if current is not None else new_lora_id(models)
        replies = await asyncio.wait_for(
            engine.collective_rpc("ws_install_adapter", args=(body.refit_id, lora_id)), body.timeout_s
        )
        await engine.reset_prefix_cache(reset_running_requests=True)
        served = ServedAdapter(body.adapter, version_label(body.version), lora_id, int(replies[0]["slot"]))
        with self._lock:
            self._by_name[body.adapter] = served
        serve_lora(models, body.adapter, lora_id)
        return served


class AdapterCommit(BaseModel):
    refit_id: str
    adapter: str
    version: WeightVersionJson
    timeout_s: float = Field(gt=0, description="syncd's commit deadline, less the answer's margin")
