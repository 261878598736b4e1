"""A tiny random Qwen3-MoE checkpoint for tests and demos (no transformers needed, no side effects).

from trainer_svc.tiny import make_tiny_checkpoint
path = make_tiny_checkpoint(tmp_dir, seed=0)   # config.json + model.safetensors, HF names
"""

from __future__ import annotations

from pathlib import Path

from trainer_svc.config import ModelArgs

TINY_ARGS = ModelArgs(
    vocab_size=512,
    hidden_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
)


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, args: ModelArgs = TINY_ARGS) -> Path:
    """Write a random float32 checkpoint (config.json + model.safetensors) to `out_dir`; return it.
    Same seed, same bytes. Loads unchanged in transformers' Qwen3MoeForCausalLM and in vLLM."""
    from trainer_svc.canonical import random_canonical
    from trainer_svc.hf_checkpoint import save_hf

    return save_hf(out_dir, args, random_canonical(args, seed))
