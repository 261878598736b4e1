"""A random tiny Qwen3-MoE checkpoint for generator tests (trainer_svc.tiny when it exists)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_checkpoint(out_dir: str | Path, seed: int) -> Path:
    """Write a random float32 Qwen3-MoE (HF per-expert names) to `out_dir` and return it."""
    try:
        from trainer_svc.tiny import make_tiny_checkpoint as shared
    except ImportError:
        shared = None
    if shared is not None:
        return Path(shared(out_dir, seed))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Norm weights default to ones; randomize them so a missed norm shows in the outputs.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.05)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out
