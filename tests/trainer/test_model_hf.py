"""The trainer's single-process forward equals transformers' Qwen3MoeForCausalLM on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer_svc.config import ModelArgs
from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.model import Qwen3MoeStage
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.shard_cut import load_into
from trainer_svc.tiny import make_tiny_checkpoint


def _trainer_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    args, canonical = load_hf(model_dir)
    model = Qwen3MoeStage(args, range(args.num_hidden_layers), first=True, last=True)
    load_into(model, canonical, ParallelDims(), Coords(0, 0, 0, 0))
    with torch.no_grad():
        return model(tokens)


def test_logits_match_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    got = _trainer_logits(tiny_dir, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_checkpoint_config_loads_in_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob
    assert cfg.head_dim == 32 and cfg.moe_intermediate_size == 64 and not cfg.tie_word_embeddings


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("decoder_sparse_step", 2, "decoder_sparse_step"),
        ("mlp_only_layers", [1], "mlp_only_layers"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("model_type", "llama", "model_type"),
    ],
)
def test_unsupported_config_is_refused(tiny_dir, field, value, match):
    cfg = json.loads((Path(tiny_dir) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf(cfg)
