"""What a colocated refit on one GPU could reach with today's kernels: the receiver copies every
unit straight from the sender's tensors through CUDA IPC (no staging, no pack), the sender
checksums its regions and the receiver checksums where they landed, against a device-to-device
copy of the same bytes. A probe for issue 32's GPU half, not the product's path.

    python -m bench.colocated_gpu_probe [--gib 4] [--reps 5] [--json PATH]

Two processes on GPU 0: the sender (the synthetic Qwen3-MoE-like model of `refit_bench.py`, one
expert-TP trainer rank holding everything) shares each tensor with `torch.multiprocessing`'s
CUDA IPC reduction; the receiver (vLLM's layout, TP 1) opens them once. Per round, timed in the
receiver from a common start: the sender's checksums of its units' regions, then the receiver's
per-unit copies (`copy_`, strided where the layouts differ) and its landed check; also the copies
alone and the copies plus only the landed check. Medians of `--reps` rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from bench.landed_gpu_bench import gpu_timed
from syncd.commands import checksum_key
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.cuda_ipc import source_checksums
from syncd.member.dataplane.landed import landed_checksums
from syncd.net import free_port
from testkit.colocated import plan_units, source_tensors

_WAIT = datetime.timedelta(seconds=120)


def unit_pairs(gib: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """In one process: (destination region, source region in its shape) of every unit of the
    colocated model, source random, destination zero (for kernel sweeps without IPC)."""
    src_cat, dst_cat, units = plan_units(gib)
    src = catalog_views(src_cat, source_tensors(gib))
    dst = catalog_views(
        dst_cat,
        {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device="cuda") for t in dst_cat.tensors},
    )
    pairs = []
    for u in units:
        d = dst[u.dst_tensor][u.dst_box.slices()]
        pairs.append((d, src[u.src_tensor][u.src_box.slices()].view(d.shape)))
    return pairs


def member(rank: int, port: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=_WAIT)
    src_cat, dst_cat, units = plan_units(args.gib)
    if rank == 0:
        own = source_tensors(args.gib)
        store.set("handles", pickle.dumps({k: reduce_tensor(v)[1] for k, v in own.items()}).hex())
        views = catalog_views(src_cat, own)
        for r in range(args.reps + 2):
            for name in ("refit", "fused"):
                store.wait([f"start/{r}/{name}"], _WAIT)
                sums = source_checksums(units, views).result()
                store.set(f"ready/{r}/{name}", json.dumps(sums))
                store.wait([f"done/{r}/{name}"], _WAIT)
        return
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handles = pickle.loads(bytes.fromhex(store.get("handles").decode()))
    theirs = catalog_views(src_cat, {k: rebuild_cuda_tensor(*v) for k, v in handles.items()})
    mine = catalog_views(
        dst_cat,
        {
            t.name: torch.full(t.shape, float("nan"), dtype=torch_dtype(t.dtype), device="cuda")
            for t in dst_cat.tensors
        },
    )
    pairs = []  # (destination region, source region in the destination's shape: same C order)
    for u in units:
        d = mine[u.dst_tensor][u.dst_box.slices()]
        pairs.append((d, theirs[u.src_tensor][u.src_box.slices()].view(d.shape)))
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    def copies() -> None:
        for d, s in pairs:
            d.copy_(s)

    def copies_then_landed_check() -> dict[str, str]:
        copies()
        return landed_checksums(units, mine)

    flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_b = torch.empty_like(flat_a)
    d2d_s = gpu_timed(lambda: flat_b.copy_(flat_a), args.reps)
    copies_s = gpu_timed(copies, args.reps)

    copies_landed_s = gpu_timed(copies_then_landed_check, args.reps)
    keys = [checksum_key(u.canonical, u.canon) for u in units]

    def copies_checksummed() -> dict[str, str]:
        """Each unit copied with the checksum of what it wrote, in one pass (`add_copy`)."""
        sums = Checksums()
        for key, (d, s) in zip(keys, pairs):
            sums.add_copy(key, d, s)
        return sums.result()

    fused_s = gpu_timed(copies_checksummed, args.reps)
    receivers = {"refit": copies_then_landed_check, "fused": copies_checksummed}
    refits: dict[str, list[float]] = {name: [] for name in receivers}
    agree, exact = True, False
    for r in range(args.reps + 2):
        for name, receive in receivers.items():
            for t in mine.values():
                t.view(torch.uint8).fill_(0xFF)  # NaNs: what a round did not write stays wrong
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            store.set(f"start/{r}/{name}", "1")
            store.wait([f"ready/{r}/{name}"], _WAIT)
            landed = receive()  # reads the sums back: the copies are done
            seconds = time.perf_counter() - t0
            agree = agree and landed == json.loads(store.get(f"ready/{r}/{name}"))
            if r == args.reps + 1:  # before the sender may leave: its memory is read here
                same = all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs)
                exact = same if name == "refit" else exact and same
            store.set(f"done/{r}/{name}", "1")
            if r >= 2:
                refits[name].append(seconds)
    refit_s, fused_refit_s = (statistics.median(refits[name]) for name in receivers)
    gbps = lambda s: round(nbytes / s / 1e9, 1)  # noqa: E731 - a local shorthand
    result = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "units": len(units),
        "d2d_gbps": gbps(d2d_s),
        "refit_gbps": gbps(refit_s),
        "refit_over_d2d": round(d2d_s / refit_s, 3),
        "copies_only_gbps": gbps(copies_s),
        "copies_and_landed_check_gbps": gbps(copies_landed_s),
        "fused_refit_gbps": gbps(fused_refit_s),
        "fused_refit_over_d2d": round(d2d_s / fused_refit_s, 3),
        "copies_checksummed_in_one_pass_gbps": gbps(fused_s),
        "checksums": agree,
        "bit_exact": exact,
        "reps": args.reps,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        member(args.rank, args.port, args)
        return
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)  # noqa: F841
    base = [sys.executable, __file__, "--gib", str(args.gib), "--reps", str(args.reps), "--port", str(port)]
    base += ["--json", args.json] if args.json else []
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=dict(os.environ)) for r in (0, 1)]
    while all(p.poll() is None for p in procs):  # one failing ends the other
        time.sleep(0.5)
    if any(p.poll() for p in procs):
        for p in procs:
            p.kill()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"member processes exited with {codes}")


if __name__ == "__main__":
    main()
