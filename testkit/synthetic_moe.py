"""A synthetic Qwen3-MoE-shaped model for tests and benchmarks: canonical tensors, an expert-TP trainer
layout and vLLM's layout, built with the layout language (no model code, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from syncd.layout import (
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    Replicate,
    Shard,
    Sharded,
    Stack,
    local_tensor,
)
from syncd.layout.hf_names import grouped_expert_name


@dataclass(frozen=True)
class MoeShape:
    layers: int
    hidden: int
    experts: int
    moe_inter: int
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 32768
    dtype: str = "bfloat16"

    def canonical(self) -> list[CanonicalTensor]:
        d, h = self.dtype, self.hidden
        out = [CanonicalTensor("model.embed_tokens.weight", (self.vocab, h), d)]
        for L in range(self.layers):
            p = f"model.layers.{L}"
            out += [
                CanonicalTensor(f"{p}.input_layernorm.weight", (h,), d),
                CanonicalTensor(f"{p}.post_attention_layernorm.weight", (h,), d),
                CanonicalTensor(f"{p}.self_attn.q_proj.weight", (self.heads * self.head_dim, h), d),
                CanonicalTensor(f"{p}.self_attn.k_proj.weight", (self.kv_heads * self.head_dim, h), d),
                CanonicalTensor(f"{p}.self_attn.v_proj.weight", (self.kv_heads * self.head_dim, h), d),
                CanonicalTensor(f"{p}.self_attn.o_proj.weight", (h, self.heads * self.head_dim), d),
                CanonicalTensor(f"{p}.self_attn.q_norm.weight", (self.head_dim,), d),
                CanonicalTensor(f"{p}.self_attn.k_norm.weight", (self.head_dim,), d),
                CanonicalTensor(f"{p}.mlp.gate.weight", (self.experts, h), d),
                CanonicalTensor(
                    grouped_expert_name(f"{p}.mlp", "gate_proj"), (self.experts, self.moe_inter, h), d
                ),
                CanonicalTensor(
                    grouped_expert_name(f"{p}.mlp", "up_proj"), (self.experts, self.moe_inter, h), d
                ),
                CanonicalTensor(
                    grouped_expert_name(f"{p}.mlp", "down_proj"), (self.experts, h, self.moe_inter), d
                ),
            ]
        out += [
            CanonicalTensor("model.norm.weight", (h,), d),
            CanonicalTensor("lm_head.weight", (self.vocab, h), d),
        ]
        return out

    def hf_tensor_count(self) -> int:
        """How many tensors the HF checkpoint has (experts one tensor each)."""
        return len(self.canonical()) + 3 * self.layers * (self.experts - 1)


_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "embed_tokens.weight", "lm_head.weight")


def stage_of(shape: MoeShape, name: str, pp: int) -> int:
    """The pipeline stage holding a canonical tensor: contiguous layers per stage (earlier stages
    take the extra layer of an uneven split), the embedding first, the final norm and head last."""
    if not name.startswith("model.layers."):
        return 0 if name == "model.embed_tokens.weight" else pp - 1
    layer = int(name.split(".")[2])
    base, extra = divmod(shape.layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return next(stage for stage in range(pp) if layer < bounds[stage + 1])


def trainer_catalog(
    shape: MoeShape, ep: int, ep_rank: int, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0
) -> Catalog:
    """Expert TP: experts over ep, each expert's fused gate/up split over tp (registered as the
    [E_l, 2, I/tp, H] view), down_proj row-parallel, attention column/row-parallel; with pp > 1
    only the tensors of stage `pp_rank` (all canonical tensors stay declared)."""
    canon = shape.canonical()
    by_name = {c.name: c for c in canon}
    mesh, coords = (ep, tp), (ep_rank, tp_rank)
    tensors = []
    for c in canon:
        if stage_of(shape, c.name, pp) != pp_rank:
            continue
        if c.name.endswith("experts.up_proj.weight"):
            continue
        if c.name.endswith("experts.gate_proj.weight"):
            up = by_name[c.name.replace("gate_proj", "up_proj")]
            fused = Stack(1, (Canon(c.name, c.shape), Canon(up.name, up.shape)))
            expr = Sharded(fused, (Shard(0), Shard(2)), mesh, coords)
            tensors.append(local_tensor(c.name.replace("gate_proj", "gate_up_proj"), c.dtype, expr))
        elif c.name.endswith("experts.down_proj.weight"):
            tensors.append(
                local_tensor(
                    c.name, c.dtype, Sharded(Canon(c.name, c.shape), (Shard(0), Shard(2)), mesh, coords)
                )
            )
        else:
            tp_placement = (
                Shard(0)
                if c.name.endswith(_COLUMN)
                else Shard(1)
                if c.name.endswith("o_proj.weight")
                else Replicate()
            )
            tensors.append(
                local_tensor(
                    c.name,
                    c.dtype,
                    Sharded(Canon(c.name, c.shape), (Replicate(), tp_placement), mesh, coords),
                )
            )
    return Catalog(tuple(canon), tuple(tensors))


def vllm_catalog(shape: MoeShape, tp: int, tp_rank: int) -> Catalog:
    """vLLM's parameters: qkv_proj = [q; k; v] slices, w13 = per expert [gate slice; up slice],
    w2 row-parallel, vocab-parallel embedding and lm_head, replicated norms and router."""
    canon = shape.canonical()
    by_name = {c.name: c for c in canon}

    def split(c: CanonicalTensor, dim: int | None):
        return Sharded(
            Canon(c.name, c.shape), (Shard(dim) if dim is not None else Replicate(),), (tp,), (tp_rank,)
        )

    tensors = []
    for c in canon:
        n = c.name
        if n.endswith(("k_proj.weight", "v_proj.weight", "experts.up_proj.weight")):
            continue
        if n.endswith("q_proj.weight"):
            parts = tuple(split(by_name[n.replace("q_proj", x)], 0) for x in ("q_proj", "k_proj", "v_proj"))
            tensors.append(local_tensor(n.replace("q_proj", "qkv_proj"), c.dtype, Concat(0, parts)))
        elif n.endswith("experts.gate_proj.weight"):
            up = by_name[n.replace("gate_proj", "up_proj")]
            tensors.append(
                local_tensor(
                    n.replace("gate_proj.weight", "w13_weight"),
                    c.dtype,
                    Concat(1, (split(c, 1), split(up, 1))),
                )
            )
        elif n.endswith("experts.down_proj.weight"):
            tensors.append(local_tensor(n.replace("down_proj.weight", "w2_weight"), c.dtype, split(c, 2)))
        else:
            dim = 0 if n.endswith(_COLUMN) else 1 if n.endswith("o_proj.weight") else None
            tensors.append(local_tensor(n, c.dtype, split(c, dim)))
    return Catalog(tuple(canon), tuple(tensors))


def shape_for(gib: float) -> MoeShape:
    """A Qwen3-30B-A3B-like layer (128 experts, hidden 2048, expert dim 768); layers to fit `gib`."""
    base = MoeShape(layers=1, hidden=2048, experts=128, moe_inter=768, heads=32, kv_heads=4, vocab=32768)
    per_layer: float = sum(c.nbytes for c in base.canonical()) - 2 * base.vocab * base.hidden * 2
    layers = max(1, round(gib * 2**30 / per_layer))
    if gib < 1:  # CPU-sized runs: shrink the experts instead of the layer count
        base = MoeShape(
            layers=4, hidden=512, experts=32, moe_inter=256, heads=8, kv_heads=2, head_dim=64, vocab=8192
        )
        per_layer = sum(c.nbytes for c in base.canonical()) / base.layers
        layers = max(1, round(gib * 2**30 / per_layer))
    return MoeShape(**{**base.__dict__, "layers": layers})
