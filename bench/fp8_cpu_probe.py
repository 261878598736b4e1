"""Can vLLM on this CPU serve a blockwise-FP8 Qwen3-MoE? Writes the tiny model as the Qwen3-FP8
checkpoint format (attention and expert projections as e4m3 with one float32 `weight_scale_inv` per
128x128 block, from the reference quantizer; embedding, norms, router and head unquantized), starts
vLLM's offline engine on it and generates; prints one JSON line (the outcome, or the error).

    python -m bench.fp8_cpu_probe [--out bench/results/fp8-cpu-probe.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from syncd.member.dataplane.fp8 import quantize_blockwise
from trainer_svc.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
QUANTIZED = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def write_fp8_checkpoint(out: Path) -> Path:
    """The tiny model's float32 checkpoint re-written in the blockwise-FP8 checkpoint format."""
    src = make_tiny_checkpoint(out / "f32", seed=0)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(QUANTIZED):
            q, scale_inv = quantize_blockwise(t)
            tensors[name], tensors[name + "_scale_inv"] = q, scale_inv
        else:
            tensors[name] = t.to(torch.bfloat16)
    dst = out / "fp8"
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def serve(checkpoint: Path) -> None:
    """In its own process (vLLM's workers log the root cause of a failed start, not raise it)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        str(checkpoint), dtype="bfloat16", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True
    )
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=4, temperature=0))
    print(json.dumps({"tokens": list(out[0].outputs[0].token_ids)}))


def probe(checkpoint: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "bench.fp8_cpu_probe", "--serve", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    if run.returncode == 0:
        return {"serves": True, **json.loads(run.stdout.strip().splitlines()[-1])}
    lines = (run.stdout + run.stderr).splitlines()
    # The cause as vLLM's worker logged it: the error line and the reasons under it.
    cause = [re.sub(r"^.*\] ", "", l) for l in lines if re.search(r"Error: |requires ", l)]
    return {"serves": False, "cause": list(dict.fromkeys(cause))[:8]}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the engine's own process
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_fp8_checkpoint(Path(tmp))
        result = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": _cpu_model(),
            "amx_tiles": bool(torch.cpu._is_amx_tile_supported()),
            **probe(checkpoint),
        }
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
