"""The trainer exports the dtype a generator serves: its float32 weights rounded to nearest even,
bit for bit what a refit into that dtype installs, from both export paths."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import _launch
from _launch import TRAIN
from trainer_svc.settings import TrainSettings


@pytest.mark.parametrize("ep", [1, 2], ids=["gathered-by-rank-0", "parallel-writers"])
def test_a_bfloat16_export_is_the_float32_export_rounded_to_nearest_even(tiny_dir, tmp_path, ep):
    exports = {}
    for dtype in ("float32", "bfloat16"):
        settings = TrainSettings(model_dir=tiny_dir, ep=ep, device="cpu", export_dir=str(tmp_path / dtype),
                                 export_dtype=dtype, **{**TRAIN, "steps": 1})
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
