"""HF safetensors <-> this rank's parameter shards.

Canonical tensors (docs/CONVENTIONS.md) are the HF tensors with routed experts grouped per layer
(`...mlp.experts.gate_proj.weight [E, I, H]`); `syncd.layout.hf_names` converts to the per-expert
HF spelling on disk. Shards are cut and gathered here with plain tensor ops, executing
`sharding.PLAN`, which catalog.py executes as syncd layout expressions; tests comparing the two
catch an executor that misreads the table.

Local parameter names equal canonical names except the fused experts:
`model.layers.L.mlp.experts.gate_up_proj` ([E_l*2*I_l, H], from gate_proj and up_proj) and
`model.layers.L.mlp.experts.down_proj` ([E_l, H, I_l], from down_proj.weight).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from syncd.layout import Shard, hf_names
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane.fp8 import quantize_blockwise
from syncd.plan.fp8_blocks import FP8_DTYPE, SCALE_DTYPE, is_quantized, scale_name, scale_shape
from trainer_svc import comm
from trainer_svc.config import FP8_EXPORT, FP8_UNQUANTIZED_DTYPE, ModelArgs, unquantized_dtype
from trainer_svc.parallel_dims import Coords, Mesh, ParallelDims
from trainer_svc.sharding import local_shape, on_mesh, sharding_of, sources

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def canonical_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the model, in a fixed order (the order random init draws in)."""
    H, D, E, I = args.hidden_size, args.head_dim, args.num_experts, args.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, H)}
    for layer in range(args.num_hidden_layers):
        p = f"model.layers.{layer}"
        out.update(
            {
                f"{p}.input_layernorm.weight": (H,),
                f"{p}.self_attn.q_proj.weight": (args.num_attention_heads * D, H),
                f"{p}.self_attn.k_proj.weight": (args.num_key_value_heads * D, H),
                f"{p}.self_attn.v_proj.weight": (args.num_key_value_heads * D, H),
                f"{p}.self_attn.o_proj.weight": (H, args.num_attention_heads * D),
                f"{p}.self_attn.q_norm.weight": (D,),
                f"{p}.self_attn.k_norm.weight": (D,),
                f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.mlp.gate.weight": (E, H),
                hf_names.grouped_expert_name(f"{p}.mlp", "gate_proj"): (E, I, H),
                hf_names.grouped_expert_name(f"{p}.mlp", "up_proj"): (E, I, H),
                hf_names.grouped_expert_name(f"{p}.mlp", "down_proj"): (E, H, I),
            }
        )
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (args.vocab_size, H)
    return out


