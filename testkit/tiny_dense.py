"""A tiny random dense Qwen3 checkpoint (`Qwen3ForCausalLM`) and PEFT-format LoRA adapters for it,
for tests of adapter slots: vLLM on CPU serves LoRA on dense models only (with `enable_lora` its
MoE layers take Triton kernels, which have no CPU backend).

    model = make_tiny_dense(dir, seed=0)                 # config.json + model.safetensors
    adapter = random_adapter(model, rank=8, seed=1)      # PEFT names -> float32 A and B
    write_peft_adapter(dir, adapter, rank=8, alpha=16)   # adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections
PEFT_PREFIX = "base_model.model."


def _shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    H, D, V, I = c["hidden_size"], c["head_dim"], c["vocab_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out |= {
            f"{p}.input_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (q, H),
            f"{p}.self_attn.k_proj.weight": (kv, H),
            f"{p}.self_attn.v_proj.weight": (kv, H),
            f"{p}.self_attn.o_proj.weight": (H, q),
            f"{p}.self_attn.q_norm.weight": (D,),
            f"{p}.self_attn.k_norm.weight": (D,),
            f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.mlp.gate_proj.weight": (I, H),
            f"{p}.mlp.up_proj.weight": (I, H),
            f"{p}.mlp.down_proj.weight": (H, I),
        }
    return out | {"model.norm.weight": (H,), "lm_head.weight": (V, H)}


def make_tiny_dense(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors (float32, seeded) to `out_dir`; return it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.05
        for name, shape in _shapes().items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return out


def adapter_shapes(rank: int) -> dict[str, tuple[int, ...]]:
    """Canonical adapter tensor names (`...q_proj.lora_A.weight [r, in]`, `lora_B [out, r]`)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in _shapes().items():
        if name.split(".")[-2] in TARGETS:
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = (rank, shape[1])
            out[f"{stem}.lora_B.weight"] = (shape[0], rank)
    return out


def random_adapter(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """An adapter whose every factor is random (B too: its effect shows from the start)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in adapter_shapes(rank).items()}


def write_peft_adapter(
    out_dir: str | Path, adapter: dict[str, torch.Tensor], rank: int, alpha: float
) -> Path:
    """The PEFT format vLLM loads (`adapter_config.json` + `adapter_model.safetensors`)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {PEFT_PREFIX + n: t.contiguous() for n, t in adapter.items()}, str(out / "adapter_model.safetensors")
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(TARGETS),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
