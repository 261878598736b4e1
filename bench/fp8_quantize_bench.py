"""Blockwise-FP8 quantization on one GPU: what a sender feeding an FP8 generator would add per byte.

    python bench/fp8_quantize_bench.py [--gib 4] [--reps 7] [--json OUT]

Expert weights shaped like Qwen3-30B-A3B's (`[E, 2I, H]` w13 and `[E, H, I]` w2, bf16; I = 768 is
not a multiple of 128, so edge blocks are exercised), quantized by the reference quantizer
`syncd.dataplane.fp8.quantize_blockwise` (amax per 128x128 block -> scale -> e4m3), against a
device-to-device copy of the same bf16 bytes in the same run. GB/s counts bf16 input bytes; CUDA
events, medians with min-max, the first round warms up. The reference is written for clarity (a
zero-padded float32 copy, then block views), not speed: the ratio says what a fused
quantize-and-pack kernel would have to beat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from syncd.dataplane.fp8 import dequantize_blockwise, quantize_blockwise  # noqa: E402

EXPERTS, HIDDEN, INTER = 128, 2048, 768


def _timed(fn) -> float:  # noqa: ANN001
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    per_layer = EXPERTS * (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    layers = max(1, round(args.gib * 2**30 / per_layer))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for _ in range(layers):
        weights.append(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16))
        weights.append(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda").to(torch.bfloat16))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    times: dict[str, list[float]] = {"quantize": [], "d2d": []}
    for round_ in range(args.reps + 1):
        q = _timed(lambda: [quantize_blockwise(w) for w in weights])
        d = _timed(lambda: flat_dst.copy_(flat_src))
        if round_:
            times["quantize"].append(q)
            times["d2d"].append(d)
    w = weights[-1]
    q8, scales = quantize_blockwise(w)
    error = ((dequantize_blockwise(q8, scales) - w.float()).abs().max() / w.float().abs().max()).item()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
        "bf16_bytes": nbytes, "tensors": len(weights), "reps": args.reps,
        "quantize_gbps": round(gbps["quantize"], 1), "d2d_gbps": round(gbps["d2d"], 1),
        "quantize_vs_d2d": round(gbps["quantize"] / gbps["d2d"], 3),
        "gbps_min_max": {k: [round(nbytes / max(v) / 1e9, 1), round(nbytes / min(v) / 1e9, 1)] for k, v in times.items()},
        "max_dequantize_error_vs_amax": error,
    }
    print(f"{nbytes / 1e9:.2f} GB bf16 in {len(weights)} expert tensors on {result['device']}: quantize "
          f"{result['quantize_gbps']} GB/s, d2d copy {result['d2d_gbps']} GB/s, ratio {result['quantize_vs_d2d']}; "
          f"max |dequantized - x| / max |x| = {error:.3g}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
