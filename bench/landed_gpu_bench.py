"""The landed check on one GPU against a device-to-device copy of the same bytes.

    python -m bench.landed_gpu_bench [--layers 8 --experts 64 --rounds 5] [--json PATH]

A receiver in vLLM's layout (TP 1) of an MoE of several GB (bf16, hidden 2048) holds its tensors
on the GPU; the landed check (`syncd.member.dataplane.landed.landed_checksums`: per unit of every
bucket the plan gives it, the same two reductions as the wire checksums) runs over all of them,
and is compared with `copy_` of one buffer of the same bytes into another (read + write, the
bound a verifying pass that reads once is held to); and, to show where the check's time goes, the
torch form of the same checksum (each region copied contiguous, then column and row sums: what
the check did before `checksum_kernel`) over the same units, and over each tensor whole
(contiguous: no copy first). Medians over `--rounds`, after a warm-up.
Issue 36 asks for the check at least half as fast as the copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from syncd.member.dataplane import catalog_views
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.landed import landed_checksums
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog


def gpu_timed(fn, rounds: int) -> float:
    """Median seconds of `fn` and the GPU work it queued, over `rounds`, after a warm-up."""
    fn()  # warm-up
    torch.cuda.synchronize()
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def landed_model(layers: int, experts: int, bucket_mib: float):
    """The receiver of this benchmark (vLLM's layout, TP 1, bf16 on the GPU, from ep 2 x tp 2
    senders): its units, its tensors by name and their catalog views."""
    shape = MoeShape(layers=layers, hidden=2048, experts=experts, moe_inter=768, heads=16)
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(shape, 2, e, 2, t))
        for e in range(2)
        for t in range(2)
    ]
    dest = DestMember("generator", vllm_catalog(shape, 1, 0))
    plan = make_plan(sources, [dest], bucket_bytes=int(bucket_mib * (1 << 20)))
    units = [u for b in plan.for_member("generator") for u in b.units]
    tensors = {
        t.name: torch.randn(t.shape, device="cuda", dtype=torch.bfloat16) * 0.02 for t in dest.catalog.tensors
    }
    return units, tensors, catalog_views(dest.catalog, tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mib", type=float, default=512)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    units, tensors, views = landed_model(args.layers, args.experts, args.bucket_mib)
    nbytes = sum(x.numel() * x.element_size() for x in tensors.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    check_s = gpu_timed(lambda: landed_checksums(units, views), args.rounds)
    copy_s = gpu_timed(lambda: dst.copy_(src), args.rounds)

    def whole_tensors() -> None:  # where the check's time goes: the algorithm, no copy first
        sums = Checksums()
        for name, x in tensors.items():
            sums.add(name, x.reshape(-1).view(torch.uint8))
        sums.result()

    def torch_form() -> None:  # the check before the in-place kernel: copy, then two reductions
        sums = Checksums()
        for u in units:
            region = views[u.dst_tensor][u.dst_box.slices()]
            sums.add("x", region.contiguous().reshape(-1).view(torch.uint8))
        sums.result()

    whole_s = gpu_timed(whole_tensors, args.rounds)
    torch_form_s = gpu_timed(torch_form, args.rounds)
    strided = sum(1 for u in units if not views[u.dst_tensor][u.dst_box.slices()].is_contiguous())
    result = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "units": len(units),
        "landed_check_s": check_s,
        "landed_check_gbps": nbytes / check_s / 1e9,
        "strided_units": strided,
        "torch_form_check_s": torch_form_s,
        "torch_form_over_d2d_speed": copy_s / torch_form_s,
        "same_algorithm_whole_tensors_gbps": nbytes / whole_s / 1e9,
        "d2d_copy_s": copy_s,
        "d2d_gbps": nbytes / copy_s / 1e9,
        "check_over_d2d_speed": copy_s / check_s,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
