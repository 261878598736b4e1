"""Blockwise-FP8 on one GPU: what a sender feeding an FP8 generator adds per byte.

    python bench/fp8_quantize_bench.py [--gib 4] [--reps 7] [--bucket-mib 512] [--json OUT]

A bfloat16 trainer rank (Qwen3-30B-A3B-shaped layers: hidden 2048, 128 experts of intermediate
768; all multiples of 128, as real models are: edge blocks are the tests' business) packs the
buckets of its refit plan into a blockwise-FP8 vLLM rank
(`syncd.plan.fp8_blocks.blockwise_fp8_catalog`), i.e. the real sender's quantize-and-pack
(`syncd.member.dataplane.pack.copy_pairs`, built once as the sender's prepared loop builds it, run
per refit: the fused Triton kernel of `fp8_kernel`, values and scales of the same blocks from one
read), against, in the same run:
- the same packing with the reference quantizer (`fp8_kernel.available` patched to refuse);
- the same rank packing for a bfloat16 generator (plain copies into the buckets);
- a device-to-device copy of the same bf16 bytes (the memory-bandwidth anchor);
- the reference quantizer alone on the expert tensors (`quantize_blockwise`).
GB/s count the trainer's bf16 input bytes; CUDA events, medians with min-max, the first round
warms up. Also reported: wire bytes of both plans (FP8 sends about half of bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from syncd.member.dataplane import catalog_views, fp8_kernel
from syncd.member.dataplane.fp8 import dequantize_blockwise, quantize_blockwise
from syncd.member.dataplane.pack import copy_pairs
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.fp8_blocks import blockwise_fp8_catalog
from syncd.vocabulary import Direction
from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

LAYER = MoeShape(
    layers=1, hidden=2048, experts=128, moe_inter=768, heads=32, kv_heads=4, head_dim=128, vocab=32768
)


def _timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _layers_for(gib: float) -> int:
    per_layer = sum(c.nbytes for c in LAYER.canonical()) - 2 * LAYER.vocab * LAYER.hidden * 2
    return max(1, round(gib * 2**30 / per_layer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    shape = replace(LAYER, layers=_layers_for(args.gib))
    src_cat = trainer_catalog(shape, 1, 0, 1, 0)
    source = [SourceMember("trainer-0", 0, src_cat)]
    plans = {
        "fp8": make_plan(
            source,
            [DestMember("g", blockwise_fp8_catalog(vllm_catalog(shape, 1, 0)))],
            bucket_bytes=args.bucket_mib << 20,
        ),
        "bf16": make_plan(
            source, [DestMember("g", vllm_catalog(shape, 1, 0))], bucket_bytes=args.bucket_mib << 20
        ),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        t.name: torch.randn(t.shape, generator=gen, device="cuda").to(torch.bfloat16) for t in src_cat.tensors
    }
    views = catalog_views(src_cat, tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    buffer = torch.empty(args.bucket_mib << 20, dtype=torch.uint8, device="cuda")
    flat_src, flat_dst = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )
    experts = [t for name, t in tensors.items() if ".experts." in name]
    expert_bytes = sum(t.numel() * t.element_size() for t in experts)

    def prepared(plan) -> Callable[[], None]:
        """The plan's packing as the sender's loops run it on every refit after the first
        (`PreparedBucket.copy`): each bucket's copies and quantizer launches built once, run."""
        copies = [copy_pairs(Direction.SEND, bucket, views, buffer) for bucket in plan.buckets]

        def run() -> None:
            for c in copies:
                c.run()

        return run

    pack_fp8, pack_bf16 = prepared(plans["fp8"]), prepared(plans["bf16"])
    # The packer takes the fused kernel wherever `available` says so; for this measurement only,
    # it says never (decided when the copies are built).
    with mock.patch.object(fp8_kernel, "available", lambda t: False):
        pack_reference = prepared(plans["fp8"])

    runs = {
        "pack_fp8": pack_fp8,
        "pack_fp8_reference": pack_reference,
        "pack_bf16": pack_bf16,
        "d2d": lambda: flat_dst.copy_(flat_src),
        "quantize_experts": lambda: [quantize_blockwise(t) for t in experts],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for round_ in range(args.reps + 1):
        for name, fn in runs.items():
            seconds = _timed(fn)
            if round_:
                times[name].append(seconds)
    input_bytes = {k: expert_bytes if k == "quantize_experts" else nbytes for k in runs}
    gbps = {k: input_bytes[k] / statistics.median(v) / 1e9 for k, v in times.items()}
    w = experts[-1]
    q8, scales = quantize_blockwise(w)
    error = ((dequantize_blockwise(q8, scales) - w.float()).abs().max() / w.float().abs().max()).item()
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "layers": shape.layers,
        "bf16_input_bytes": nbytes,
        "bucket_mib": args.bucket_mib,
        "reps": args.reps,
        "wire_bytes": {k: p.total_bytes for k, p in plans.items()},
        "buckets": {k: len(p.buckets) for k, p in plans.items()},
        "gbps": {k: round(v, 1) for k, v in gbps.items()},
        "gbps_min_max": {
            k: [round(input_bytes[k] / max(v) / 1e9, 1), round(input_bytes[k] / min(v) / 1e9, 1)]
            for k, v in times.items()
        },
        "pack_fp8_vs_d2d": round(gbps["pack_fp8"] / gbps["d2d"], 3),
        "pack_fp8_vs_pack_bf16": round(gbps["pack_fp8"] / gbps["pack_bf16"], 3),
        "pack_fp8_vs_reference": round(gbps["pack_fp8"] / gbps["pack_fp8_reference"], 2),
        "fused_kernel": fp8_kernel.available(next(iter(tensors.values()))),
        "max_dequantize_error_vs_amax": error,
    }
    print(
        f"{nbytes / 1e9:.2f} GB bf16 ({shape.layers} layers) on {result['device']}: pack into FP8 "
        f"{result['gbps']['pack_fp8']} GB/s ({result['pack_fp8_vs_d2d']} of d2d copy "
        f"{result['gbps']['d2d']} GB/s, {result['pack_fp8_vs_pack_bf16']} of packing bf16 "
        f"{result['gbps']['pack_bf16']} GB/s; the reference "
        f"quantizer packs {result['gbps']['pack_fp8_reference']} GB/s); wire "
        f"{plans['fp8'].total_bytes / 1e9:.2f} GB FP8 vs {plans['bf16'].total_bytes / 1e9:.2f} GB bf16"
    )
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
