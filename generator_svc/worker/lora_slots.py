"""Adapter slots: a named LoRA adapter's A and B written straight into vLLM's LoRA slot tensors.

No files and no `load_lora_adapter` round trip. Lifecycle per adapter id, inside one worker of an
engine started with `enable_lora`: the first `install` registers the adapter with the worker's
LoRA manager from tensors and pins it, which activates it into a slot (so it is never evicted
and keeps its slot); every later `install` writes the new factors into that slot
(`vllm_adapter.write_lora_slot`) and replaces the registered copy. `install` runs on the engine's
own thread (through `collective_rpc`, between engine steps), so no forward pass sees half an
adapter. Requests pick the adapter by its id (a `LoRARequest` whose path nothing reads: the
adapter is registered, so vLLM never loads it).

Tensors arrive in PEFT's names without its `base_model.model.` prefix
(`model.layers.L.self_attn.q_proj.lora_A.weight [r, in]`, `lora_B [out, r]`), whole (TP 1).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from generator_svc import vllm_adapter as vllm

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    """What vLLM needs to know of an adapter besides its factors (adapter_config.json's fields)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    max_position_embeddings: int | None = None

    def peft_config(self) -> dict[str, Any]:
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "vllm_max_position_embeddings": self.max_position_embeddings,
        }


@dataclass
class InstallResult:
    adapter_id: int
    slot: int
    added: bool  # first install: registered and pinned (else written into its slot)
    modules: list[str] = field(default_factory=list)


def install(
    worker: Any, adapter_id: int, tensors: dict[str, torch.Tensor], spec: AdapterSpec
) -> InstallResult:
    """Make adapter `adapter_id` hold `tensors` (module docstring); raise naming what is wrong."""
    manager = vllm.lora_model_manager(worker)
    if manager is None:
        raise RuntimeError("this engine runs without LoRA: start it with enable_lora (--enable-lora)")
    if adapter_id <= 0:
        raise ValueError(f"adapter ids are positive (vLLM's lora_int_id), got {adapter_id}")
    model = vllm.lora_model_from_tensors(
        adapter_id,
        {PEFT_PREFIX + n: t for n, t in tensors.items()},
        spec.peft_config(),
        vllm.lora_dtype(worker),
    )
    if not model.loras:
        raise ValueError(f"adapter {adapter_id}: none of {sorted(tensors)[:4]} names a LoRA factor")
    if adapter_id in manager.list_adapters():
        slot = vllm.write_lora_slot(manager, adapter_id, model)
        return InstallResult(adapter_id, slot, added=False, modules=sorted(model.loras))
    manager.add_adapter(model)
    manager.pin_adapter(adapter_id)
    return InstallResult(adapter_id, manager.lora_index_to_id.index(adapter_id), True, sorted(model.loras))


def slot_digest(worker: Any, adapter_id: int) -> str:
    """SHA-256 over adapter `adapter_id`'s slot in every linear LoRA layer (A and B, every
    slice), as the engine holds it: what a write into another adapter's slot leaves unchanged."""
    manager = vllm.lora_model_manager(worker)
    index = manager.lora_index_to_id.index(adapter_id)
    digest = hashlib.sha256()
    for name in sorted(manager.modules):
        module = manager.modules[name]
        if not isinstance(module, vllm.BaseLinearLayerWithLoRA):
            continue  # slots of other layer kinds (embeddings, the head) hold nothing of ours
        for stacked in (*module.lora_a_stacked, *module.lora_b_stacked):
            digest.update(stacked[index].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
