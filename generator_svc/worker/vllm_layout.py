"""Read `ParamSpec`s off a live vLLM model: the bridge from vLLM's modules to the pure builder.

The layer classes come from `generator_svc.vllm_adapter`, which also declares (and its test checks)
every attribute read here (`ATTRIBUTES`).

Every parameter is classified by the vLLM layer that owns it, and its layout is derived from that
layer's own attributes (tp rank/size, partition sizes, head counts, vocab shard indices), never from
hard-coded shapes or from the visible Parameter shape (on CPU linear weights are repacked into
`cpu_linear` and the visible Parameter is empty). A parameter no rule covers raises ValueError
naming it, before anything registers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from generator_svc.worker.catalog import (
    TP,
    ExpertsParam,
    MergedParam,
    ParamSpec,
    QKVParam,
    ReplicatedParam,
    ShardedParam,
    VocabParam,
)

if TYPE_CHECKING:  # for annotations only: this module imports vLLM inside its functions
    pass

# Layers whose parameters are whole on every rank and loaded as-is from one canonical tensor.
_REPLICATED_LAYER_NAMES = ("RMSNorm", "LayerNorm", "GemmaRMSNorm")


LORA_BASE_LAYER = ".base_layer"  # the linear a LoRA layer of vLLM wraps (`enable_lora`)


def _dtype(t: torch.Tensor | torch.dtype) -> str:
    return str(t if isinstance(t, torch.dtype) else t.dtype).removeprefix("torch.")


def _packed_names(model: torch.nn.Module, module_path: str) -> list[str]:
    """Canonical names of a fused linear (`...qkv_proj` -> `...q_proj.weight`, ...)."""
    parent, _, leaf = module_path.rpartition(".")
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    if leaf not in mapping:
        raise ValueError(
            f"{module_path}.weight: fused layer {leaf!r} is not in the model's packed_modules_mapping"
        )
    return [f"{parent}.{sub}.weight" for sub in mapping[leaf]]


def _linear_spec(model: torch.nn.Module, path: str, module: Any, dtype: str) -> ParamSpec:
    # `module` is one of vLLM's LinearBase layers (its classes come from the adapter, lazily).
    from generator_svc.vllm_adapter import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    name = f"{path}.weight"
    # With LoRA on, vLLM wraps each adapted linear: its weight is `<layer>.base_layer.weight`, and
    # the HF names are the layer's.
    layer = path.removesuffix(LORA_BASE_LAYER)
    tp = TP(module.tp_size, module.tp_rank)
    if isinstance(module, QKVParallelLinear):
        q, k, v = _packed_names(model, layer)
        if getattr(module, "v_head_size", module.head_size) != module.head_size:
            raise ValueError(f"{name}: v head size differs from q/k head size; not supported")
        return QKVParam(
            name,
            dtype,
            q,
            k,
            v,
            module.input_size,
            module.head_size,
            module.total_num_heads,
            module.total_num_kv_heads,
            tp,
        )
    if isinstance(module, MergedColumnParallelLinear):
        names = _packed_names(model, layer)
        if len(names) != len(module.output_sizes):
            raise ValueError(f"{name}: {len(names)} packed names for {len(module.output_sizes)} outputs")
        parts = tuple((n, (size, module.input_size)) for n, size in zip(names, module.output_sizes))
        return MergedParam(name, dtype, parts, tp)
    hf_name = f"{layer}.weight"
    if isinstance(module, ColumnParallelLinear):
        return ShardedParam(name, dtype, hf_name, (module.output_size, module.input_size), 0, tp)
    if isinstance(module, RowParallelLinear):
        return ShardedParam(name, dtype, hf_name, (module.output_size, module.input_size), 1, tp)
    if isinstance(module, ReplicatedLinear):
        return ReplicatedParam(name, dtype, hf_name, (module.output_size, module.input_size))
    raise ValueError(f"{name}: no layout rule for linear layer {type(module).__name__}")


def _module_specs(model: torch.nn.Module, path: str, module: torch.nn.Module) -> list[ParamSpec]:
    from generator_svc.vllm_adapter import LinearBase, RoutedExperts, VocabParallelEmbedding

    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, RoutedExperts):
        cfg = module.moe_config
        first = _local_experts_start(path, module)
        tp = TP(cfg.tp_size, cfg.tp_rank)
        # The loader receives HF names relative to the runner that owns `routed_experts`.
        prefix = path.rpartition(".")[0] if path.endswith(".routed_experts") else path
        total_i = cfg.intermediate_size_per_partition * cfg.tp_size
        common = {
            "prefix": prefix,
            "num_experts": module.global_num_experts,
            "intermediate": total_i,
            "hidden": cfg.hidden_dim,
            "tp": tp,
            "local_experts": (first, module.local_num_experts),
        }
        out: list[ParamSpec] = []
        for pname, p in params.items():
            kind = pname.removesuffix("_weight")
            if kind not in ("w13", "w2"):
                raise ValueError(f"{path}.{pname}: no layout rule for this MoE parameter")
            out.append(ExpertsParam(f"{path}.{pname}", _dtype(p), kind, **common))
        return out
    if isinstance(module, VocabParallelEmbedding):
        if set(params) != {"weight"}:
            raise ValueError(f"{path}: unexpected parameters {sorted(params)} on a vocab-parallel layer")
        idx = module.shard_indices
        return [
            VocabParam(
                f"{path}.weight",
                _dtype(params["weight"]),
                f"{path}.weight",
                (module.org_vocab_size, module.embedding_dim),
                idx.org_vocab_start_index,
                idx.org_vocab_end_index,
            )
        ]
    if isinstance(module, LinearBase):
        if set(params) != {"weight"}:
            raise ValueError(f"{path}: parameters {sorted(set(params) - {'weight'})} have no layout rule")
        return [_linear_spec(model, path, module, _dtype(params["weight"]))]
    if type(module).__name__ in _REPLICATED_LAYER_NAMES:
        return [
            ReplicatedParam(f"{path}.{n}", _dtype(p), f"{path}.{n}", tuple(p.shape))
            for n, p in params.items()
        ]
    name = f"{path}.{next(iter(params))}"
    raise ValueError(f"parameter {name}: no layout rule for layer type {type(module).__name__}")


def _local_experts_start(path: str, module) -> int:
    """The first global expert this rank holds. Without expert parallelism that is 0 (all held);
    with it, vLLM's `expert_map` (global id -> local index, -1 elsewhere) must place a contiguous
    range in order (vLLM's default "linear" placement); other placements are refused by name."""
    local, total = module.local_num_experts, module.global_num_experts
    if local == total:
        return 0
    expert_map = module.expert_map
    if expert_map is None:
        raise ValueError(f"{path}: {local} of {total} experts local but no expert_map")
    mapping = [int(x) for x in expert_map.tolist()]
    held = [e for e, i in enumerate(mapping) if i >= 0]
    first = held[0] if held else 0
    if held != list(range(first, first + local)) or [mapping[e] for e in held] != list(range(local)):
        raise ValueError(
            f"{path}: expert placement {mapping} is not a contiguous range in order (vLLM's "
            "'linear' placement); only that placement is supported"
        )
    return first


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """One spec per vLLM parameter, in `model.named_parameters()` order."""
    specs: list[ParamSpec] = []
    for path, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            specs.extend(_module_specs(model, path, module))
    names = {n for n, _ in model.named_parameters()}
    covered = {s.name for s in specs}
    if names != covered:
        raise ValueError(f"parameters without a layout: {sorted(names - covered)}")
    return specs


def allocated_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint-format shapes vLLM allocated, from the layerwise-reload metadata vLLM records at
    load (before kernels repack the tensors). Empty when vLLM recorded none."""
    from generator_svc.vllm_adapter import recorded_checkpoint_shapes

    out: dict[str, tuple[int, ...]] = {}
    for path, module in model.named_modules():
        for pname, shape in (recorded_checkpoint_shapes(module) or {}).items():
            out[f"{path}.{pname}" if path else pname] = shape
    return out
