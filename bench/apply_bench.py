"""How long installing a received version into the generator's weights takes, on CPU or one GPU.

    python -m bench.apply_bench [--layers 24 --experts 128 --dtype bfloat16 --rounds 3 --bucket-mib 16]
                                [--out bench/results/apply-cpu.json] [--keep-model DIR]
    python -m bench.apply_bench --device cuda [--gib 8] [--rounds 11] [--out OUT]

`--device cuda` installs a synthetic Qwen3-30B-A3B-shaped model's buffers into parameter tensors
on one GPU, against a device-to-device copy (`bench/apply_cuda.py` says what it measures).
`--device cpu` (the default) installs into a live vLLM engine on CPU, in one process:
a random Qwen3-MoE with tiny dims (hidden 128, MoE intermediate 64) but a real model's layer and
expert counts, in bfloat16 (24 x 128: 154 MB, 9,435 HF tensors, 219 vLLM parameters), is staged
once in the generator's staging buffers; then each round times, inside the engine's worker:

- loader: vLLM's loader path inside the layerwise-reload lifecycle (what the commit ran before the
  install by parameter): `load_weights(staging.hf_weights())`, one call per HF tensor;
- copy: a plain copy of the same bytes into tensors shaped like the parameters (checkpoint format);
- install: the generator's install (`start_weight_update` / `update_weights` / `finish_weight_update`
  with `generator_svc.worker.install`), with its own split into copies and post-processing
  (`process_weights_after_loading` of each layer, the CPU linear repack and MoE prepack), which is
  the "post-processing alone" figure;
- inplace: the `inplace` mode's install (`generator_svc.worker.inplace`): the checkpoint packed once (outside
  the timing) into `--bucket-mib` buckets as a one-rank trainer sends them, each unpacked into the
  live layers inside the layerwise reload, every layer post-processed when complete; with its peak
  of open layers, i.e. its extra memory beside one receive buffer.

Medians over the rounds (the first round also warms up). Every install is checked to install every
parameter without the loader fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_checkpoint(out_dir: Path, layers: int, experts: int, dtype: str) -> Path:
    """The tiny-dims model with `layers` x `experts`, saved in `dtype`."""
    import torch
    from safetensors.torch import load_file, save_file

    from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

    make_tiny_checkpoint(
        out_dir, seed=0, args=replace(TINY_ARGS, num_hidden_layers=layers, num_experts=experts)
    )
    weights = out_dir / "model.safetensors"
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# The functions below run inside the vLLM worker (collective_rpc sends them by value).


def time_loader_path(worker) -> float:
    from generator_svc.vllm_adapter import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        set_current_vllm_config,
    )

    model, staging = worker._ws_model(), worker._ws_mode.staging
    start = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        model.load_weights(staging.hf_weights())
        finalize_layerwise_reload(model, worker.model_config)
    return time.perf_counter() - start


def time_plain_copy(worker) -> float:
    import torch

    buffers = worker._ws_mode.staging.buffers
    targets = {n: torch.empty_like(b) for n, b in buffers.items()}
    start = time.perf_counter()
    for name, buf in buffers.items():
        targets[name].copy_(buf)
    return time.perf_counter() - start


def time_install(worker) -> dict:
    start = time.perf_counter()
    worker.start_weight_update()
    worker.update_weights({"version": "bench"})
    worker.finish_weight_update()
    total = time.perf_counter() - start
    report = worker.weight_transfer_engine.last_install.to_wire()
    return {
        "total_s": total,
        **{
            k: report[k]
            for k in (
                "copy_s",
                "process_s",
                "layers_processed",
                "params_copied",
                "bytes_copied",
                "fallback_params",
            )
        },
    }


def time_inplace(worker, checkpoint: str, bucket_bytes: int) -> dict:
    """The inplace mode's install (`generator_svc.worker.inplace`): already packed buckets (packed once,
    outside the timing, as a one-rank trainer sends them) unpacked into the live layers inside the
    layerwise reload, each layer post-processed as it completes."""
    from testkit.worker_aids import checkpoint_buckets, install_buckets

    packed = getattr(worker, "_bench_packed", None)
    if packed is None:
        packed = worker._bench_packed = checkpoint_buckets(
            worker._ws_catalog, worker._ws_member_id, checkpoint, bucket_bytes
        )
    start = time.perf_counter()
    receiver = install_buckets(
        worker._ws_model(), worker._ws_catalog, worker.device, worker.vllm_config, packed
    )
    total = time.perf_counter() - start
    report = receiver.report.to_wire()
    return {
        "total_s": total,
        "buckets": len(packed),
        "largest_bucket_bytes": max(b.nbytes for b, _ in packed),
        **{k: report[k] for k in ("copy_s", "process_s", "peak_open_bytes")},
    }


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM

    from generator_svc.worker_protocol import WorkerSetup

    model_dir = (
        Path(args.keep_model) if args.keep_model else Path(tempfile.mkdtemp(prefix="apply_bench_")) / "model"
    )
    model = make_checkpoint(model_dir, args.layers, args.experts, args.dtype)
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        hf_tensors = len(list(f.keys()))
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        dtype=args.dtype,
        worker_extension_cls="generator_svc.worker.WeightSyncExtension",
        weight_transfer_config={"backend": "syncd_staging"},
    )
    setup = llm.collective_rpc("ws_setup", args=(WorkerSetup(replica=0).to_wire(),))[0]
    staged = llm.collective_rpc("ws_stage_file", args=(str(model), "bench"))[0]
    rounds: dict[str, list] = {"loader": [], "copy": [], "install": [], "inplace": []}
    for _ in range(args.rounds + 1):  # round 0 warms up
        rounds["loader"].append(llm.collective_rpc(time_loader_path)[0])
        rounds["copy"].append(llm.collective_rpc(time_plain_copy)[0])
        rounds["install"].append(llm.collective_rpc(time_install)[0])
        rounds["inplace"].append(
            llm.collective_rpc(time_inplace, args=(str(model), args.bucket_mib << 20))[0]
        )
    installs = rounds["install"][1:]
    if any(i["fallback_params"] for i in installs):
        raise RuntimeError(
            f"the install fell back to vLLM's loaders for {installs[0]['fallback_params'][:5]}"
        )
    med = statistics.median
    loader, copy = med(rounds["loader"][1:]), med(rounds["copy"][1:])
    install, process = med(i["total_s"] for i in installs), med(i["process_s"] for i in installs)
    inplace = rounds["inplace"][1:]
    inplace_s = med(i["total_s"] for i in inplace)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": (
            f"{platform.node()}, {os.cpu_count()} cores, {_cpu_model()}, load {os.getloadavg()[0]:.1f}"
        ),
        "model": {
            "layers": args.layers,
            "experts": args.experts,
            "dtype": args.dtype,
            "bytes": setup["nbytes"],
            "vllm_parameters": installs[0]["params_copied"],
            "canonical_tensors": staged["tensors"],
            "hf_tensors": hf_tensors,
        },
        "rounds": args.rounds,
        "seconds": {
            "loader_path": loader,
            "plain_copy": copy,
            "post_processing": process,
            "install_staged": install,
            "install_copies": med(i["copy_s"] for i in installs),
            "install_inplace": inplace_s,
        },
        "ratios": {
            "install_over_loader": install / loader,
            "install_over_copy_plus_post": install / (copy + process),
            "inplace_over_loader": inplace_s / loader,
            "inplace_over_copy_plus_post": inplace_s / (copy + process),
        },
        "inplace": {
            "bucket_bytes": inplace[0]["largest_bucket_bytes"],
            "buckets": inplace[0]["buckets"],
            "peak_open_bytes": max(i["peak_open_bytes"] for i in inplace),
            # one receive buffer (inplace's default depth) plus the layers open at the peak
            "extra_bytes": inplace[0]["largest_bucket_bytes"] + max(i["peak_open_bytes"] for i in inplace),
        },
        "goal": {"install_over_loader_max": 1 / 8, "install_over_copy_plus_post_max": 3.0},
        "layers_processed": installs[0]["layers_processed"],
        "raw": rounds,
    }


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gib", type=float, default=8.0, help="cuda: model size")
    parser.add_argument(
        "--rounds", "--reps", dest="rounds", type=int, help="timed rounds (default 3 on cpu, 11 on cuda)"
    )
    parser.add_argument(
        "--bucket-mib", type=int, default=16, help="inplace: bucket size the checkpoint is packed in"
    )
    parser.add_argument("--out", "--json", dest="out", default="", help="write the result here (JSON)")
    parser.add_argument(
        "--keep-model", default="", help="write the model here and keep it (e.g. for the demo's --model-dir)"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        _main_cuda(args)
        return
    args.rounds = args.rounds or 3
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the timing functions
    result = run(args)
    s, r = result["seconds"], result["ratios"]
    print(f"model: {result['model']}")
    for name, value in s.items():
        print(f"  {name:<16} {value:8.4f} s")
    print(f"  install / loader path            {r['install_over_loader']:.3f}  (goal <= 0.125)")
    print(f"  install / (copy + post-process)  {r['install_over_copy_plus_post']:.2f}  (goal <= 3)")
    print(f"  inplace / loader path            {r['inplace_over_loader']:.3f}")
    print(f"  inplace / (copy + post-process)  {r['inplace_over_copy_plus_post']:.2f}")
    ip = result["inplace"]
    print(
        f"  inplace extra memory: one {ip['bucket_bytes'] / 1e6:.1f} MB bucket + "
        f"{ip['peak_open_bytes'] / 1e6:.1f} MB of layers open at the peak = {ip['extra_bytes'] / 1e6:.1f} MB "
        f"({ip['extra_bytes'] / ip['bucket_bytes']:.2f} buckets); "
        f"staged keeps {result['model']['bytes'] / 1e6:.1f} MB"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    os._exit(0)  # skip vLLM's slow teardown


def _main_cuda(args: argparse.Namespace) -> None:
    from bench.apply_cuda import cuda_report

    args.rounds = args.rounds or 11
    result = cuda_report(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if not result["bit_exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
