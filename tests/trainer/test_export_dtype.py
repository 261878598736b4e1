"""The trainer exports the dtype a generator serves: its float32 weights rounded to nearest even,
bit for bit what a refit into that dtype installs, or blockwise FP8 (the DeepSeek-V3 / Qwen3-FP8
format), from both export paths."""

from __future__ import annotations

import json

import _launch
import pytest
import torch
from _launch import TRAIN
from safetensors.torch import load_file

from tests.fp8_reference import block_by_block
from trainer_svc.canonical import random_canonical
from trainer_svc.config import ModelArgs
from trainer_svc.hf_checkpoint import load_hf, save_hf
from trainer_svc.settings import TrainSettings
from trainer_svc.tiny import make_tiny_checkpoint

# Dims that are not multiples of 128, so that weights have partial FP8 blocks at their ends (hidden
# 200 = 128 + 72, vocab 300) next to whole ones (q_proj has 4 x 128 rows, the experts 256).
FP8_ARGS = ModelArgs(
    vocab_size=300,
    hidden_size=200,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    num_experts=4,
    num_experts_per_tok=2,
)
# What a blockwise-FP8 checkpoint quantizes: the attention and MLP projections (not the router,
# `mlp.gate.weight`, nor embeddings, norms and the head).
QUANTIZED = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


@pytest.mark.parametrize("ep", [1, 2], ids=["gathered-by-rank-0", "parallel-writers"])
def test_a_bfloat16_export_is_the_float32_export_rounded_to_nearest_even(tiny_dir, tmp_path, ep):
    exports = {}
    for dtype in ("float32", "bfloat16"):
        settings = TrainSettings(
            model_dir=tiny_dir,
            ep=ep,
            device="cpu",
            export_dir=str(tmp_path / dtype),
            export_dtype=dtype,
            **{**TRAIN, "steps": 1},
        )
        _launch.run_job(settings, tmp_path / f"run-{dtype}")
        exports[dtype] = load_file(str(tmp_path / dtype / "model.safetensors"))
        assert json.loads((tmp_path / dtype / "config.json").read_text())["torch_dtype"] == dtype
    assert exports["float32"].keys() == exports["bfloat16"].keys()
    for name, full in exports["float32"].items():
        half = exports["bfloat16"][name]
        assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16)), name


def test_an_export_dtype_the_trainer_cannot_round_to_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="--export-dtype must be one of"):
        TrainSettings(model_dir=tiny_dir, device="cpu", export_dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def fp8_source_dir(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("fp8-source"), seed=1, args=FP8_ARGS))


@pytest.mark.parametrize("ep", [1, 2], ids=["gathered-by-rank-0", "parallel-writers"])
def test_an_fp8_export_is_the_bfloat16_weights_quantized_per_128x128_block(fp8_source_dir, tmp_path, ep):
    # lr 0: the step leaves the weights as loaded, so the reference quantizes the source checkpoint.
    settings = TrainSettings(
        model_dir=fp8_source_dir,
        ep=ep,
        device="cpu",
        export_dir=str(tmp_path / "fp8"),
        export_dtype="fp8",
        **{**TRAIN, "steps": 1, "lr": 0.0},
    )
    _launch.run_job(settings, tmp_path / "run")
    source = load_file(f"{fp8_source_dir}/model.safetensors")
    exported = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    quantized = [name for name in source if name.endswith(QUANTIZED)]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv" in exported
    assert sorted(exported) == sorted([*source, *(f"{name}_scale_inv" for name in quantized)])
    for name, weight in source.items():
        if name in quantized:
            values, scales = block_by_block(weight.to(torch.bfloat16))  # the bf16 value, quantized
            got_values, got_scales = exported[name], exported[f"{name}_scale_inv"]
            assert got_values.dtype == torch.float8_e4m3fn and got_scales.dtype == torch.float32, name
            assert torch.equal(got_values.view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(got_scales.view(torch.uint8), scales.view(torch.uint8)), name
        else:
            assert exported[name].dtype == torch.bfloat16, name
            assert torch.equal(exported[name], weight.to(torch.bfloat16)), name
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["quantization_config"] == QUANTIZATION_CONFIG


def test_the_trainer_refuses_to_load_an_fp8_checkpoint_as_unquantized_weights(tmp_path):
    save_hf(tmp_path, FP8_ARGS, random_canonical(FP8_ARGS, seed=0), "fp8")
    with pytest.raises(ValueError, match="unsupported config quantization_config"):
        load_hf(tmp_path)
