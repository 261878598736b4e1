"""`apply_bench.py --device cuda`: the generator's install on one GPU, received parameter-format
buffers into parameter tensors.

    python -m bench.apply_bench --device cuda [--gib 8] [--rounds 11] [--out OUT]

A synthetic Qwen3-30B-A3B-shaped model in vLLM's TP=1 layout (`testkit.synthetic_moe.vllm_catalog`:
`qkv_proj`, `w13_weight [E, 2I, H]`, `w2_weight`, ...), bf16. The receiver holds one staging buffer
per parameter, as the generator's staging does, and a tensor per parameter standing in for vLLM's
(unquantized bf16 weights on GPU need no post-processing, so these are what the kernels read).
Each round, on the same bytes:

- install: `generator_svc.worker.install.copy_parameters` (one copy per parameter, the generator's code);
- d2d: one device-to-device copy of a flat buffer of the same size (the bandwidth anchor);
- per HF tensor: a copy per HF tensor into its slice of the parameter (what vLLM's loaders do,
  without their Python overhead), for scale.

GB/s = bytes installed / seconds (CUDA events), medians with min-max; the first round warms up.
After the last round every parameter is compared with its staging buffer (bit-exact).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch

from generator_svc.worker.install import copy_parameters
from syncd.layout import Catalog
from syncd.layout.dtypes import torch_dtype
from testkit.synthetic_moe import shape_for, vllm_catalog


def timed(fn: Callable[[], object], device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def hf_slices(
    catalog: Catalog, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) per HF tensor: experts split per expert, like the loaders."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in catalog.tensors:
        for p in t.pieces:
            dst, src = params[t.name][p.local.slices()], buffers[t.name][p.local.slices()]
            if len(p.local.shape) == 3:  # grouped experts: one HF tensor per expert
                pairs += [(dst[e], src[e]) for e in range(dst.shape[0])]
            else:
                pairs.append((dst, src))
    return pairs


def cuda_report(args: argparse.Namespace) -> dict[str, Any]:
    """The install, a flat copy and per-HF-tensor copies of `args.gib` GiB on GPU 0, over
    `args.rounds` rounds after a warm-up; prints a summary and returns the result."""
    device = torch.device("cuda", 0)
    shape = shape_for(args.gib)
    catalog = vllm_catalog(shape, tp=1, tp_rank=0)
    gen = torch.Generator(device=device).manual_seed(0)
    buffers = {
        t.name: torch.randn(t.shape, generator=gen, device=device).to(torch_dtype(t.dtype))
        for t in catalog.tensors
    }
    params = {name: torch.empty_like(b) for name, b in buffers.items()}
    nbytes = sum(b.numel() * b.element_size() for b in buffers.values())
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    pairs = hf_slices(catalog, params, buffers)

    def per_hf_tensor() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    methods = {
        "install": lambda: copy_parameters(params, buffers),
        "d2d": lambda: flat_dst.copy_(flat_src),
        "per_hf_tensor": per_hf_tensor,
    }
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds + 1):
        for name, fn in methods.items():
            seconds[name].append(timed(fn, device))
    copy_parameters(params, buffers)
    torch.cuda.synchronize(device)
    exact = all(torch.equal(params[n], buffers[n]) for n in buffers)
    gbps = {m: sorted(nbytes / s / 1e9 for s in v[1:]) for m, v in seconds.items()}
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "model": {**shape.__dict__, "bytes": nbytes, "parameters": len(buffers), "hf_tensors": len(pairs)},
        "reps": args.rounds,
        "bit_exact": exact,
        "gb_per_s": {m: {"median": statistics.median(v), "min": v[0], "max": v[-1]} for m, v in gbps.items()},
        "install_over_d2d": statistics.median(gbps["install"]) / statistics.median(gbps["d2d"]),
        "seconds": seconds,
    }
    print(
        f"{result['device']}: {nbytes / 1e9:.2f} GB, {len(buffers)} parameters, {len(pairs)} HF tensors, "
        f"bit-exact {exact}"
    )
    for m, g in result["gb_per_s"].items():
        print(f"  {m:<14} {g['median']:8.1f} GB/s  ({g['min']:.1f}-{g['max']:.1f})")
    print(f"  install / d2d  {result['install_over_d2d']:.3f}")
    return result
