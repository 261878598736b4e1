"""Model arguments of the Qwen3-MoE architecture, parsed from (and written to) an HF config.json.

Only the subset the trainer implements is accepted: every layer is MoE, untied embeddings, no
sliding window, default RoPE. Anything else is refused with a ValueError naming the field, so a
checkpoint never silently trains under the wrong architecture.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from syncd.plan.fp8_blocks import BLOCK

MODEL_TYPE = "qwen3_moe"
# The blockwise-FP8 export (`--export-dtype fp8`, the DeepSeek-V3 / Qwen3-FP8 checkpoint format):
# the projection weights that `syncd.plan.fp8_blocks.is_quantized` names are stored as e4m3 with
# float32 scales per block, every other tensor in FP8_UNQUANTIZED_DTYPE, which torch_dtype names.
FP8_EXPORT = "fp8"
FP8_UNQUANTIZED_DTYPE = "bfloat16"


def fp8_quantization_config() -> dict[str, Any]:
    """config.json's `quantization_config` of a FP8_EXPORT checkpoint (a fresh dict)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }


def unquantized_dtype(export_dtype: str) -> str:
    """The dtype an export in `export_dtype` stores its unquantized tensors in (all of them unless
    it is FP8_EXPORT): config.json's torch_dtype."""
    return FP8_UNQUANTIZED_DTYPE if export_dtype == FP8_EXPORT else export_dtype


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelArgs:
        """Parse an HF config dict; raise ValueError for values this trainer does not implement."""
        _check_supported(cfg)
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        assert num_experts is not None  # _check_supported refused a config without it
        heads = cfg["num_attention_heads"]
        return ModelArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )

    @staticmethod
    def from_file(path: str | Path) -> ModelArgs:
        return ModelArgs.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config.json dict that transformers and vLLM load as Qwen3MoeForCausalLM, for
        weights stored in `dtype` (a dtype name, or FP8_EXPORT)."""
        d = asdict(self)
        rope_theta = d.pop("rope_theta")
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type=MODEL_TYPE,
            hidden_act="silu",
            intermediate_size=4 * self.hidden_size,  # unused: no dense MLP layers (kept for loaders)
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            sliding_window=None,
            rope_theta=rope_theta,
            rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
            rope_scaling=None,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
            torch_dtype=unquantized_dtype(dtype),
            use_cache=True,
        )
        if dtype == FP8_EXPORT:
            d["quantization_config"] = fp8_quantization_config()
        return dict(sorted(d.items()))


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", cfg.get("rope_theta", 10000.0))


def _check_supported(cfg: dict[str, Any]) -> None:
    def refuse(field: str, expected: str) -> None:
        raise ValueError(f"unsupported config {field}={cfg.get(field)!r}: trainer_svc needs {expected}")

    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        refuse("model_type", MODEL_TYPE)
    if cfg.get("quantization_config"):
        # Loading reads each tensor as float32; FP8 values without their scales would be wrong.
        refuse("quantization_config", "an unquantized checkpoint (no quantization_config)")
    if cfg.get("num_experts", cfg.get("num_local_experts")) is None:
        refuse("num_experts", "a positive number of routed experts")
    if cfg.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", "1 (every layer MoE)")
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers", "[] (every layer MoE)")
    if cfg.get("tie_word_embeddings", False):
        refuse("tie_word_embeddings", "false")
    if cfg.get("use_sliding_window", False):
        refuse("use_sliding_window", "false")
    if cfg.get("attention_bias", False):
        refuse("attention_bias", "false")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "silu")
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        refuse("rope_parameters", "default RoPE without scaling")
