"""What verifying what landed (`syncd.member.dataplane.landed`) costs, on CPU or on one GPU.

    python -m bench.landed_bench [--layers 24 --experts 128 --rounds 5 --bucket-mib 1] [--out PATH]
    python -m bench.landed_bench --device cuda [--layers 8 --experts 64 --rounds 5 --bucket-mib 512]

`--device cpu` (the default): four trainer ranks send to one receiver (`testkit.four_to_one`), each
a process of its own, over gloo, as in `make demo` (`--layers 4 --experts 8` is the demo's model).
Each round runs a full refit with the landed check and one without (`LoopOptions.verify_landed`),
in alternating order, in the same processes on the same transport; the wire checksums run in both.
Reports the receiver's median wall time of each, their ratio, and the check alone on the
receiver's tensors (the unpack fused with the check, as the loop runs it, minus the plain unpack
of the same buckets, timed after the refits). No vLLM: the in-place install checksums each layer
as it closes, the same pass over the same bytes.

`--device cuda`: a receiver in vLLM's layout (TP 1) of an MoE of several GB (bf16, hidden 2048)
holds its tensors on the GPU; the landed check (`landed_checksums`: per unit of every bucket the
plan gives it, the same two reductions as the wire checksums) runs over all of them, and is
compared with `copy_` of one buffer of the same bytes into another (read + write, the bound a
verifying pass that reads once is held to); and, to show where the check's time goes, the torch
form of the same checksum (each region copied contiguous, then column and row sums: what the check
did before `checksum_kernel`) over the same units, and over each tensor whole (contiguous: no copy
first). Medians over `--rounds`, after a warm-up. The bound: the check at least as fast as the
copy.

`--out PATH` (or `--json PATH`) writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from syncd.member.dataplane import (
    GcPause,
    LoopCache,
    LoopOptions,
    catalog_views,
    checksum_kernel,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.landed import landed_checksums
from syncd.member.dataplane.prepared import PreparedLoop
from syncd.plan import DestMember, SourceMember, TransferUnit, make_plan
from syncd.vocabulary import Direction
from testkit.four_to_one import RECEIVER, SENDERS, join_rank, moe_plan, run_members
from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

ON, OFF = "landed check on", "landed check off"
CHECK_ALONE = "the landed check alone"
# Per device: the model (layers, experts) and the bucket size in MiB.
_DEFAULTS = {"cpu": (24, 128, 1.0), "cuda": (8, 64, 512.0)}


def _member(rank: int, args: argparse.Namespace, address: str, results: dict) -> None:
    r = join_rank(rank, args, address, "landed-bench")
    me, sending, ranks, views, transport = r.me, r.sending, r.ranks, r.views, r.transport
    mine = r.plan.for_member(me)
    cache, pause = LoopCache(), GcPause()
    rows: list[dict[str, Any]] = []

    barrier = r.barrier

    def refit(method: str) -> None:
        options = LoopOptions(120, gc_pause=pause, verify_landed=method == ON)
        barrier()
        t0 = time.perf_counter()
        run = send_buckets if sending else recv_buckets
        stats = run(mine, views, transport, ranks, options, cache=cache)
        rows.append({"method": method, "seconds": time.perf_counter() - t0, "bytes": stats.bytes})

    for round_ in range(args.rounds + 1):
        for method in (ON, OFF) if round_ % 2 else (OFF, ON):
            refit(method)
    if not sending:  # the check alone, as the loop runs it: the unpack with it minus the unpack
        flat = torch.empty(max(b.nbytes for b in mine), dtype=torch.uint8)
        prepared = PreparedLoop(Direction.RECV).buckets(mine, views, [flat[: b.nbytes] for b in mine])
        for round_ in range(args.rounds + 1):
            t0 = time.perf_counter()
            sums = Checksums()
            for bucket in prepared:
                bucket.copy_and_checksum(sums)
            t1 = time.perf_counter()
            for bucket in prepared:
                bucket.copy()
            t2 = time.perf_counter()
            if round_:  # the first prepares
                rows.append({"method": CHECK_ALONE, "seconds": max(0.0, (t1 - t0) - (t2 - t1)), "bytes": 0})
    results[me] = rows[2:]  # the first round warms up
    transport.close()


def _cpu_report(args: argparse.Namespace) -> dict[str, Any]:
    """The refits with and without the check, four senders into one receiver over gloo."""
    _, _, plan = moe_plan(args)
    results = run_members(_member, args)
    seconds = {
        m: statistics.median(r["seconds"] for r in results[RECEIVER] if r["method"] == m)
        for m in (ON, OFF, CHECK_ALONE)
    }
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "plan_bytes": plan.total_bytes,
        "buckets": len(plan.buckets),
        "layers": args.layers,
        "experts": args.experts,
        "rounds": args.rounds,
        "bucket_mib": args.bucket_mib,
        "load": os.getloadavg(),
        "receiver_seconds": seconds,
        "ratio_on_over_off": seconds[ON] / seconds[OFF],
        "rows": results[RECEIVER],
    }
    print(
        f"{plan.total_bytes / 1e6:.1f} MB, {len(plan.buckets)} buckets, "
        f"{SENDERS} senders -> 1 receiver (gloo, CPU)"
    )
    for m in (ON, OFF, CHECK_ALONE):
        print(f"{m:<24} {seconds[m] * 1e3:8.2f} ms (median of {args.rounds})")
    print(f"ratio on / off: {report['ratio_on_over_off']:.3f}")
    return report


def gpu_timed(fn: Callable[[], object], rounds: int) -> float:
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


def landed_model(
    layers: int, experts: int, bucket_mib: float
) -> tuple[list[TransferUnit], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
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


def _cuda_report(args: argparse.Namespace) -> dict[str, Any]:
    """The check against a device-to-device copy of the same bytes, on GPU 0."""
    units, tensors, views = landed_model(args.layers, args.experts, args.bucket_mib)
    nbytes = sum(x.numel() * x.element_size() for x in tensors.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    cold_s = gpu_timed(lambda: landed_checksums(units, views), args.rounds)
    copy_s = gpu_timed(lambda: dst.copy_(src), args.rounds)
    # What a refit after the first runs: the regions described and uploaded once
    # (`PreparedBucket.landed`), each refit one launch per kernel variant and the fold.
    regions = [views[u.dst_tensor][u.dst_box.slices()] for u in units]
    keys = [f"unit{i}" for i in range(len(units))]
    described = [checksum_kernel.describe(r) for r in regions]
    assert all(d is not None for d in described), "every landed region takes the kernel"
    batch = checksum_kernel.Batch([d for d in described if d is not None])

    def prepared() -> None:
        sums = Checksums()
        sums.add_batch(keys, batch)
        sums.result()

    check_s = gpu_timed(prepared, args.rounds)

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
        "first_refit_check_s": cold_s,
        "first_refit_check_over_d2d_speed": copy_s / cold_s,
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
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, help="default 24 on cpu, 8 on cuda")
    parser.add_argument("--experts", type=int, help="default 128 on cpu, 64 on cuda")
    parser.add_argument("--bucket-mib", type=float, help="default 1 on cpu, 512 on cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", "--json", dest="out", default="", help="write the result here (JSON)")
    args = parser.parse_args()
    layers, experts, bucket_mib = _DEFAULTS[args.device]
    args.layers = args.layers or layers
    args.experts = args.experts or experts
    args.bucket_mib = args.bucket_mib or bucket_mib
    report = _cpu_report(args) if args.device == "cpu" else _cuda_report(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