def random_canonical(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random init of the full model (norms 1, others N(0, initializer_range)),
    independent of the parallel layout because it is drawn whole on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in canonical_shapes(args).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * args.initializer_range
    return out


def load_hf(model_dir: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(args, canonical float32 tensors) from an HF directory with config.json + model.safetensors."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_file(model_dir / CONFIG_FILE)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}")
    items = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            items += [(k, f.get_tensor(k).to(torch.float32)) for k in f.keys()]  # noqa: SIM118 - safe_open is not iterable
    canonical = hf_names.group_from_hf(items, lambda parts: torch.stack(list(parts)))
    expected = canonical_shapes(args)
    for name, shape in expected.items():
        if name not in canonical:
            raise ValueError(f"{model_dir}: tensor {name} missing from the checkpoint")
        if tuple(canonical[name].shape) != shape:
            raise ValueError(
                f"{model_dir}: {name} has shape {tuple(canonical[name].shape)}, expected {shape}"
            )
    return args, {k: canonical[k] for k in expected}


def stored_entries(
    hf_name: str, shape: tuple[int, ...], dtype: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor that an export in `dtype` (a dtype name, or
    FP8_EXPORT) stores for HF tensor `hf_name` of `shape`: the tensor, and under FP8_EXPORT the
    block scales of a quantized one."""
    if dtype == FP8_EXPORT and is_quantized(hf_name):
        return [(hf_name, FP8_DTYPE, shape), (scale_name(hf_name), SCALE_DTYPE, scale_shape(shape))]
    return [(hf_name, unquantized_dtype(dtype), shape)]


def stored_tensors(hf_name: str, t: torch.Tensor, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """The CPU tensors named as `stored_entries` lists them, from HF tensor `hf_name`'s value `t`:
    cast (rounded to nearest even where narrower), or quantized blockwise."""
    if dtype == FP8_EXPORT and is_quantized(hf_name):
        # Quantized from the bfloat16 value, as the FP8 checkpoints are derived from the bf16 weights
        # the model computes with; from float32 masters a block could round to other e4m3 values.
        fp8, scale_inv = quantize_blockwise(t.detach().to(torch_dtype(FP8_UNQUANTIZED_DTYPE)))
        return [(hf_name, fp8.cpu()), (scale_name(hf_name), scale_inv.cpu())]
    return [(hf_name, t.detach().to("cpu", torch_dtype(unquantized_dtype(dtype))).contiguous())]


def save_hf(
    out_dir: str | Path, args: ModelArgs, canonical: dict[str, torch.Tensor], dtype: str = "float32"
) -> Path:
    """Write config.json + model.safetensors with per-expert HF names, in `dtype` (a dtype name,
    or FP8_EXPORT)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in canonical.items():
        for hf_name, part in hf_names.split_to_hf(name, t, args.num_experts):
            tensors.update(stored_tensors(hf_name, part, dtype))
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(args.to_hf(dtype), indent=2) + "\n")
    return out_dir


def shard_for_rank(
    name: str, canonical: dict[str, torch.Tensor], dims: ParallelDims, c: Coords
) -> torch.Tensor:
    """The value of local parameter `name` on the rank at `c`, cut from canonical tensors."""
    parts = []
    for source in sources(name):
        t = canonical[source]
        for p, size, coord in zip(sharding_of(name).placements, on_mesh(dims), on_mesh(c)):
            if isinstance(p, Shard):
                t = t.chunk(size, p.dim)[coord]
        parts.append(t)
    if len(parts) == 1:
        return parts[0].clone()
    stacked = torch.stack(parts, dim=1)
    return stacked.reshape(-1, stacked.shape[-1]).clone()


@torch.no_grad()
def load_into(
    model: torch.nn.Module, canonical: dict[str, torch.Tensor], dims: ParallelDims, c: Coords
) -> None:
    for name, p in model.named_parameters():
        p.copy_(shard_for_rank(name, canonical, dims, c))


def tp_whole(
    name: str, p: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], mesh: Mesh
) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, value) of every source of local parameter `name`, gathered over tp but still
    this rank's ep shard (collective over the tp group when `name` is cut over tp)."""
    sharding, names = sharding_of(name), sources(name)
    t = p.detach().view(local_shape(name, shapes, mesh.dims))
    tp_dim = sharding.tp_dim
    if tp_dim is not None:
        if len(names) > 1 and tp_dim >= 1:
            tp_dim += 1  # fused sources are stacked on dim 1
        t = torch.cat(_gather(t, mesh.tp), tp_dim)
    return list(zip(names, t.unbind(1))) if len(names) > 1 else [(names[0], t)]


@torch.no_grad()
def gather_canonical(
    weights: Mapping[str, torch.Tensor], mesh: Mesh, args: ModelArgs
) -> dict[str, torch.Tensor]:
    """Collective over the whole world: rank 0 gets every canonical tensor of `weights` (each
    rank's stage parameters by name), others get {}.
    Shards are all-gathered over tp, then over ep; one rank per stage (dp = ep = tp = 0) then ships
    its stage's tensors to rank 0."""
    shapes = canonical_shapes(args)
    stage: dict[str, torch.Tensor] = {}
    for name, p in weights.items():
        ep_dim = sharding_of(name).ep_dim
        for source, t in tp_whole(name, p, shapes, mesh):
            if ep_dim is not None:
                t = torch.cat(_gather(t, mesh.ep), ep_dim)
            stage[source] = t.clone(memory_format=torch.contiguous_format)
    if mesh.dims.world_size == 1:
        return stage
    c = mesh.coords
    mine = {k: v.cpu() for k, v in stage.items()} if (c.dp, c.ep, c.tp) == (0, 0, 0) else {}
    received: list[dict] | None = [{} for _ in range(mesh.dims.world_size)] if mesh.rank == 0 else None
    dist.gather_object(mine, received, dst=0)
    if mesh.rank != 0:
        return {}
    assert received is not None  # rank 0 made it
    merged = {k: v for part in received for k, v in part.items()}
    return {k: merged[k] for k in shapes}


def _gather(t: torch.Tensor, group: comm.Group) -> list[torch.Tensor]:
    if comm.group_size(group) == 1:
        return [t.detach()]
    out = [torch.empty_like(t) for _ in range(comm.group_size(group))]
    dist.all_gather(out, t.detach().contiguous(), group=group)
    return out
