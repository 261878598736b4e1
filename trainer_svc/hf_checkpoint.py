"""HF checkpoint directories (config.json + safetensors) <-> canonical tensors, whole on one process.

Reading groups the per-expert HF tensors into canonical ones and checks every shape against the
config; writing splits them back and stores each tensor in the export's dtype (`export_dtype`).
Rank-parallel writing is `parallel_export.py`; reading only a rank's boxes is `sharded_io.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from syncd.layout import hf_names
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.export_dtype import stored_tensors

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


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
