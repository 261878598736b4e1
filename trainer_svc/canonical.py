"""The model's canonical tensors (docs/CONVENTIONS.md): every HF tensor of a Qwen3-MoE by name and
shape, with routed experts grouped per layer (`...mlp.experts.gate_proj.weight [E, I, H]`;
`syncd.layout.hf_names` converts to the per-expert HF spelling on disk), and a deterministic
random init of them.
"""

from __future__ import annotations

import torch

from syncd.layout import hf_names
from trainer_svc.config import ModelArgs


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
